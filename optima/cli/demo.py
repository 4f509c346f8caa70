"""``python -m optima demo`` and ``python -m optima times``: the CPU demo with its timing, and the timing alone.

    python -m optima demo                                  # make demo: train/sft_recipes/demo_arc.yaml, then its times
    python -m optima demo --recipe train/sft_recipes/demo_hotpot_qa.yaml
    python -m optima times runs/demo_arc_sft [--baseline OLD_RUN] [--json times.json]
    python -m optima times runs/my_run -- python sft_script.py --train_config_path ...   # run it sampled, then time

``demo`` runs ``sft_script.py`` on the recipe (in the repository, with this interpreter) while the machine's busy
share is sampled into the run directory, then prints the time per iteration (``optima/cli/iteration_times.py``)
and the run's report (``python -m optima report``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from optima.cli.cpu_busy import CpuSampler
from optima.cli.folders import run_report_command
from optima.cli.iteration_times import SAMPLES, compare_with, measure_run, render_times
from optima.serving import run_to_end

REPO = Path(__file__).resolve().parent.parent.parent
DEMO_RECIPE = Path("train/sft_recipes/demo_arc.yaml")
logger = logging.getLogger(__name__)


def build_times_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m optima times",
        description="time per iteration of a finished iSFT run (generation, training, start-ups, busy share)",
        usage="%(prog)s [RUN_DIR] [options] [-- COMMAND ...]",
    )
    parser.add_argument("run_dir", nargs="?", type=Path, default=REPO / "runs" / "demo_arc_sft")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here (bench/run_all.py)")
    parser.add_argument("--baseline", type=Path, default=None, help="a run directory of the same recipe to compare")
    return parser


def run_sampled(command: list[str], run_dir: Path, cwd: Path | None = None) -> int:
    """Run ``command`` while sampling ``/proc/stat`` into the run directory; its exit code."""
    with CpuSampler(run_dir / SAMPLES):
        return run_to_end(command, cwd=cwd)


def run_times_command(argv: list[str]) -> int:
    """``python -m optima times``: with a command after ``--``, run it sampled first; then print the times."""
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = build_times_parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if command:
        code = run_sampled(command, args.run_dir)
        if code != 0:
            logger.error("%s exited with %d", " ".join(command), code)
            return code
    return print_times(args.run_dir, args.baseline, args.json)


def print_times(run_dir: Path, baseline: Path | None = None, json_path: Path | None = None) -> int:
    """Measure ``run_dir`` (and its ``baseline``), print the table, write ``json_path``; 2 for no run there."""
    try:
        result = measure_run(run_dir)
        if baseline is not None:
            result["baseline"] = compare_with(result, baseline)
    except ValueError as error:
        logger.error("%s", error)
        return 2
    sys.stdout.write(render_times(result) + "\n")
    sys.stdout.flush()
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def recipe_output_dir(recipe: Path) -> Path:
    """The run directory a recipe writes (``output_dir``, relative to the repository as the scripts run there)."""
    import yaml

    output_dir = (yaml.safe_load(recipe.read_text()) or {}).get("output_dir")
    if not output_dir:
        raise ValueError(f"{recipe}: output_dir: missing (the demo needs the run directory to time)")
    return REPO / output_dir


def run_demo_command(argv: list[str]) -> int:
    """``python -m optima demo``: the iSFT demo recipe under the busy sampler, its times, then its report."""
    parser = argparse.ArgumentParser(
        prog="python -m optima demo",
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
    return print_times(run_dir) or run_report_command(run_dir)
