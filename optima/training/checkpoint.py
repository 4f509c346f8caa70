"""Save a servable checkpoint from a (possibly sharded) trainer, check it, and find the state to resume from.

Under DeepSpeed ZeRO-3 and FSDP every process holds only a shard of each parameter: the model object on the
main process has empty or partial tensors, so ``model.save_pretrained()`` there writes a broken checkpoint. Here
the weights go through ``accelerator.get_state_dict``, a collective that gathers the full tensors onto the main
process (every process must call it), and only the main process writes. A LoRA run is merged after gathering:
the adapter and base weights are loaded into a fresh copy of the base model on the main process and merged
there, so the same path serves DDP, FSDP and ZeRO-3.

Before the completion marker is written, what was saved is checked against the architecture in ``config.json``
(``verify_saved_checkpoint``): every parameter present with its expected shape, no empty tensor (ZeRO-3's
placeholders) and no weight matrix that is all zeros. The tensors are checked in the state dict the main process
just wrote (it holds the gathered weights anyway), the files through their safetensors headers only (every
parameter declared, with its shape, each file as long as its header says): the weights are not read back from
disk. A checkpoint that fails is never marked complete. ``verify_saved_weights`` checks a folder from its files
alone (read one tensor at a time: rank 0 of a 70B run cannot hold the checkpoint twice), for checkpoints that
are not in memory.

ZeRO-3: accelerate sets an HF DeepSpeed config on every process, and while it is set transformers builds every
model inside ``deepspeed.zero.Init``, whose parameter set-up is a collective (a broadcast from rank 0). The check
and the LoRA merge run on the main process alone, so a model built there would wait for ranks that are already
in the final barrier: the stage hangs until the NCCL timeout. Both therefore build their models under
``outside_zero3`` (that config unset for the moment), on the meta device, and the merge fills its model with the
gathered tensors themselves (``assign``), so nothing is loaded from disk a second time.

Resuming: a trainer YAML with ``save_strategy: steps`` writes ``checkpoint-<step>`` folders into ``output_dir``
while it trains. With ``resume_from_checkpoint: true`` a rerun continues from the newest of them (weights,
optimizer, scheduler, RNG states and the data position), instead of starting over (``resume_checkpoint``).
The orchestrator keeps those folders when it clears a killed stage's output (``clear_partial_output``).

This module imports torch only inside the functions that need it; the orchestrator uses the path helpers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TRAINER_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR + global step


class CheckpointError(RuntimeError):
    """The saved checkpoint is incomplete or broken; the message names the folder and the bad tensors."""


def trainer_checkpoints(output_dir: Path) -> list[Path]:
    """The trainer's intermediate ``checkpoint-<step>`` folders in ``output_dir``, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := TRAINER_CHECKPOINT.match(p.name))]
    return [path for _, path in sorted(found) if path.is_dir()]


def clear_partial_output(output_dir: Path) -> list[Path]:
    """Remove what a killed training stage left in ``output_dir``, except the trainer's resumable checkpoints.

    Returns:
        The ``checkpoint-<step>`` folders kept (the next run may resume from the newest).
    """
    output_dir = Path(output_dir)
    kept = trainer_checkpoints(output_dir)
    if not output_dir.exists():
        return kept
    for path in output_dir.iterdir():
        if path in kept:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if kept:
        logger.info("train | kept %d resumable trainer checkpoint(s), newest %s", len(kept), kept[-1])
    return kept


def resume_checkpoint(training_args: Any) -> str | None:
    """The trainer state to resume from, or None to start fresh.

    ``resume_from_checkpoint`` in the trainer YAML: unset/false -> None; ``true`` (or ``latest``) -> the newest
    complete ``checkpoint-<step>`` in ``output_dir`` (None when there is none yet); anything else is a path,
    which must exist.
    """
    value = training_args.resume_from_checkpoint
    if value is None or value is False or str(value).lower() in ("", "false", "no", "none"):
        return None
    if value is True or str(value).lower() in ("true", "yes", "latest"):
        saved = trainer_checkpoints(Path(training_args.output_dir))
        complete = [path for path in saved if (path / "trainer_state.json").is_file()]  # written last by the trainer
        return str(complete[-1]) if complete else None
    if not Path(value).is_dir():
        raise FileNotFoundError(f"resume_from_checkpoint: {value!r} is not a folder")
    return str(value)


def save_servable(trainer: Any, tokenizer: Any, output_dir: str) -> dict | None:
    """Write the full (LoRA-merged) weights, config and tokenizer to ``output_dir`` from the main process.

    Every process must call this: gathering sharded weights is a collective operation.

    Returns:
        On the main process, the state dict that was written (full tensors, in memory); elsewhere None.
    """
    accelerator = trainer.accelerator
    # model_wrapped is the DeepSpeed engine / FSDP / DDP module: what get_state_dict knows how to gather.
    state_dict = accelerator.get_state_dict(trainer.model_wrapped)
    if not accelerator.is_main_process:
        return None
    model = accelerator.unwrap_model(trainer.model)
    if hasattr(model, "merge_and_unload"):
        model, state_dict = merge_lora(model, state_dict), None
    # With a state dict given, save_pretrained ignores the (possibly empty, sharded) tensors of the model object.
    model.save_pretrained(output_dir, state_dict=state_dict)
    tokenizer.save_pretrained(output_dir)
    # The merged model is a plain one on this process; its parameters are what was written (its state_dict() can
    # come back empty while FSDP2's hooks are installed in the process).
    return state_dict if state_dict is not None else dict(model.named_parameters())


