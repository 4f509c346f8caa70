"""Which NVIDIA GPUs this process may use: the one answer for serving, training and setup.

``CUDA_VISIBLE_DEVICES`` wins when it is set (``""`` or ``-1``: none); otherwise
``nvidia-smi -L`` lists the GPUs. Standard library only: setup uses it before any environment exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def visible_gpus(environ: Mapping[str, str] | None = None, nvidia_smi: str | None = None) -> list[str]:
    """GPU ids this process may use (what goes into a child's ``CUDA_VISIBLE_DEVICES``); empty on a CPU machine.

    Args:
        environ: The environment to read (default ``os.environ``).
        nvidia_smi: The ``nvidia-smi`` executable (default: the one on ``PATH``).
    """
    environ = os.environ if environ is None else environ
    visible = environ.get(VISIBLE_ENV)
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    exe = nvidia_smi or shutil.which("nvidia-smi", path=environ.get("PATH"))
    if exe is None:
        return []
    try:
        result = subprocess.run([exe, "-L"], capture_output=True, text=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    lines = result.stdout.splitlines() if result.returncode == 0 else []
    return [str(i) for i, _ in enumerate(ln for ln in lines if ln.startswith("GPU "))]


def gpu_memory_mib(
    environ: Mapping[str, str] | None = None, nvidia_smi: str | None = None, gpus: list[str] | None = None
) -> list[int]:
    """Total memory (MiB) of each visible GPU, in ``visible_gpus`` order; empty without GPUs or ``nvidia-smi``.

    Numeric ``CUDA_VISIBLE_DEVICES`` entries pick their GPUs from ``nvidia-smi``'s list; other entries (UUIDs)
    get the smallest GPU's memory.

    Args:
        environ: The environment (``CUDA_VISIBLE_DEVICES``, ``PATH``); default ``os.environ``.
        nvidia_smi: The ``nvidia-smi`` program; default the one on ``PATH``.
        gpus: ``visible_gpus``'s answer when the caller has it already (saves listing the GPUs again).
    """
    environ = os.environ if environ is None else environ
    gpus = visible_gpus(environ, nvidia_smi) if gpus is None else gpus
    exe = nvidia_smi or shutil.which("nvidia-smi", path=environ.get("PATH"))
    if not gpus or exe is None:
        return []
    query = [exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        result = subprocess.run(query, capture_output=True, text=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    sizes = [int(float(v)) for v in result.stdout.split() if v.replace(".", "", 1).isdigit()]
    if result.returncode != 0 or not sizes:
        return []
    return [sizes[int(g)] if g.isdigit() and int(g) < len(sizes) else min(sizes) for g in gpus]


def has_gpu(environ: Mapping[str, str] | None = None) -> bool:
    """True when at least one NVIDIA GPU is visible to this process."""
    return bool(visible_gpus(environ))


def query_nvidia_smi(args: list[str], nvidia_smi: str | None = None) -> list[list[str]]:
    """The rows of an ``nvidia-smi --query-...`` in CSV without header or units (empty when it cannot answer)."""
    exe = nvidia_smi or shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        result = subprocess.run([exe, *args, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                check=False, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    if result.returncode != 0:
        return []
    return [[cell.strip() for cell in line.split(",")] for line in result.stdout.splitlines() if line.strip()]


def gpu_memory_used_mib(gpu: str | None = None, nvidia_smi: str | None = None) -> int | None:
    """Memory in use (MiB) on GPU ``gpu`` (an id of ``visible_gpus``; default the first visible one), by all its
    processes; None: unknown (no GPU, no ``nvidia-smi``, or a UUID in ``CUDA_VISIBLE_DEVICES``)."""
    gpus = [gpu] if gpu is not None else visible_gpus(nvidia_smi=nvidia_smi)[:1]
    if not gpus or not gpus[0].isdigit():
        return None
    rows = query_nvidia_smi(["--query-gpu=memory.used"], nvidia_smi)
    try:
        return int(float(rows[int(gpus[0])][0]))
    except (IndexError, ValueError):
        return None


def process_memory_mib(nvidia_smi: str | None = None) -> dict[int, int]:
    """GPU memory (MiB) of each process that ``nvidia-smi`` lists, by PID (empty: none visible, e.g. in a container
    with its own PID namespace)."""
    memory: dict[int, int] = {}
    for row in query_nvidia_smi(["--query-compute-apps=pid,used_memory"], nvidia_smi):
        if len(row) == 2 and row[0].isdigit() and row[1].replace(".", "", 1).isdigit():
            memory[int(row[0])] = memory.get(int(row[0]), 0) + int(float(row[1]))
    return memory
