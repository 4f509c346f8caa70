"""The accelerate configs a training stage may use: which file a recipe's ``accelerate_config`` names, what it says,
and the distributed strategy the hardware allocation estimates memory for.

The shipped configs are ``alignment-handbook/recipes/accelerate_configs/<name>.yaml``; the training launch
(``optima.training.launch_config``) hands the same file to ``accelerate launch``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optima.environments import REPO_ROOT

ACCELERATE_CONFIGS = REPO_ROOT / "alignment-handbook" / "recipes" / "accelerate_configs"


def resolve_accelerate_config(name: str | None, gpu: bool) -> Path:
    """A config name (``cpu``, ``single_gpu``, ``multi_gpu``, ``deepspeed_zero3``, ``fsdp``) or YAML path -> path.

    Args:
        name: From the recipe; ``None`` picks ``cpu`` without a GPU and ``deepspeed_zero3`` with one.
        gpu: Whether this machine has an NVIDIA GPU.
    """
    if name is None:
        name = "deepspeed_zero3" if gpu else "cpu"
    path = ACCELERATE_CONFIGS / f"{name}.yaml"
    if not path.is_file():
        path = Path(name).expanduser().resolve()
    if not path.is_file():
        known = sorted(p.stem for p in ACCELERATE_CONFIGS.glob("*.yaml"))
        raise FileNotFoundError(f"accelerate_config {name!r} is neither one of {known} nor an existing YAML file")
    return path


def read_accelerate_config(path: Path) -> dict[str, Any]:
    """The accelerate YAML as a mapping (``distributed_type``, ``num_processes``, ``use_cpu``, ...)."""
    import yaml

    config = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: an accelerate config must be a mapping, got {type(config).__name__}")
    return config


def strategy_of(config: dict) -> str:
    """``cpu``, ``single``, ``ddp``, ``fsdp`` or ``zero3`` from an accelerate config (ZeRO stages 1-2 are planned as
    DDP). ``single``: ``distributed_type: "NO"`` on a GPU, which accelerate starts with its simple launcher: one
    process whatever ``--num_processes`` says."""
    kind = config.get("distributed_type")
    if config.get("use_cpu") and kind in ("NO", "MULTI_CPU", None):
        return "cpu"
    if kind in ("NO", None):
        return "single"
    if kind == "DEEPSPEED":
        return "zero3" if int((config.get("deepspeed_config") or {}).get("zero_stage", 0)) == 3 else "ddp"
    return "fsdp" if kind == "FSDP" else "ddp"
