"""Run a fine-tuning stage: TRL under ``accelerate launch``, in its own process group.

See docs/method.md#training.

The orchestrator never imports torch; ``optima.training.launch_config`` builds the trainer YAML and the command
line (``TrainLaunch``), and this module runs it, under a guard: this module run as a script with the driver's
Python (``python -m optima.training.launch <argv>``), in its own process group. ``accelerate launch`` does not
stop its worker processes when it is killed, so the group is what gets stopped: by the driver when it is
interrupted (SIGTERM, Ctrl-C, an error), and by the guard itself when the driver dies, even by ``kill -9``
(``PR_SET_PDEATHSIG``, as the serving launcher does). A killed run never leaves a trainer writing into the
checkpoint folder that the resumed run is about to redo.

Before either starts, the build locks of torch's JIT extensions that a killed build left behind are removed
(``optima.training.extensions``): DeepSpeed builds its ops there, and a stale lock would make every rank wait forever.
``run_ranks`` starts the ranks of a distributed program directly (no accelerate: ``make gpu-check``'s 2-process
ZeRO-3 save on one GPU, the sharded-save tests on CPU processes), with the same clean-up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from optima.environments import REPO_ROOT
from optima.serving.processes import PARENT_ENV, die_with_parent, group_members, signal_group, stop_group
from optima.training.errors import STOP_TIMEOUT_S, TrainingError, failure_message
from optima.training.extensions import extensions_root, remove_stale_build_locks
from optima.training.launch_config import TrainLaunch
from optima.training.progress import STATE_ENV, TrainingProgress

logger = logging.getLogger(__name__)

GUARD_MODULE = "optima.training.launch"
STATE_FILE = "trainer_state.json"  # the trainer's state, beside its log, while it runs


def run_training(
    launch: TrainLaunch,
    log_path: Path,
    extra_env: dict[str, str] | None = None,
    progress: IO[str] | None = None,
    desc: str = "train",
) -> None:
    """Run one fine-tuning stage to completion, its output in ``log_path``.

    The trainer runs under the guard, in its own process group; if this call is interrupted (``SystemExit`` from
    SIGTERM, ``KeyboardInterrupt``, any error) the whole group is stopped before the exception goes on. It writes
    its state to ``trainer_state.json`` beside the log (``optima.training.progress``).

    Args:
        launch: The command.
        log_path: The trainer's output.
        extra_env: More environment (trackers).
        progress: Where to draw a progress bar (step, loss, ETA) while it runs; None: no bar.
        desc: The stage's label (the bar's, and the error's).

    Raises:
        TrainingError: on a non-zero exit, naming the stage and the log and quoting its tail.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    state_file = log_path.parent / STATE_FILE
    state_file.unlink(missing_ok=True)  # a killed attempt's state is not this one's
    env = launch.env.process_env(launch.env_vars() | (extra_env or {})) | {
        PARENT_ENV: str(os.getpid()),
        STATE_ENV: str(state_file),
    }
    bar = TrainingProgress(state_file, progress, desc) if progress is not None else contextlib.nullcontext()
    remove_stale_build_locks(extensions_root(env))  # a killed DeepSpeed op build would hang every rank
    argv = launch.argv()
    logger.info("train | %s | log %s", " ".join(argv), log_path)
    returncode = run_guarded(argv, env, log_path, bar)
    if returncode != 0:
        raise TrainingError(failure_message(f"{desc}: {launch.kind} training exited with {returncode}", log_path))


def run_guarded(argv: list[str], env: dict[str, str], log_path: Path, bar) -> int:
    """Run ``argv`` under the guard in its own process group; stop the group if the wait is interrupted."""
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", GUARD_MODULE, *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        try:
            with bar:
                return proc.wait()
        finally:
            if proc.returncode is None:
                stop_trainer(proc)


def run_ranks(
    argv: list[str], env: dict[str, str], logs: list[Path], timeout_s: float, local_ranks: list[int] | None = None
) -> list[int] | None:
    """Run ``len(logs)`` ranks of ``argv`` (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` set) to their end, each in its own
    process group with its own log; None when one still ran at the deadline (then every rank is killed).

    Args:
        argv: The command of every rank.
        env: Their environment (``MASTER_ADDR``, ``MASTER_PORT`` and the like).
        logs: One log per rank.
        timeout_s: Deadline for all ranks together.
        local_ranks: Each rank's ``LOCAL_RANK`` (its device); default its rank. Several ranks may share one GPU.
    """
    remove_stale_build_locks(extensions_root(env))
    local_ranks = list(range(len(logs))) if local_ranks is None else local_ranks
    procs = []
    try:
        for rank, log in enumerate(logs):
            ids = {"RANK": str(rank), "LOCAL_RANK": str(local_ranks[rank]), "WORLD_SIZE": str(len(logs))}
            with log.open("wb") as handle:
                procs.append(
                    subprocess.Popen(
                        argv, env=env | ids, cwd=REPO_ROOT, stdout=handle, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True,
                    )
                )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        return [proc.wait(timeout=max(deadline - time.monotonic(), 0)) for proc in procs]
    except subprocess.TimeoutExpired:
        return None
    finally:
        for proc in procs:  # the whole group: a rank's own children too, whether the rank ended or not
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait()


def stop_trainer(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the trainer's process group, wait, then SIGKILL whatever is left of it."""
    logger.warning("train | stopping the trainer (process group %d)", proc.pid)
    stop_group(proc, timeout_s, "the trainer")


def _stop_own_group(signum: int, _frame) -> None:
    """Guard's handler: SIGTERM every process of its group (accelerate and its workers), then SIGKILL leftovers."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pgid, me = os.getpgrp(), os.getpid()
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(pid != me for pid in group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)  # poll interval of a wait with a deadline (a process group has no handle to block on)
    if any(pid != me for pid in group_members(pgid)):
        os.killpg(pgid, signal.SIGKILL)  # this guard included
    os._exit(128 + signum)


def guard(argv: list[str]) -> int:
    """``python -m optima.training.launch ARGV...``: run ARGV and return its exit code.

    On SIGTERM or SIGINT, and when the driver named by ``OPTIMA_PARENT_PID`` dies, the whole process group stops.
    """
    if os.getpgrp() != os.getpid():
        raise SystemExit(f"{GUARD_MODULE} must lead its own process group (start it with start_new_session=True)")
    signal.signal(signal.SIGTERM, _stop_own_group)
    signal.signal(signal.SIGINT, _stop_own_group)
    die_with_parent()
    return subprocess.run(argv, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(guard(sys.argv[1:]))
