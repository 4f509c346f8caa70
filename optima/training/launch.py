"""Render the per-iteration trainer YAML and launch TRL under ``accelerate launch`` (SPEC 1.2 step 7, 8).

The orchestrator never imports torch: a fine-tuning stage is the handbook-style base YAML of the recipe
(``origin_yaml_path``) plus this iteration's model, dataset and output folder, written into the run
directory and handed to ``alignment-handbook/scripts/run_{sft,dpo}.py`` in the training environment::

    <train python> -m accelerate.commands.launch --config_file <accelerate yaml> \
        alignment-handbook/scripts/run_sft.py --config <run>/iteration_<i>/trainer.yaml

Multi-node training uses accelerate's own flags (``--num_machines``, ``--machine_rank``,
``--main_process_ip``), passed through ``extra_launch_args``.

The command runs under a guard, this module run as a script with the driver's Python
(``python -m optima.training.launch <argv>``), in its own process group. ``accelerate launch`` does not stop its
worker processes when it is killed, so the group is what gets stopped: by the driver when it is interrupted
(SIGTERM, Ctrl-C, an error), and by the guard itself when the driver dies, even by ``kill -9``
(``PR_SET_PDEATHSIG``, as the serving launcher does). A killed run never leaves a trainer writing into the
checkpoint folder that the resumed run is about to redo.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from optima.environments import REPO_ROOT, PythonEnv
from optima.serving.launcher import PARENT_ENV, die_with_parent
from optima.serving.vllm_server import group_members, wait_group_exit

logger = logging.getLogger(__name__)

HANDBOOK = REPO_ROOT / "alignment-handbook"
ACCELERATE_CONFIGS = HANDBOOK / "recipes" / "accelerate_configs"
SCRIPTS = {"sft": HANDBOOK / "scripts" / "run_sft.py", "dpo": HANDBOOK / "scripts" / "run_dpo.py"}
GUARD_MODULE = "optima.training.launch"
STOP_TIMEOUT_S = 30.0  # grace period between SIGTERM and SIGKILL of the trainer's process group


class TrainingError(RuntimeError):
    """A fine-tuning subprocess failed; the message names its log file and ends with its tail."""


def resolve_accelerate_config(name: str | None, gpu: bool) -> Path:
    """A config name (``cpu``, ``multi_gpu``, ``deepspeed_zero3``, ``fsdp``) or YAML path -> absolute path.

    Args:
        name: From the recipe; ``None`` picks ``cpu`` without a GPU and ``deepspeed_zero3`` with one.
        gpu: Whether this machine has an NVIDIA GPU.
    """
    if name is None:
        name = "deepspeed_zero3" if gpu else "cpu"
    path = ACCELERATE_CONFIGS / f"{name}.yaml"
    if not path.is_file():
        path = Path(name).expanduser().resolve()
    if not path.is_file():
        known = sorted(p.stem for p in ACCELERATE_CONFIGS.glob("*.yaml"))
        raise FileNotFoundError(f"accelerate_config {name!r} is neither one of {known} nor an existing YAML file")
    return path


def render_trainer_config(base_yaml: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """The base handbook YAML with this iteration's values on top (``None`` values delete a key)."""
    import yaml

    config = yaml.safe_load(Path(base_yaml).read_text()) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{base_yaml}: a trainer recipe must be a mapping, got {type(config).__name__}")
    for key, value in overrides.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def write_trainer_config(config: dict[str, Any], path: Path) -> Path:
    """Write the rendered trainer YAML atomically (a killed write never leaves a half file)."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class TrainLaunch:
    """One fine-tuning subprocess.

    Args:
        kind: ``sft`` or ``dpo`` (picks the handbook script).
        env: The training environment.
        accelerate_config: Resolved accelerate YAML.
        trainer_yaml: Rendered trainer recipe.
        num_processes: Overrides the accelerate config's process count (e.g. GPUs available).
        extra_launch_args: More ``accelerate launch`` flags (multi-node).
    """

    kind: Literal["sft", "dpo"]
    env: PythonEnv
    accelerate_config: Path
    trainer_yaml: Path
    num_processes: int | None = None
    extra_launch_args: tuple[str, ...] = field(default_factory=tuple)

    def argv(self) -> list[str]:
        """The exact command line (pure; shown by ``--dry-run``)."""
        launch = ["--config_file", str(self.accelerate_config)]
        if self.num_processes is not None:
            launch += ["--num_processes", str(self.num_processes)]
        launch += list(self.extra_launch_args)
        return self.env.module_argv(
            "accelerate.commands.launch", *launch, str(SCRIPTS[self.kind]), "--config", str(self.trainer_yaml)
        )


def launch_for(recipe, kind: Literal["sft", "dpo"], env: PythonEnv, trainer_yaml: Path, gpu: bool) -> TrainLaunch:
    """The training subprocess of a recipe's stage (accelerate config, process count, extra launch flags)."""
    return TrainLaunch(
        kind,
        env,
        resolve_accelerate_config(recipe.accelerate_config, gpu),
        trainer_yaml,
        recipe.num_processes,
        tuple(recipe.accelerate_extra_args),
    )


def run_training(launch: TrainLaunch, log_path: Path, extra_env: dict[str, str] | None = None) -> None:
    """Run one fine-tuning subprocess to completion, its output in ``log_path``.

    The trainer runs under the guard, in its own process group; if this call is interrupted (``SystemExit`` from
    SIGTERM, ``KeyboardInterrupt``, any error) the whole group is stopped before the exception goes on.

    Raises:
        TrainingError: on a non-zero exit, naming the log and quoting its tail.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = launch.argv()
    logger.info("train | %s | log %s", " ".join(argv), log_path)
    env = launch.env.process_env(extra_env) | {PARENT_ENV: str(os.getpid())}
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
            returncode = proc.wait()
        finally:
            if proc.returncode is None:
                stop_trainer(proc)
    if returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        raise TrainingError(f"{launch.kind} training exited with {returncode}; log: {log_path}\n" + "\n".join(tail))


def stop_trainer(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the trainer's process group, wait, then SIGKILL whatever is left of it."""
    logger.warning("train | stopping the trainer (process group %d)", proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)
    if not wait_group_exit(proc.pid, timeout_s):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


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
