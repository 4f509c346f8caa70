"""Run a fine-tuning stage: ``accelerate launch`` of the handbook script, in its own process group.

The orchestrator never imports torch: ``optima.training.launch_config`` builds the trainer YAML and the command line
(``TrainLaunch``), and ``run_training`` starts it. Nothing stands between the driver and ``accelerate launch``: it
runs in its own session (its process group is what Ctrl-C, SIGTERM or an error of the driver stops), with
``PR_SET_PDEATHSIG`` (SIGTERM when the driver dies, even by ``kill -9``); the trainer script asks for the same
when its launcher dies (``alignment-handbook/scripts/run_sft.py``). A killed run never leaves a trainer writing
into the checkpoint folder that the resumed run is about to redo.

Before a start, the build locks of torch's JIT extensions that a killed build left behind are removed
(``optima.training.extensions``): DeepSpeed builds its ops there, and a stale lock would make every rank wait forever.
``run_ranks`` starts the ranks of a distributed program directly (no accelerate: ``make gpu-check``'s 2-process
ZeRO-3 save on one GPU, the sharded-save tests on CPU processes), with the same clean-up.

The console's progress bar (off with ``--quiet``, or when stderr is not a terminal) follows the ``TrainerState``
that the trainer script writes after every step (``optima.training.common.state_callback``); the trainer's own
output goes only to its log.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from optima.environments import REPO_ROOT
from optima.serving.processes import PR_SET_PDEATHSIG, signal_group, stop_group
from optima.training.common import STATE_ENV
from optima.training.extensions import extensions_root, remove_stale_build_locks
from optima.training.launch_config import TrainLaunch

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"  # the trainer's state, beside its log, while it runs
STOP_TIMEOUT_S = 30.0  # grace period between SIGTERM and SIGKILL of a trainer's process group
POLL_S = 1.0  # how often the progress bar reads the trainer's state


class TrainingError(RuntimeError):
    """A fine-tuning stage failed; the message names the stage and its log file and ends with the log's tail."""


def failure_message(what: str, log_path: Path) -> str:
    """``what; log: PATH`` and the log's last 30 lines."""
    tail = log_path.read_text(errors="replace").splitlines()[-30:] if log_path.is_file() else []
    return f"{what}; log: {log_path}\n" + "\n".join(tail)


def die_with_driver() -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGTERM when this process dies (``PR_SET_PDEATHSIG``), or exits at once
    when it died already. ``prctl`` is looked up here: the forked child only calls it."""
    driver, prctl = os.getpid(), ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != driver:
            os._exit(1)

    return arm


def run_training(
    launch: TrainLaunch,
    log_path: Path,
    extra_env: dict[str, str] | None = None,
    progress: IO[str] | None = None,
    desc: str = "train",
) -> None:
    """Run one fine-tuning stage to completion, its output in ``log_path``.

    ``accelerate launch`` runs in its own process group; if this call is interrupted (``SystemExit`` from SIGTERM,
    ``KeyboardInterrupt``, any error) the whole group is stopped before the exception goes on. The trainer writes
    its state to ``trainer_state.json`` beside the log, which the progress bar follows.

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
    env = launch.env.process_env(launch.env_vars() | (extra_env or {})) | {STATE_ENV: str(state_file)}
    remove_stale_build_locks(extensions_root(env))  # a killed DeepSpeed op build would hang every rank
    argv = launch.argv()
    logger.info("train | %s | log %s", " ".join(argv), log_path)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=REPO_ROOT,
            start_new_session=True, preexec_fn=die_with_driver(),
        )  # fmt: skip
    try:
        returncode = wait_drawing(proc, state_file, progress, desc)
    finally:
        if proc.returncode is None:
            logger.warning("train | stopping the trainer (process group %d)", proc.pid)
            stop_group(proc, STOP_TIMEOUT_S, "the trainer")
    if returncode != 0:
        raise TrainingError(failure_message(f"{desc}: {launch.kind} training exited with {returncode}", log_path))


def console_stream(enabled: bool) -> IO[str] | None:
    """The console for a progress bar: stderr when enabled and a terminal, else None (no bar)."""
    return sys.stderr if enabled and sys.stderr.isatty() else None


def read_state(path: Path) -> dict | None:
    """The trainer state in ``path``, or None while there is none (not written yet, or being replaced)."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def wait_drawing(proc: subprocess.Popen, state_file: Path, stream: IO[str] | None, desc: str) -> int:
    """``proc``'s exit code; meanwhile a tqdm bar on ``stream`` (None: none) shows the trainer's step of
    ``max_steps``, its last logged loss and the ETA, from its state file (a resumed trainer starts at its step)."""
    bar = None
    while True:
        try:
            code = proc.wait(timeout=POLL_S if stream is not None else None)
        except subprocess.TimeoutExpired:
            code = None
        state = read_state(state_file) if stream is not None else None
        if state and state.get("max_steps"):
            from tqdm import tqdm

            step, losses = int(state.get("global_step") or 0), [e["loss"] for e in state["log_history"] if "loss" in e]
            total = int(state["max_steps"])
            bar = bar or tqdm(total=total, initial=step, desc=desc, unit="step", file=stream, dynamic_ncols=True)
            bar.total = total
            bar.set_postfix({"loss": f"{losses[-1]:.4g}"} if losses else {}, refresh=False)
            bar.update(step - bar.n)
        if code is not None:
            if bar is not None:
                bar.close()
            return code


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
