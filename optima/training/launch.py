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

``run_preflight``, before a run's first generation: each trainer of the method takes ONE optimizer step at the
trainer YAML's ``max_length`` on synthetic rows, with the run's own launcher, processes and sharding, saving
nothing; a trainer that cannot fails the run then, with its own error. It records its peak memory in
``<output_dir>/preflight.json``; a rerun with the same trainer settings skips it.

The console's progress bar (off with ``--quiet``, or when stderr is not a terminal) follows the ``TrainerState``
that the trainer script writes after every step (``optima.training.common.state_callback``); the trainer's own
output goes only to its log.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from optima.config import LoopRecipe
from optima.config.rules import trainer_base_yaml, trainer_overrides_for
from optima.environments import REPO_ROOT, PythonEnv
from optima.hardware.allocation import HardwareAllocation
from optima.methods import METHODS, TrainerKind
from optima.paths import RunPaths
from optima.serving.processes import PR_SET_PDEATHSIG, signal_group, stop_group
from optima.store import write_json
from optima.training.common import PEAK_RSS_FILE, STATE_ENV
from optima.training.extensions import extensions_root, remove_stale_build_locks
from optima.training.launch_config import (
    TrainLaunch,
    launch_for,
    method_values,
    render_trainer_config,
    write_trainer_config,
)

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"  # the trainer's state, beside its log, while it runs
STOP_TIMEOUT_S = 30.0  # grace period between SIGTERM and SIGKILL of a trainer's process group
PREFLIGHT_FILE = "preflight.json"
# What turns a stage's trainer YAML into the preflight's: one step on synthetic rows, no evaluation, no save, no
# tracker (the trainer scripts read ``preflight``).
PREFLIGHT_VALUES = {
    "preflight": True, "max_steps": 1, "save_strategy": "no", "eval_strategy": "no", "load_best_model_at_end": False,
    "report_to": "none", "push_to_hub": False, "resume_from_checkpoint": None, "dataset_name": None,
}  # fmt: skip
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


def read_preflight(output_dir: Path) -> dict | None:
    """``<output_dir>/preflight.json`` (``peak_rss_bytes``, ``seconds``, ``trainers``, ``key``), None without one."""
    path = Path(output_dir) / PREFLIGHT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def preflight_launches(
    recipe: LoopRecipe, env: PythonEnv, hardware: HardwareAllocation, work: Path
) -> dict[TrainerKind, tuple[dict, TrainLaunch]]:
    """The preflight's trainer YAML and launch of each trainer the method runs: a train stage's, from the initial
    model, with ``PREFLIGHT_VALUES`` on top."""
    launches = {}
    for kind in METHODS[recipe.method].trainers:
        values = {"model_name_or_path": str(recipe.initial_model_path), "output_dir": str(work / kind), "seed": 0}
        if kind in hardware.accumulation:
            values["gradient_accumulation_steps"] = hardware.accumulation[kind]
        values |= method_values(recipe, kind) | PREFLIGHT_VALUES
        config = render_trainer_config(
            Path(trainer_base_yaml(recipe, kind)), values, trainer_overrides_for(recipe, kind)
        )
        yaml_path = work / f"{kind}_trainer.yaml"
        launches[kind] = (
            config,
            launch_for(recipe, kind, env, yaml_path, hardware.hardware.has_gpu, hardware.training),
        )
    return launches


def run_preflight(
    recipe: LoopRecipe,
    env: PythonEnv,
    hardware: HardwareAllocation,
    paths: RunPaths,
    before: Callable[[], object] | None = None,
) -> dict | None:
    """One optimizer step of each trainer at its longest sequence, before the run's first generation.

    Its key is the preflight's trainer YAMLs, accelerate configs and command lines: a rerun with the same key
    skips it. ``before`` runs first when it does not (the run's loss server starts: training shares the machine
    with it). The work folder ``<output_dir>/preflight`` is removed after; the logs stay in ``<output_dir>/logs``.

    Returns:
        What ``preflight.json`` holds (None with ``preflight: false``).

    Raises:
        TrainingError: a trainer failed (its log's path and tail).
    """
    if not recipe.preflight:
        return None
    work = paths.output_dir / "preflight"
    launches = preflight_launches(recipe, env, hardware, work)
    shown = {
        k: [config, Path(launch.accelerate_config).read_text(), launch.argv()]
        for k, (config, launch) in launches.items()
    }
    key = hashlib.sha256(json.dumps(shown, sort_keys=True, default=str).encode()).hexdigest()[:16]
    done = read_preflight(paths.output_dir)
    if done is not None and done.get("key") == key:
        logger.info(
            "preflight | done before with these trainer settings (%s): skipped", paths.output_dir / PREFLIGHT_FILE
        )
        return done
    if before is not None:
        before()
    trainers = {}
    try:
        for kind, (config, launch) in launches.items():
            shutil.rmtree(work / kind, ignore_errors=True)
            write_trainer_config(config, launch.trainer_yaml)
            log, started = paths.driver_log.parent / f"preflight_{kind}.log", time.monotonic()
            log.unlink(missing_ok=True)
            logger.info("preflight | %s | one step at max_length %s | log %s", kind, config.get("max_length"), log)
            run_training(launch, log, desc=f"preflight {kind}")
            peaks = [json.loads(p.read_text())["bytes"] for p in (work / kind).glob(PEAK_RSS_FILE.format(rank="*"))]
            seconds = round(time.monotonic() - started, 1)
            trainers[kind] = {"peak_rss_bytes": sum(peaks), "seconds": seconds, "processes": launch.processes()}
            logger.info(
                "preflight | %s | passed in %.1f s, peak resident memory %.2f GiB", kind, seconds, sum(peaks) / 2**30
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = {"key": key, "peak_rss_bytes": max(t["peak_rss_bytes"] for t in trainers.values())}
    record |= {"seconds": round(sum(t["seconds"] for t in trainers.values()), 1), "trainers": trainers}
    write_json(paths.output_dir / PREFLIGHT_FILE, record)
    return record


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
