"""What every command line of Optima shares: the released commands' environment flags, ``--set``, ``--dry-run`` and
``--hardware``, and the exit codes: bad input (the recipe, an environment) ends with one message naming the file,
the field and the value and exit code 2, a failed stage with its reason and 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from optima.config import RecipeError
from optima.environments import EnvError, PythonEnv, resolve_env

logger = logging.getLogger("optima.cli")  # one logger name for every command, as the log lines always said

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
ENV_HELP = "a virtualenv directory, a python executable, or a conda env name (default: .venvs/{role})"


def add_env_args(parser: argparse.ArgumentParser, train: bool = True) -> None:
    parser.add_argument("--vllm_env", default=None, help="environment with vLLM: " + ENV_HELP.format(role="vllm"))
    if train:
        parser.add_argument(
            "--alignment_env", default=None, help="environment with TRL: " + ENV_HELP.format(role="train")
        )


def add_control_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key (value read as YAML); repeatable",
    )
    parser.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="validate the recipe and print the plan (stages, models, paths, commands, hardware); start nothing",
    )
    parser.add_argument(
        "--hardware",
        metavar="[NODESx]GPUSxMEMORY",
        help="plan for this hardware instead of the detected one, e.g. 8x80GB or 2x8x141GB (nodes x GPUs x memory), "
        "or cpu; with --dry-run any machine can be planned from anywhere",
    )


def resolve_envs(vllm_env: str | None, alignment_env: str | None = None, train: bool = True) -> dict[str, PythonEnv]:
    """Both environments (or only vLLM's); single-env mode is both flags naming the same env."""
    envs = {"vllm": resolve_env(vllm_env, "vllm")}
    if train:
        envs["train"] = resolve_env(alignment_env, "train")
    return envs


def failure_code(exc: Exception) -> int:
    """The exit code of a command that raised ``exc``, its one message logged: bad input 2, a failed stage 1; an
    unexpected exception is raised again (a traceback is what a bug should show)."""
    from optima.lineage import FolderLocked
    from optima.loop import NothingSelected
    from optima.serving.client import ConstraintRejected, NoReplicaLeft, ServerStartupError
    from optima.tasks import DataError
    from optima.training.launch import TrainingError

    if isinstance(exc, RecipeError | EnvError):
        logger.error("%s", exc)
        return EXIT_BAD_INPUT
    failed = (NothingSelected, ServerStartupError, NoReplicaLeft, ConstraintRejected, DataError, TrainingError)
    if isinstance(exc, (*failed, FolderLocked)):
        logger.error("%s: %s", type(exc).__name__, exc)
        return EXIT_FAILED
    raise exc


def guarded(body: Callable[[], int]) -> int:
    """Run a command's body; bad input ends with one clear message and exit code 2, a failed stage with 1."""
    try:
        return body()
    except Exception as exc:  # noqa: BLE001 - failure_code raises again what it does not expect
        return failure_code(exc)


def emit(text: str) -> None:
    """Write a plan or table to stdout (the library never prints through ``print``)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def overrides_from_flags(args: argparse.Namespace, mapping: dict[str, str]) -> dict[str, Any]:
    """Recipe values from explicit flags (``None`` means not given)."""
    return {key: getattr(args, flag, None) for flag, key in mapping.items() if getattr(args, flag, None) is not None}
