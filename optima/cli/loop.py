"""The three training scripts (``sft_script.py``, ``dpo_script.py``, ``sft_dpo_script.py``): flags, recipe, then the
plan (``--dry-run``) or the loop (``optima.loop``)."""

from __future__ import annotations

import argparse

from optima.cli.common import add_control_args, add_env_args, emit, failure_code, logger, resolve_envs
from optima.config import RecipeError, load_recipe
from optima.hardware.machine import resolve_hardware
from optima.logging_utils import setup_logging
from optima.loop import render_plan, run_loop
from optima.run import build_run


def build_loop_parser(description: str) -> argparse.ArgumentParser:
    """Flags of ``sft_script.py``, ``dpo_script.py`` and ``sft_dpo_script.py``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train_config_path", required=True, help="Optima recipe YAML (train/<method>_recipes/)")
    add_env_args(parser)
    parser.add_argument(
        "--skip_iteration", type=int, default=0, help="take the first N iterations as done and reuse their checkpoints"
    )
    parser.add_argument(
        "--skipping",
        type=int,
        default=0,
        help="original flag (advance the question cursor); slices now derive from the seed",
    )
    parser.add_argument(
        "--trainer_set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a trainer YAML key over the base YAML (value read as YAML; 'dpo.beta=0.1' for one trainer of "
        "iSFT-DPO); repeatable; same as --set trainer_overrides.KEY=VALUE",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no training progress bar on the console (the trainer's output goes only to its log file)",
    )
    add_control_args(parser)
    return parser


def trainer_set_overrides(items: list[str]) -> list[str]:
    """``--trainer_set KEY=VALUE`` items as ``--set trainer_overrides.KEY=VALUE`` items."""
    for item in items:
        if "=" not in item or not item.partition("=")[0].strip():
            raise RecipeError("trainer_overrides", f"--trainer_set expects key=value, got {item!r}")
    return [f"trainer_overrides.{item.strip()}" for item in items]


def run_loop_script(recipe_cls: type, description: str, argv: list[str] | None) -> int:
    """Body of the three training scripts: parse, load, then print the plan (``--dry-run``) or run the loop."""
    args = build_loop_parser(description).parse_args(argv)
    setup_logging()
    if args.skipping:
        logger.warning("--skipping %d ignored: question slices derive from (seed, iteration, stage)", args.skipping)
    try:
        overrides = args.set + trainer_set_overrides(args.trainer_set)
        recipe = load_recipe(recipe_cls, args.train_config_path, overrides, check_paths=not args.dry_run)
        envs = resolve_envs(args.vllm_env, args.alignment_env)
        run = build_run(recipe, envs, hardware=resolve_hardware(args.hardware), progress=not args.quiet)
        if args.dry_run:
            emit(render_plan(run, args.skip_iteration))
        else:
            run_loop(run, args.skip_iteration)
        return 0
    except Exception as exc:  # noqa: BLE001 - failure_code raises again what it does not expect
        return failure_code(exc)
