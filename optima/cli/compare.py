"""``python -m optima compare``: baselines and Optima checkpoints on the same questions, one task or several."""

from __future__ import annotations

import argparse
from pathlib import Path

from optima.cli.common import emit, guarded, resolve_envs
from optima.cli.evaluate import (
    add_debate_args,
    add_eval_args,
    allocate_evaluation,
    baseline_settings,
    eval_recipe_from_args,
    resolve_machine,
)
from optima.config import SC_DEVICE_SPAN, RecipeError
from optima.lineage import run_lock
from optima.logging_utils import setup_logging

COMPARE_DESCRIPTION = r"""Baselines and Optima checkpoints on the same questions, in one table and one plot.

    python -m optima compare --model models/SmolLM2-135M-Instruct --tasks arc,gsm8k --limit 40 \
        --optima Optima-iSFT=runs/demo_arc_sft/checkpoints/iteration_1 --optima_sc 8

The base model is served once for all baselines (CoT, CoT-SC with 8 samples, MAD with 3 agents and 2 rounds,
AutoForm); each --optima checkpoint is served in turn and holds Optima's conversation greedily (and, with
--optima_sc K, K sampled conversations, majority-voted). Each method's results resume on their own and are
recomputed when what produced them changed. Writes comparison.md/.csv/.json/.png in the output folder; with
--tasks, one folder per task and the methods x tasks table table.md/.csv/.json/.png. Add --dry-run to print what
would run.
"""


def build_compare_parser() -> argparse.ArgumentParser:
    """Flags of ``python -m optima compare``."""
    from optima.evaluation.methods import BASELINES

    parser = argparse.ArgumentParser(
        prog="python -m optima compare",
        description=COMPARE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="the base model the baselines run on (a folder)")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=(*BASELINES, "none"),
        default=list(BASELINES),
        help="baselines to run (default: all; 'none': only the --optima rows, e.g. one more checkpoint on the "
        "questions of an earlier comparison)",
    )
    parser.add_argument(
        "--optima",
        action="append",
        default=[],
        metavar="NAME=CHECKPOINT",
        help="an Optima row: NAME in the table, CHECKPOINT a model folder (repeatable); TASK:NAME=CHECKPOINT "
        "puts it in that task's table only",
    )
    parser.add_argument(
        "--optima_sc", type=int, default=0, metavar="K", help="also K sampled conversations per Optima row, voted"
    )
    parser.add_argument("--tasks", help="comma-separated tasks, e.g. arc,gsm8k: the methods x tasks table")
    parser.add_argument("--output_path", help="output folder (default runs/compare_<task>[_<task>...])")
    parser.add_argument("--samples", type=int, help="answers per question of CoT-SC (default 8)")
    parser.add_argument("--temperature", type=float, help="sampling temperature of CoT-SC and MAD (default 0.5)")
    add_debate_args(parser)
    add_eval_args(parser, SC_DEVICE_SPAN)  # one model, as multi_sc_data_generate_script.py
    return parser


def run_compare_script(argv: list[str] | None) -> int:
    """Body of ``python -m optima compare``: flags -> recipe and options -> dry run or run."""
    args = build_compare_parser().parse_args(argv)
    setup_logging()

    def body() -> int:
        from optima.evaluation.compare import CompareOptions, parse_optima_rows, render_compare_dry_run

        tasks = compare_tasks(args)
        recipes = [compare_recipe(args, task, len(tasks) > 1 or bool(args.tasks)) for task in tasks]
        settings = baseline_settings(args, recipes[0].num_samples, recipes[0].sc_temperature)
        methods = tuple(dict.fromkeys(m for m in args.methods if m != "none"))
        options = CompareOptions(methods, parse_optima_rows(args.optima), settings, args.optima_sc)
        machine = resolve_machine(args.hardware)
        hardware = [allocate_evaluation(recipe, machine) for recipe in recipes]
        if args.dry_run:
            for recipe, allocation in zip(recipes, hardware, strict=True):
                emit(render_compare_dry_run(recipe, options) + "\n" + "\n".join(allocation.render()))
            return 0
        for allocation in hardware:
            allocation.check()  # an impossible placement stops here, before any server starts
        envs = resolve_envs(args.vllm_env, train=False)
        with run_lock(Path(args.output_path) if args.tasks else Path(recipes[0].output_root_path)):
            if args.tasks:
                from optima.evaluation.compare import run_compare_tasks

                text = run_compare_tasks(recipes, envs, options, Path(args.output_path))
            else:
                from optima.evaluation.compare import run_compare

                text = run_compare(recipes[0], envs, options)
            from optima.browser import write_conversations_page

            for recipe in recipes:  # every answer, debate and conversation behind each task's table
                write_conversations_page(Path(recipe.output_root_path))
        emit(text)
        return 0

    return guarded(body)


def compare_tasks(args: argparse.Namespace) -> list[str | None]:
    """The tasks of ``compare``: ``--tasks a,b`` or ``--dataset_type`` (None: the ``--config`` recipe's)."""
    from optima.config import resolve_path

    if args.tasks and args.dataset_type:
        raise RecipeError("tasks", "give --tasks or --dataset_type, not both")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else [args.dataset_type]
    if args.tasks and (not tasks or len(set(tasks)) != len(tasks)):
        raise RecipeError("tasks", f"expected distinct comma-separated task names, got {args.tasks!r}")
    if tasks == [None] and not args.config:
        raise RecipeError("dataset_type", "required (--tasks, --dataset_type or a --config recipe)")
    if args.output_path is None and tasks != [None]:
        args.output_path = resolve_path("runs/compare_" + "_".join(tasks))
    return tasks


def compare_recipe(args: argparse.Namespace, task: str | None, own_folder: bool):
    """The ``MultiSCRecipe`` of one task of ``compare`` (in ``<output>/<task>/`` with ``own_folder``)."""
    from optima.config import MultiSCRecipe

    flags = {"model": "model_root_path", "output_path": "output_root_path"}
    flags |= {"samples": "num_samples", "temperature": "sc_temperature"}
    values = {"initial_model_path": args.model}  # also the fallback tokenizer of token counts
    task_args = argparse.Namespace(**vars(args))
    task_args.samples = 8 if args.samples is None else args.samples
    task_args.dataset_type = task
    if own_folder:
        task_args.output_path = str(Path(args.output_path) / task)
    return eval_recipe_from_args(MultiSCRecipe, task_args, flags, values)
