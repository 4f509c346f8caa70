"""Process groups: how every child process of Optima (vLLM servers, the trainer) is watched and stopped.

Standard library only: the vLLM launcher and the trainer import it in their own environments. A child runs in its own
process group (``start_new_session=True``) and is stopped with SIGTERM to the group -> wait -> SIGKILL of what is
left (``stop_group``), never by name. A child started with ``OPTIMA_PARENT_PID`` asks Linux for SIGTERM when the
driver dies, even by ``kill -9`` (``die_with_parent``): nothing else would stop a process in its own group. Python
lets SIGTERM end the process at once, skipping every ``__exit__``: inside ``sigterm_as_exit()`` it raises
``SystemExit(143)`` instead, so the servers are stopped on the way out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

PARENT_ENV = "OPTIMA_PARENT_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``, read from /proc (Linux)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # the process ended while we looked
        # Fields after the ")" closing the command name: state ppid pgrp ...
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def wait_group_exit(pgid: int, timeout_s: float) -> bool:
    """Wait until process group ``pgid`` has no live member; False if some remain after ``timeout_s``."""
    deadline, interval = time.monotonic() + timeout_s, 0.05
    while group_members(pgid):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        # Poll interval of a wait with a deadline: a process group has no handle to block on.
        time.sleep(min(interval, remaining))
        interval = min(interval * 2, 0.5)
    return True


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to process group ``pgid`` (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def stop_group(proc: subprocess.Popen, timeout_s: float, label: str) -> int:
    """SIGTERM the group that ``proc`` leads, wait, then SIGKILL whatever is left of it; its exit code. Workers (and
    the resource tracker, which unlinks shared memory) may outlive the leader a moment: they get the same grace."""
    pgid = proc.pid
    signal_group(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        logger.warning("%s ignored SIGTERM for %.0f s; killing it", label, timeout_s)
        signal_group(pgid, signal.SIGKILL)
        proc.wait()
    if not wait_group_exit(pgid, timeout_s):
        logger.warning("%s: killing leftover processes %s", label, group_members(pgid))
        signal_group(pgid, signal.SIGKILL)
    return proc.wait()


def set_pdeathsig(sig: signal.Signals) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (elsewhere: nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def die_with_parent() -> None:
    """SIGTERM this process when the driver named by ``OPTIMA_PARENT_PID`` dies (Linux; elsewhere a no-op)."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    if os.getppid() != int(parent):  # started through a wrapper (``conda run``): the wrapper is not watched
        return
    set_pdeathsig(signal.SIGTERM)
    if os.getppid() != int(parent):  # the driver died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Within the block, SIGTERM raises ``SystemExit(143)`` in the main thread (no-op in other threads)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def handle(signum: int, _frame) -> None:
        nonlocal fired
        if fired:
            logger.warning("signal %d again: still cleaning up", signum)
            return
        fired = True
        logger.warning("signal %d: stopping", signum)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
