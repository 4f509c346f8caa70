"""The warm trainer: one process per run imports the training stack once and forks a child per training stage.

See docs/cpu.md#warm-trainer. ``accelerate launch`` pays, for every stage, two interpreter starts and two imports of
torch (accelerate's own, then the training script's, with transformers, TRL, datasets and peft): about 9 s of CPU
on a 2-core box. A single-process CPU training needs none of what ``accelerate launch`` adds beyond a few
environment variables, so the driver (``optima.training.warm``) starts this module once per run, in the training
environment and in its own process group, while the first generation runs::

    <train python> -m optima.training.warm_server [--preload MODULE,...]

It imports ``PRELOAD`` and then serves requests, one JSON object per line on stdin, replying on stdout:

* ``{"ready": true, "pid": P, "import_s": S}`` once the imports are done;
* a request ``{"stage", "argv", "launch_args", "env", "cwd", "log"}``: a child is forked (``{"started": PID}``), the
  reply ``{"returncode": RC}`` comes when it has exited.

The child starts from the state right after the imports (a fork: nothing of an earlier stage is left), takes the
request's environment, computes the variables ``accelerate launch`` would set from the same flags
(``launch_args``, through accelerate's own parser; its thread count is applied with ``torch.set_num_threads``,
since the OpenMP runtime read ``OMP_NUM_THREADS`` when torch was imported), writes its output into the stage's log,
and runs the handbook script (``argv[0]``) as ``__main__``: the same code ``accelerate launch`` runs, with the
same arguments. Its weights are bit-identical to the ``accelerate launch`` path's.

Stopping: SIGTERM or SIGINT stops the child (SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``) and exits; so does
the driver's death, seen as SIGTERM (``PR_SET_PDEATHSIG``) or as the end of stdin, even during a stage. A child
dies with this process (``PR_SET_PDEATHSIG`` with SIGKILL). A stage killed mid-training leaves the trainer's
``checkpoint-<step>`` folders as ``accelerate launch`` would: the stage resumes from them.

Standard library only at the top: the driver imports nothing from here.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import json
import logging
import os
import runpy
import select
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import IO, Any

from optima.logging_utils import setup_logging
from optima.serving.processes import die_with_parent, set_pdeathsig

logger = logging.getLogger(__name__)

WARM_MODULE = "optima.training.warm_server"
# What a training stage imports (transformers' trainer, TRL's SFT and DPO trainers, peft for LoRA, accelerate's
# launcher for its environment), so that a forked child finds all of it loaded.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.trainer",
    "datasets",
    "accelerate",
    "accelerate.commands.launch",
    "peft",
    "trl",
    "trl.trainer.sft_trainer",
    "trl.trainer.dpo_trainer",
    "safetensors.torch",
    "optima.training.sft_train",
    "optima.training.dpo_train",
    "optima.training.common",
    "optima.training.checkpoint",
    "optima.weights_probe",
)
# Imported when the training env has them (the trainer's tensorboard logging: report_to auto or tensorboard).
OPTIONAL_PRELOAD = ("torch.utils.tensorboard",)
STOP_TIMEOUT_S = 30.0  # grace period between SIGTERM and SIGKILL of a stage's child


class SimpleLaunchOnly(RuntimeError):
    """The accelerate flags ask for more than one process (not something a forked child can be)."""


def accelerate_env(launch_args: Sequence[str], argv: Sequence[str]) -> dict[str, str]:
    """The environment ``accelerate launch LAUNCH_ARGS ARGV...`` gives its (single) training process.

    accelerate's own parser, config reading and simple launcher compute it, from ``os.environ``.

    Raises:
        SimpleLaunchOnly: the flags pick a multi-process launcher (DeepSpeed, FSDP, torchrun, TPU).
    """
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    args = launch_command_parser().parse_args([*launch_args, *argv])
    args, _defaults, _mixed_precision = _validate_launch_command(args)
    multi = [
        name for name in ("use_deepspeed", "use_fsdp", "use_megatron_lm", "multi_gpu", "tpu") if getattr(args, name)
    ]
    if (multi and not args.cpu) or (args.num_processes or 1) > 1 or (args.num_machines or 1) > 1:
        raise SimpleLaunchOnly(f"accelerate flags {list(launch_args)} ask for {multi or 'several processes'}")
    _cmd, env = prepare_simple_launcher_cmd_env(args)
    return env


def run_stage(request: dict[str, Any]) -> int:
    """In the forked child: take the request's environment and output, run the script as ``__main__``.

    Returns:
        The script's exit code (an exception: its traceback in the log, 1).
    """
    # Logging as in a fresh interpreter (the script sets up its own; accelerate's launcher never does).
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = list(request["argv"])
    try:
        if request.get("launch_args") is not None:
            os.environ.update(accelerate_env(request["launch_args"], argv))
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # what OMP_NUM_THREADS does at start-up
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` sets it
        runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        sys.stderr.write(f"{code}\n")  # what the interpreter prints for SystemExit("message")
        return 1
    except BaseException:  # noqa: BLE001 (a child reports every failure through its log and exit code)
        traceback.print_exc()
        return 1


def child_main(request: dict[str, Any], parent: int, protocol: Sequence[int]) -> None:
    """The forked child: default signals, die with the server, output into the stage log, run, exit."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        set_pdeathsig(signal.SIGKILL)
        if os.getppid() != parent:  # the server died before the request took effect
            os._exit(137)
        for fd in protocol:
            os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        code = run_stage(request)
        atexit._run_exitfuncs()  # what the interpreter runs at exit (logging flushes, trackers), then leave
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class WarmServer:
    """The request loop (see the module docstring).

    Args:
        requests: Where requests arrive (the driver's pipe).
        replies: Where replies go.
    """

    def __init__(self, requests: IO[str], replies: IO[str]):
        self.requests, self.replies = requests, replies
        self.child: int | None = None

    def reply(self, **message: Any) -> None:
        self.replies.write(json.dumps(message) + "\n")
        self.replies.flush()

    def serve(self) -> int:
        """Answer requests until stdin ends (the driver closed it, or died)."""
        for line in self.requests:
            if not line.strip():
                continue
            request = json.loads(line)
            pid = self.fork(request)
            self.reply(started=pid)
            self.reply(returncode=self.wait(pid))
        return 0

    def fork(self, request: dict[str, Any]) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            child_main(request, parent, (self.requests.fileno(), self.replies.fileno()))
        self.child = pid
        logger.info("warm trainer | stage %s | child %d | log %s", request.get("stage"), pid, request["log"])
        return pid

    def wait(self, pid: int) -> int:
        """The child's exit code (-N: killed by signal N); stops it when the driver's pipe ends meanwhile."""
        pidfd = os.pidfd_open(pid)
        try:
            while True:
                ready, _, _ = select.select([pidfd, self.requests.fileno()], [], [])
                if pidfd in ready:
                    break
                if not os.read(self.requests.fileno(), 1):  # end of stdin: the driver is gone
                    logger.warning("warm trainer | the driver is gone: stopping the stage")
                    self.stop_child()
                    break
                # A byte while a stage runs is a protocol error; it is dropped (the next request starts fresh).
        finally:
            os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self.child = None
        return os.waitstatus_to_exitcode(status)

    def stop_child(self) -> None:
        """SIGTERM the running child, wait ``STOP_TIMEOUT_S``, then SIGKILL it."""
        pid = self.child
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                self.child = None
                return
            time.sleep(0.05)  # poll interval of a wait with a deadline (waitpid has no timeout)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        self.child = None


def preload(modules: Sequence[str], optional: Sequence[str] = ()) -> None:
    """Import ``modules``, then whichever of ``optional`` the environment has."""
    for module in filter(None, modules):
        importlib.import_module(module)
    for module in optional:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            logger.info("warm trainer | %s not preloaded: %s", module, exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {WARM_MODULE}")
    parser.add_argument("--preload", help="modules to import before serving (comma list; default: the training stack)")
    args = parser.parse_args(argv)
    setup_logging()
    # The protocol gets its own descriptors; fd 1 becomes stderr so that nothing printed by an import reaches it.
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    server = WarmServer(requests, replies)

    def stop(signum: int, _frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        server.stop_child()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    die_with_parent()
    start = time.monotonic()
    modules, optional = (PRELOAD, OPTIONAL_PRELOAD) if args.preload is None else (args.preload.split(","), ())
    preload(modules, optional)
    server.reply(ready=True, pid=os.getpid(), import_s=round(time.monotonic() - start, 3))
    return server.serve()


if __name__ == "__main__":
    raise SystemExit(main())
