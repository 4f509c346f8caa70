"""The machine a run is planned for, given (``--hardware 2x8x141GB``) or detected, and its accelerate configs.

Detected: the GPUs this process may use (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi``) with their memory, on one
node or on the ``SLURM_JOB_NUM_NODES`` nodes of a Slurm allocation. The GPU part is standard library only: setup
reads it before any environment exists.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from optima.environments import REPO_ROOT

_SPEC = re.compile(r"^(?:(\d+)x)?(\d+)x(\d+(?:\.\d+)?)\s*(?:GB|GiB|G)?$", re.IGNORECASE)
ACCELERATE_CONFIGS = REPO_ROOT / "alignment-handbook" / "recipes" / "accelerate_configs"


@dataclass(frozen=True)
class Hardware:
    """Nodes of equal GPUs: ``gpus_per_node`` (0: CPU only) of ``gpu_gib`` GiB each (``80GB`` is taken as 80 GiB),
    ``gpu_ids`` their ``CUDA_VISIBLE_DEVICES`` entries, ``source`` how it was found."""

    nodes: int
    gpus_per_node: int
    gpu_gib: float
    gpu_ids: tuple[str, ...] = ()
    source: str = "given"

    def __post_init__(self) -> None:
        if not self.gpu_ids:
            object.__setattr__(self, "gpu_ids", tuple(str(i) for i in range(self.gpus_per_node)))

    @property
    def has_gpu(self) -> bool:
        return self.gpus_per_node > 0

    def describe(self) -> str:
        if not self.has_gpu:
            return f"{self.nodes} node(s), CPU only ({self.source})"
        return f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s) x {self.gpu_gib:g} GiB ({self.source})"


def parse_hardware(text: str) -> Hardware:
    """``8x80GB`` (one node), ``2x8x141GB`` (nodes x GPUs x memory) or ``cpu``; else ``RecipeError`` (--hardware)."""
    from optima.config import RecipeError  # not at the top: setup imports this module with a bare Python

    value = text.strip()
    if value.lower() == "cpu":
        return Hardware(1, 0, 0.0, source="--hardware cpu")
    match = _SPEC.match(value)
    if not match:
        raise RecipeError(
            "--hardware", f"expected GPUSxMEMORY like 8x80GB or NODESxGPUSxMEMORY like 2x8x141GB, got {text!r}"
        )
    nodes, gpus, memory = int(match.group(1) or 1), int(match.group(2)), float(match.group(3))
    if nodes < 1 or gpus < 1 or memory <= 0:
        raise RecipeError("--hardware", f"nodes, GPUs and memory must be positive, got {text!r}")
    return Hardware(nodes, gpus, memory, source=f"--hardware {value}")


def nvidia_smi_lines(
    args: list[str], nvidia_smi: str | None = None, environ: Mapping[str, str] | None = None
) -> list[str]:
    """The output lines of ``nvidia-smi ARGS`` (none without it, or when it fails)."""
    environ = os.environ if environ is None else environ
    exe = nvidia_smi or shutil.which("nvidia-smi", path=environ.get("PATH"))
    if exe is None:
        return []
    try:
        result = subprocess.run([exe, *args], capture_output=True, text=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return result.stdout.splitlines() if result.returncode == 0 else []


def visible_gpus(environ: Mapping[str, str] | None = None, nvidia_smi: str | None = None) -> list[str]:
    """GPU ids this process may use: ``CUDA_VISIBLE_DEVICES`` when set (``""``, ``-1``: none), else ``nvidia-smi``."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    listed = [line for line in nvidia_smi_lines(["-L"], nvidia_smi, environ) if line.startswith("GPU ")]
    return [str(i) for i in range(len(listed))]


def gpu_memory_mib(
    environ: Mapping[str, str] | None = None, nvidia_smi: str | None = None, gpus: list[str] | None = None
) -> list[int]:
    """Total memory (MiB) of each visible GPU, in ``visible_gpus`` order (UUID entries: the smallest GPU's)."""
    environ = os.environ if environ is None else environ
    gpus = visible_gpus(environ, nvidia_smi) if gpus is None else gpus
    query = ["--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    lines = nvidia_smi_lines(query, nvidia_smi, environ) if gpus else []
    sizes = [int(float(v)) for v in lines if v.strip().replace(".", "", 1).isdigit()]
    return [sizes[int(g)] if g.isdigit() and int(g) < len(sizes) else min(sizes) for g in gpus] if sizes else []


def has_gpu(environ: Mapping[str, str] | None = None) -> bool:
    """True when at least one NVIDIA GPU is visible to this process."""
    return bool(visible_gpus(environ))


def detect_hardware(environ: Mapping[str, str] | None = None, nvidia_smi: str | None = None) -> Hardware:
    """This machine: its visible GPUs and the smallest one's memory; inside a Slurm allocation, its node count."""
    environ = os.environ if environ is None else environ
    nodes = environ.get("SLURM_JOB_NUM_NODES", "1")
    nodes = int(nodes) if nodes.isdigit() and int(nodes) > 0 else 1
    slurm = f", {nodes} Slurm nodes" if "SLURM_JOB_NUM_NODES" in environ else ""
    gpus = visible_gpus(environ, nvidia_smi)
    if not gpus:
        return Hardware(nodes, 0, 0.0, source="no GPU visible" + slurm)
    sizes = gpu_memory_mib(environ, nvidia_smi, gpus)
    memory = round(min(sizes) / 1024, 1) if sizes else 0.0
    return Hardware(
        nodes, len(gpus), memory, tuple(gpus), source=("nvidia-smi" if sizes else "memory unknown") + slurm
    )


def resolve_hardware(given: str | None) -> Hardware:
    """``--hardware`` when given, else detected."""
    return parse_hardware(given) if given else detect_hardware()


def resolve_accelerate_config(name: str | None, gpu: bool) -> Path:
    """A config name (``cpu``, ``single_gpu``, ``multi_gpu``, ``deepspeed_zero3``, ``fsdp``) or YAML path -> path;
    ``None``: ``deepspeed_zero3`` with a GPU, else ``cpu``."""
    name = name or ("deepspeed_zero3" if gpu else "cpu")
    path = ACCELERATE_CONFIGS / f"{name}.yaml"
    path = path if path.is_file() else Path(name).expanduser().resolve()
    if not path.is_file():
        known = sorted(p.stem for p in ACCELERATE_CONFIGS.glob("*.yaml"))
        raise FileNotFoundError(f"accelerate_config {name!r} is neither one of {known} nor an existing YAML file")
    return path


def read_accelerate_config(path: Path) -> dict:
    """The accelerate YAML as a mapping (``distributed_type``, ``num_processes``, ``use_cpu``, ...)."""
    return read_yaml(path, required=True)


def read_yaml(path: str | Path | None, required: bool = False) -> dict:
    import yaml

    if not required and (not path or not Path(path).is_file()):
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping, got {type(data).__name__}")
    return data


def strategy_of(config: dict) -> str:
    """``cpu``, ``single`` (``distributed_type: NO`` on a GPU: one process), ``ddp``, ``fsdp`` or ``zero3`` (ZeRO
    stages 1-2 count as DDP)."""
    kind = config.get("distributed_type")
    if config.get("use_cpu") and kind in ("NO", "MULTI_CPU", None):
        return "cpu"
    if kind in ("NO", None):
        return "single"
    if kind == "DEEPSPEED":
        return "zero3" if int((config.get("deepspeed_config") or {}).get("zero_stage", 0)) == 3 else "ddp"
    return "fsdp" if kind == "FSDP" else "ddp"
