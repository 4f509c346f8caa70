"""``make demo``: the iSFT CPU demo run with its busy share sampled, then its time per iteration and its report.

    python -m dev.demo                                          # train/sft_recipes/demo_arc.yaml
    python -m dev.demo --recipe train/sft_recipes/demo_hotpot_qa.yaml

Runs ``sft_script.py`` on the recipe (in the repository, with this interpreter) under ``dev.cpu_busy``'s sampler,
then prints ``dev.times``' table and ``python -m optima report``'s report of the run directory.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import yaml

from dev.times import print_times, run_sampled
from optima.__main__ import main as optima_main
from optima.logging_utils import setup_logging

REPO = Path(__file__).resolve().parent.parent
DEMO_RECIPE = Path("train/sft_recipes/demo_arc.yaml")
logger = logging.getLogger(__name__)


def recipe_output_dir(recipe: Path) -> Path:
    """The run directory a recipe writes (``output_dir``, relative to the repository as the scripts run there)."""
    output_dir = (yaml.safe_load(recipe.read_text()) or {}).get("output_dir")
    if not output_dir:
        raise ValueError(f"{recipe}: output_dir: missing (the demo needs the run directory to time)")
    return REPO / output_dir


def main(argv: list[str] | None = None) -> int:
    """``python -m dev.demo``: the iSFT demo recipe under the busy sampler, its times, then its report."""
    parser = argparse.ArgumentParser(
        prog="python -m dev.demo",
        description="the iSFT CPU demo (make demo): the run, sampled for the busy share; its times; its report",
    )
    parser.add_argument("--recipe", type=Path, default=DEMO_RECIPE, help=f"an iSFT recipe (default {DEMO_RECIPE})")
    args = parser.parse_args(argv)
    recipe = args.recipe if args.recipe.is_absolute() else REPO / args.recipe
    try:
        run_dir = recipe_output_dir(recipe)
    except (OSError, ValueError) as error:
        logger.error("%s", error)
        return 2
    shown = recipe.relative_to(REPO) if recipe.is_relative_to(REPO) else recipe  # as make demo always passed it
    command = [sys.executable, "sft_script.py", "--train_config_path", str(shown)]
    code = run_sampled(command, run_dir, cwd=REPO)
    if code != 0:
        logger.error("%s exited with %d", " ".join(command), code)
        return code
    return print_times(run_dir) or optima_main(["report", str(run_dir)])


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
