"""Stale build locks of torch's JIT extensions, removed before a trainer starts (DeepSpeed's ops are built there).

DeepSpeed builds some of its ops on first use with ``torch.utils.cpp_extension.load`` (on a CPU:
``deepspeed_shm_comm``, the communication op of ZeRO-3), into ``<root>/<py..._cpu or _cuXXX>/<op>/``. While one
process builds, the others wait for the folder's ``lock`` file to disappear (torch's ``FileBaton``: a file created
with ``O_EXCL`` and held open by the builder until the build ends). A build that is killed (Ctrl-C, a deadline, the
OOM killer) leaves the file behind, and every later start of a trainer then waits on it forever: each rank polls
for a file nobody will remove (seen as a ZeRO-3 run hanging until its deadline; the cure was to delete the cache).

Before each launch (``optima.training.launch``) the locks that no live process holds open and that are older than a
few seconds are removed, so the next build starts over. A lock held open by a process (a build in progress, by
this run or another one) is left alone. The root is torch's: ``TORCH_EXTENSIONS_DIR``, else
``$XDG_CACHE_HOME/torch_extensions``, else ``~/.cache/torch_extensions``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = "lock"
# A lock younger than this may be between its creation and the builder's first look: never removed.
MIN_STALE_AGE_S = 5.0


def extensions_root(environ: Mapping[str, str] | None = None) -> Path:
    """The folder torch builds JIT extensions under, as a process with ``environ`` would find it."""
    environ = os.environ if environ is None else environ
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(environ["TORCH_EXTENSIONS_DIR"])
    cache = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    return Path(cache) / "torch_extensions"


def lock_holders(lock: Path, proc: Path = Path("/proc")) -> list[int]:
    """PIDs of the processes that hold ``lock`` open (its builder keeps the file open until the build ends).

    Processes of other users, whose descriptors cannot be read, are not seen (the cache is per user).
    """
    target, holders = os.path.realpath(lock), []
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            descriptors = list(fd_dir.iterdir())
        except OSError:  # gone meanwhile, or not ours
            continue
        for fd in descriptors:
            try:
                if os.readlink(fd) == target:
                    holders.append(int(fd_dir.parent.name))
                    break
            except OSError:
                continue
    return holders


def remove_stale_build_locks(root: Path, min_age_s: float = MIN_STALE_AGE_S) -> list[Path]:
    """Remove the build locks under ``root`` (``<root>/<tag>/<op>/lock``) that no live process holds.

    Args:
        root: ``extensions_root(...)`` of the process about to start.
        min_age_s: Locks younger than this are kept whatever (a build that is starting right now).

    Returns:
        The locks removed (each logged with a warning: the build it belonged to was killed, and starts over).
    """
    removed = []
    now = time.time()
    for lock in sorted(root.glob(f"*/*/{LOCK_NAME}")):
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            continue
        if age < min_age_s or lock_holders(lock):
            continue
        lock.unlink(missing_ok=True)
        removed.append(lock)
        logger.warning(
            "train | removed %s: a JIT build of %s was killed %.0f s ago and left its lock (no process holds it); "
            "the next start builds it again instead of waiting on it forever",
            lock,
            lock.parent.name,
            age,
        )
    return removed
