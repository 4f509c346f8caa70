"""A driver that runs one stage through a warm trainer: ``python tests/warm_driver.py LOG_DIR SCRIPT [--then-wait]``.

The stage is ``SCRIPT`` (a plain Python file standing in for the handbook script), run by ``run_training`` as a
fork of a warm trainer that preloads nothing. With ``--then-wait`` the driver waits (the server idle) after the
stage until it is signalled. The tests signal or kill it and check that nothing outlives it.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optima.environments import PythonEnv, resolve_env  # noqa: E402
from optima.logging_utils import setup_logging  # noqa: E402
from optima.serving.processes import sigterm_as_exit  # noqa: E402
from optima.training.launch import run_training  # noqa: E402
from optima.training.warm import WarmTrainer  # noqa: E402


@dataclass(frozen=True)
class ScriptLaunch:
    """A stand-in ``TrainLaunch``: one CPU process running ``script`` (no accelerate flags, so none applied)."""

    script: Path
    env: PythonEnv
    kind: str = "sft"

    def script_argv(self) -> list[str]:
        return [str(self.script), "--config", "unused.yaml"]

    def launch_args(self) -> None:
        return None

    def env_vars(self) -> dict[str, str]:
        return {}

    def single_cpu_process(self) -> bool:
        return True

    def argv(self) -> list[str]:
        return self.env.script_argv(*self.script_argv())


def main() -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the suite may run with SIGINT ignored
    setup_logging()
    log_dir, script = Path(sys.argv[1]), Path(sys.argv[2])
    env = resolve_env(sys.executable, "train")
    with sigterm_as_exit(), WarmTrainer(env, log_dir / "warm_trainer.log", preload=()) as warm:
        run_training(ScriptLaunch(script, env), log_dir / "train.log", desc="train iteration 1", warm=warm)
        if "--then-wait" in sys.argv:
            print("IDLE", flush=True)
            threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