@contextlib.contextmanager
def outside_zero3() -> Iterator[None]:
    """Inside, transformers builds models whole on this process: its ZeRO-3 hook (``zero.Init``) is off.

    accelerate keeps an HF DeepSpeed config set for the whole run; with ZeRO-3 it makes ``from_config`` and
    ``from_pretrained`` partition the new model over all processes (collectives). A model that only the main
    process builds must not do that. The config object is kept alive by the trainer's arguments and set back.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    reference = hf_deepspeed._hf_deepspeed_config_weak_ref  # transformers keeps only this module-level weakref
    config = reference() if reference is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if config is not None:
            hf_deepspeed.set_hf_deepspeed_config(config)


def merge_lora(peft_model: Any, state_dict: dict) -> Any:
    """A plain model with the gathered LoRA weights merged, built on the main process alone.

    The model is built on the meta device outside ZeRO-3 (no collective) and takes the gathered tensors as its
    own (``assign=True``): the base weights are in memory once, and nothing is read from disk again.
    """
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base_config = peft_model.get_base_model().config
    dtype = next(iter(state_dict.values())).dtype if state_dict else torch.float32
    with outside_zero3(), torch.device("meta"):
        fresh = get_peft_model(
            AutoModelForCausalLM.from_config(base_config, dtype=dtype),
            peft_model.peft_config[peft_model.active_adapter],
        )
    missing, unexpected = fresh.load_state_dict(state_dict, strict=False, assign=True)
    if missing or unexpected:
        raise CheckpointError(f"LoRA state dict does not fit its base model: missing {missing}, extra {unexpected}")
    return fresh.merge_and_unload()


def expected_parameters(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter the architecture in ``checkpoint/config.json`` has (tied ones once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    with outside_zero3(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def iter_saved_weights(checkpoint: Path) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every tensor in the checkpoint's safetensors files, read one at a time."""
    from safetensors import safe_open

    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{checkpoint}: no *.safetensors weights were written")
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                yield name, handle.get_tensor(name)


def tensor_problem(name: str, tensor: Any, shape: tuple[int, ...]) -> str | None:
    """What is wrong with one saved tensor against its expected shape (None: nothing)."""
    if tuple(tensor.shape) != shape:
        return f"{name}: shape {tuple(tensor.shape)}, expected {shape}"
    if tensor.numel() == 0:
        return f"{name}: empty"
    if tensor.dim() >= 2 and not tensor.any():
        return f"{name}: all zeros"
    return None


def find_weight_problems(expected: dict[str, tuple[int, ...]], saved: Any) -> list[str]:
    """What is wrong with ``saved`` against the expected names and shapes (empty list: nothing).

    Args:
        expected: Parameter name -> shape (``expected_parameters``).
        saved: (name, tensor) pairs (an iterator: each tensor is dropped once checked) or a name -> tensor dict.
    """
    pairs = saved.items() if isinstance(saved, dict) else saved
    problems, seen = [], set()
    for name, tensor in pairs:
        if name in expected:
            seen.add(name)
            problem = tensor_problem(name, tensor, expected[name])
            problems += [problem] if problem else []
    return [f"{name}: missing" for name in expected if name not in seen] + problems


def verify_saved_weights(checkpoint: Path) -> int:
    """Check the saved weights against the architecture; return the tensor count.

    Raises:
        CheckpointError: naming the folder and up to ten bad tensors.
    """
    expected = expected_parameters(checkpoint)
    raise_problems(checkpoint, find_weight_problems(expected, iter_saved_weights(checkpoint)))
    return len(expected)


def saved_headers(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the checkpoint's safetensors files, from their headers alone.

    Each file must be as long as its header says (a truncated write fails here); no tensor data is read.
    """
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{checkpoint}: no *.safetensors weights were written")
    shapes = {}
    for path in files:
        with path.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        header.pop("__metadata__", None)
        end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
        if path.stat().st_size != 8 + size + end:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, its header describes {8 + size + end}")
        shapes |= {name: tuple(entry["shape"]) for name, entry in header.items()}
    return shapes


def verify_saved_checkpoint(checkpoint: Path, state_dict: dict) -> int:
    """Check what was just saved from the state dict in memory, and the files by their headers; the tensor count.

    The tensors are checked where they already are (in memory: every parameter of the architecture present, with
    its shape, none empty or all zeros), and the files only for what they declare (every parameter, with that
    shape, and as many bytes as the header says): nothing is read back from disk (``verify_saved_weights`` does).

    Raises:
        CheckpointError: naming the folder and up to ten problems.
    """
    expected = expected_parameters(checkpoint)
    problems = find_weight_problems(expected, state_dict)
    saved = saved_headers(checkpoint)
    problems += [f"{name}: not in the saved files" for name in expected if name not in saved]
    problems += [
        f"{name}: saved with shape {saved[name]}, expected {shape}"
        for name, shape in expected.items()
        if name in saved and saved[name] != shape
    ]
    raise_problems(checkpoint, problems)
    return len(expected)


def raise_problems(checkpoint: Path, problems: list[str]) -> None:
    """Raise ``CheckpointError`` naming the folder and up to ten of ``problems`` (none: nothing)."""
    if problems:
        shown = "; ".join(problems[:10]) + (f"; ... {len(problems) - 10} more" if len(problems) > 10 else "")
        raise CheckpointError(f"{checkpoint}: the saved weights are incomplete ({len(problems)} problems): {shown}")


def remove_trainer_checkpoints(output_dir: Path) -> None:
    """Delete the intermediate ``checkpoint-<step>`` folders once the final checkpoint is complete (disk space)."""
    for path in trainer_checkpoints(Path(output_dir)):
        shutil.rmtree(path)
