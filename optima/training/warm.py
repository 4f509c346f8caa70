"""The driver's side of the warm trainer: one process per run, started early, one forked child per training stage.

See docs/cpu.md#warm-trainer. ``optima.training.warm_server`` (run in the training environment) imports torch,
transformers, TRL, datasets, peft and accelerate once; every single-process CPU training stage of the run is then
a fork of it (``WarmTrainer.train``) instead of an ``accelerate launch`` that imports all of that twice. The
pipeline starts it with the run (``warm_trainer_for`` + ``with``), so its imports overlap the first server start
and generation, and stops it at the end.

Guarantees kept from the ``accelerate launch`` path (``optima.training.launch``): the stage's output goes to its
log, its state to ``trainer_state.json`` (the progress bar), a non-zero exit is a ``TrainingError`` naming the stage
and the log; SIGTERM or Ctrl-C of the driver stops the whole process group (server and child) before the exception
goes on; a driver killed by ``kill -9`` leaves nothing behind (the server gets SIGTERM through
``PR_SET_PDEATHSIG`` and sees its stdin end; its child dies with it). A child killed mid-training leaves the
trainer's ``checkpoint-<step>`` folders, from which the stage resumes.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optima.environments import REPO_ROOT, PythonEnv
from optima.methods import SFT
from optima.serving.processes import PARENT_ENV, stop_group
from optima.training.errors import STOP_TIMEOUT_S, TrainingError, failure_message
from optima.training.launch_config import TrainLaunch, cpu_allocator_env, launch_for

if TYPE_CHECKING:
    from optima.config.types import TrainingFields

logger = logging.getLogger(__name__)

WARM_MODULE = "optima.training.warm_server"
WARM_LOG = "warm_trainer.log"


class WarmTrainer:
    """The run's warm trainer process (a context manager: started on entry when enabled, stopped on exit).

    Args:
        env: The training environment.
        log_path: The server's own output (stage output goes to each stage's log).
        enabled: False: ``serves`` is always False and nothing starts (``accelerate launch`` for every stage).
        preload: Modules to import before serving (None: the server's ``PRELOAD``).
    """

    def __init__(self, env: PythonEnv, log_path: Path, enabled: bool = True, preload: Sequence[str] | None = None):
        self.env, self.log_path, self.enabled, self.preload = env, Path(log_path), enabled, preload
        self.proc: subprocess.Popen | None = None
        self.import_s: float | None = None

    def __enter__(self) -> WarmTrainer:
        if self.enabled:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def serves(self, launch: TrainLaunch) -> bool:
        """Whether ``launch`` runs here: enabled, and one training process on this machine's CPU."""
        return self.enabled and launch.single_cpu_process()

    def start(self) -> None:
        """Start the server (it imports in the background; nothing waits for it here)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        flags = ["--preload", ",".join(self.preload)] if self.preload is not None else []
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.env.module_argv(WARM_MODULE, *flags),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env.process_env({PARENT_ENV: str(os.getpid())} | cpu_allocator_env()),
                cwd=REPO_ROOT,
                start_new_session=True,
                text=True,
            )
        logger.info("train | warm trainer started (process group %d) | log %s", self.proc.pid, self.log_path)

    def train(self, launch: TrainLaunch, env: dict[str, str], log_path: Path, desc: str) -> int:
        """Run one stage as a forked child; its exit code (-N: killed by signal N).

        Args:
            launch: The stage (its accelerate flags and handbook script).
            env: The stage's whole environment (what ``accelerate launch`` would have been given).
            log_path: The stage's log (the child's stdout and stderr, appended).
            desc: The stage's label, for errors.

        Raises:
            TrainingError: the server is gone (the message names the stage, its log and the server's log).
        """
        self.start()
        request = {
            "stage": desc,
            "argv": launch.script_argv(),
            "launch_args": launch.launch_args(),
            "env": env,
            "cwd": str(REPO_ROOT),
            "log": str(log_path),
        }
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            started = self.receive(desc, log_path)
            logger.info("train | %s | warm trainer child %s", desc, started.get("started"))
            return int(self.receive(desc, log_path)["returncode"])
        except BrokenPipeError:
            raise self.gone(desc, log_path) from None
        except BaseException:
            self.close()  # interrupted (SIGTERM, Ctrl-C, an error): the child and the server stop with the group
            raise

    def receive(self, desc: str, log_path: Path) -> dict[str, Any]:
        """The server's next reply (its ``ready`` line is noted and skipped)."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise self.gone(desc, log_path)
            reply = json.loads(line)
            if not reply.get("ready"):
                return reply
            self.import_s = reply.get("import_s")
            logger.info("train | warm trainer ready (imports took %s s)", self.import_s)

    def gone(self, desc: str, log_path: Path) -> TrainingError:
        """The error for a server that exited while (or before) running ``desc``."""
        code = self.proc.wait()
        server = failure_message(f"the warm trainer exited with {code}", self.log_path)
        return TrainingError(failure_message(f"{desc}: training failed", log_path) + "\n" + server)

    def close(self) -> None:
        """Stop the server's process group (its running child included): SIGTERM, wait, SIGKILL."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            stop_group(self.proc, STOP_TIMEOUT_S, "the warm trainer")
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except BrokenPipeError:
                pass  # the server is gone: what was still buffered for it does not matter


def warm_trainer_for(
    recipe: TrainingFields, env: PythonEnv | None, gpu: bool, placement, log_dir: Path
) -> WarmTrainer:
    """The run's warm trainer: enabled for a recipe with ``warm_trainer`` whose training is one CPU process.

    Args:
        recipe: The recipe (``warm_trainer``, ``accelerate_config``, ``num_processes``, ...).
        env: The training environment (None: the run trains nothing).
        gpu: Whether a GPU is visible (GPU runs keep ``accelerate launch``).
        placement: The hardware allocation's ``TrainingPlacement`` (or None).
        log_dir: Where the server's log goes.
    """
    if env is None or not recipe.warm_trainer or gpu:
        return WarmTrainer(env, Path(log_dir) / WARM_LOG, enabled=False)
    # The accelerate config and the process count are the same for every train stage (SFT and DPO alike).
    launch = launch_for(recipe, SFT, env, Path("trainer.yaml"), gpu, placement)
    return WarmTrainer(env, Path(log_dir) / WARM_LOG, enabled=launch.single_cpu_process())
