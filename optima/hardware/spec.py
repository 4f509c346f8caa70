"""The machine a run is planned for: nodes x GPUs x memory, given (``--hardware 2x8x141GB``) or detected.

Given, any machine can be planned from a laptop (``--dry-run --hardware 8x80GB``); detected, it is the GPUs this
process sees (``optima.hardware.gpus``: ``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi``) with their memory, on one
node, or inside a Slurm allocation on ``SLURM_JOB_NUM_NODES`` such nodes (a multi-node run names its nodes in the
recipe: ``train_hosts``, or ``train_launcher: srun``). Memory is in GiB: ``80GB`` is taken as
80 GiB, the size printed on the card (an 80 GB card reports 79.6 GiB; the estimates leave more than that spare).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from optima.config import RecipeError
from optima.hardware.gpus import gpu_memory_mib, visible_gpus

_SPEC = re.compile(r"^(?:(\d+)x)?(\d+)x(\d+(?:\.\d+)?)\s*(?:GB|GiB|G)?$", re.IGNORECASE)


@dataclass(frozen=True)
class Hardware:
    """Nodes of equal GPUs.

    Args:
        nodes: Machines.
        gpus_per_node: GPUs each (0: CPU only).
        gpu_gib: Memory of one GPU, GiB.
        gpu_ids: ``CUDA_VISIBLE_DEVICES`` entries of a node's GPUs (default ``0..gpus_per_node-1``).
        source: How it was found (``--hardware 8x80GB``, ``nvidia-smi``, ``no GPU``).
    """

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
    """``8x80GB`` (one node), ``2x8x141GB`` (nodes x GPUs x memory) or ``cpu``.

    Raises:
        RecipeError: (``--hardware``) anything else.
    """
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
    source = ("nvidia-smi" if sizes else "memory unknown") + slurm
    return Hardware(nodes, len(gpus), memory, tuple(gpus), source=source)


def resolve_hardware(given: str | None) -> Hardware:
    """``--hardware`` when given, else detected."""
    return parse_hardware(given) if given else detect_hardware()
