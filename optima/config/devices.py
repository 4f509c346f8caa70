"""Which GPUs the vLLM replicas use: the recipe's ``devices`` and the evaluation scripts' ``--device`` (pure).

The meanings of the released recipes and command lines are kept, so they pick the same GPUs here
(docs/method.md, D1):

* recipe ``devices: N`` (an integer): GPUs ``0..N``: GPU ``N`` and GPUs ``0..N-1`` beside it, so
  ``devices: 7`` means eight GPUs, 0 to 7.
* recipe ``devices: [0, 3]`` or ``"0,3"``: exactly those GPUs (``[3]`` or ``"3"`` for GPU 3 alone).
* ``inference_script.py --device d``: GPUs ``d..d+3`` (four servers from GPU d).
* ``multi_sc_data_generate_script.py --device d``: GPUs ``d..d+7`` (eight servers from GPU d).
* ``--device 0,3`` (a comma list, our addition): exactly those GPUs.
* not given: every visible GPU (the released commands' defaults, ``--device 7`` and ``--device 0``, assumed 8 GPUs).

GPU numbers count the GPUs this process sees, in ``CUDA_VISIBLE_DEVICES`` order (as CUDA numbers them); without
that variable they are the machine's GPU ids. Each GPU (or ``tensor_parallel_size`` GPUs) runs one replica.
"""

from __future__ import annotations

from optima.config.fields import RecipeError, require

SWEEP_DEVICE_SPAN = 4  # inference_script.py --device d: GPUs d..d+3
SC_DEVICE_SPAN = 8  # multi_sc_data_generate_script.py --device d: GPUs d..d+7


def _parse_list(field_name: str, value: str) -> list[int]:
    parts = [part.strip() for part in value.split(",") if part.strip()]
    require(
        bool(parts) and all(p.isascii() and p.isdigit() for p in parts),
        field_name,
        f"expected GPU ids like [0, 1] or '0,1', got {value!r}",
    )
    return [int(p) for p in parts]


def _check(field_name: str, devices: list[int], value: object) -> list[int]:
    ints = all(isinstance(d, int) and not isinstance(d, bool) for d in devices)
    require(ints, field_name, f"expected GPU ids like [0, 1] or '0,1', got {value!r}")
    require(all(d >= 0 for d in devices), field_name, f"GPU ids must be >= 0, got {value!r}")
    require(len(devices) == len(set(devices)), field_name, f"lists a GPU twice: {value!r}")
    return devices


def parse_devices(value: int | str | list[int] | None, name: str = "devices") -> list[int] | None:
    """A recipe's GPU field as a list of GPU numbers (``None``: every visible GPU, or the field's default).

    ``devices``: ``7`` -> [0, 1, ..., 7] (docs/method.md, D1); any other field (``loss_devices``, which is ours):
    ``7`` -> [7]. Both: ``[3]`` or ``"3"`` -> [3], ``"0,1"`` -> [0, 1].

    Raises:
        RecipeError: not GPU numbers, a negative one, or one listed twice.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise RecipeError(name, f"expected GPU ids like [0, 1] or '0,1', got {value!r}")
    if isinstance(value, int):
        require(value >= 0, name, f"GPU ids must be >= 0, got {value!r}")
        return list(range(value + 1)) if name == "devices" else [value]
    devices = _parse_list(name, value) if isinstance(value, str) else list(value)
    return _check(name, devices, value)


def expand_device_flag(value: str, span: int) -> list[int]:
    """``--device`` of an evaluation script as GPU numbers: ``d`` -> d..d+span-1; ``"0,3"`` -> [0, 3].

    Args:
        value: The flag as given on the command line.
        span: GPUs that the script's ``--device d`` names from ``d`` on (``SWEEP_DEVICE_SPAN`` or ``SC_DEVICE_SPAN``).

    Raises:
        RecipeError: (field ``--device``) not a GPU number or a comma list of them.
    """
    devices = _parse_list("--device", value)
    if "," not in value:
        return list(range(devices[0], devices[0] + span))
    return _check("--device", devices, value)
