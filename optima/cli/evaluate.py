"""The evaluation commands: ``inference_script.py`` (the checkpoint sweep), ``multi_sc_data_generate_script.py``
(self-consistency) and ``python -m optima compare`` (baselines and checkpoints on the same questions)."""

from __future__ import annotations

import argparse
from pathlib import Path

from optima.browser import write_conversations_page
from optima.cli.common import add_control_args, add_env_args, emit, guarded, overrides_from_flags, resolve_envs
from optima.config import (
    SC_DEVICE_SPAN,
    SWEEP_DEVICE_SPAN,
    MultiSCRecipe,
    RecipeError,
    expand_device_flag,
    load_recipe,
    parse_override,
    resolve_path,
)
from optima.evaluation import compare, self_consistency, sweep
from optima.evaluation.baselines import BASELINES, BaselineSettings, DebateSettings
from optima.hardware.allocation import allocate_this_machine
from optima.hardware.machine import resolve_hardware
from optima.lineage import run_lock
from optima.logging_utils import setup_logging

# Original evaluation flags -> InferenceRecipe / MultiSCRecipe keys.
EVAL_FLAGS = {
    "dataset_type": "dataset_type",
    "tokenizer_path": "tokenizer_first_path",
    "device": "devices",
    "port": "port",
    "num_thread": "thread_count",
    "limit": "limit",
    "limit_mode": "limit_mode",
    "seed": "seed",
    "data_dir": "data_dir",
    "base_model_path": "initial_model_path",
}
SWEEP_FLAGS = {
    "model_root_path": "model_root_path",
    "output_root_path": "output_root_path",
    "include_base": "include_base",
}
SC_FLAGS = {"model_path": "model_root_path", "output_path": "output_root_path", "temperature": "sc_temperature"}
SC_FLAGS |= {"num_samples": "num_samples"}
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


def add_eval_args(parser: argparse.ArgumentParser, device_span: int) -> None:
    """Flags of the two evaluation scripts and ``compare``; ``--device d`` names ``device_span`` GPUs from d on."""
    parser.add_argument("--config", help="optional recipe YAML with the same keys as the flags")
    parser.add_argument("--dataset_type", help="hotpot_qa, mwh_qa, trival_qa, cbt, math, gsm8k, arc or mmlu")
    parser.add_argument("--tokenizer_path", help="tokenizer for token counts (default: each model's own)")
    parser.add_argument(
        "--device",
        help=f"first GPU: d = GPUs d..d+{device_span - 1}, one vLLM replica each; a list 0,3 = "
        "exactly those GPUs (default: all visible; ignored on CPU)",
    )
    parser.add_argument("--port", type=int, help="first port tried (default 8000)")
    parser.add_argument("--num_thread", type=int, help="conversations in flight (default 64)")
    parser.add_argument(
        "--limit",
        type=int,
        help="evaluate only N questions, a debugging aid, not a benchmark result: a seeded sample stratified by "
        "the task's groups (MMLU subject, MATH subject and level), the same for every model and method",
    )
    parser.add_argument(
        "--limit_mode", choices=("sample", "first"), help="sample (default) or first: the first N questions"
    )
    parser.add_argument("--seed", type=int, help="seed of contexts and sampling (default 42)")
    parser.add_argument("--data_dir", help="local dataset root (default $OPTIMA_DATA_DIR, else the hub)")
    parser.add_argument("--mad_agents", type=int, default=3, help="debating agents of MAD (default 3)")
    parser.add_argument(
        "--mad_rounds", type=int, default=2, help="revision rounds of MAD after the first answers (default 2)"
    )
    parser.add_argument(
        "--mad_context",
        choices=("whole", "split"),
        default="whole",
        help="information-exchange tasks: every debater reads the whole context (default), or agent i reads "
        "half i mod 2, as Optima's and AutoForm's two agents do (docs/method.md#baselines)",
    )
    add_env_args(parser, train=False)
    add_control_args(parser)


def build_eval_parser(description: str, multi_sc: bool) -> argparse.ArgumentParser:
    """Flags of ``inference_script.py`` (sweep) and ``multi_sc_data_generate_script.py`` (self-consistency)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if multi_sc:
        parser.add_argument("--model_path", required=True, help="the model to sample from")
        parser.add_argument("--output_path", help="output folder (default <model_path>/eval)")
        parser.add_argument("--temperature", type=float, help="sampling temperature (default 0.5)")
        parser.add_argument("--num_samples", type=int, help="conversations per question (default 50)")
        baseline_help = (
            "also run a baseline on the same questions on the base model (--base_model_path, else the run's "
            "initial_model_path; repeatable): cot = CoT (greedy) and CoT-SC "
            "(num_samples answers), mad = multi-agent debate at the temperature, autoform = num_samples AutoForm "
            "conversations"
        )
        parser.add_argument("--max_k", type=int, help="largest k of the majority-vote analysis (default num_samples)")
    else:
        parser.add_argument("--model_root_path", required=True, help="folder of iteration_<k> checkpoints")
        parser.add_argument("--output_root_path", help="output folder (default <model_root_path>/eval)")
        parser.add_argument("--include_base", action="store_true", default=None, help="also evaluate the base model")
        baseline_help = (
            "also run a baseline on every model (repeatable): cot (greedy CoT), mad (multi-agent debate at "
            "T=0.5), autoform (greedy AutoForm conversation); adds comparison.md/.csv/.png"
        )
    parser.add_argument("--baseline", action="append", choices=("cot", "mad", "autoform"), help=baseline_help)
    parser.add_argument("--base_model_path", help="the base model (evaluated as 'base' with --include_base)")
    add_eval_args(parser, SC_DEVICE_SPAN if multi_sc else SWEEP_DEVICE_SPAN)
    return parser


def eval_recipe(recipe_cls: type, args: argparse.Namespace, flags: dict[str, str], defaults=None):
    """The evaluation recipe from ``defaults``, the flags (``flags``: flag -> recipe key), ``--config``, ``--set``."""
    values = dict(defaults or {}) | overrides_from_flags(args, EVAL_FLAGS | flags)
    if "devices" in values:  # --device d: four (sweep) or eight (self-consistency) GPUs from d (D1)
        span = SC_DEVICE_SPAN if recipe_cls.method == "multi_sc" else SWEEP_DEVICE_SPAN
        values["devices"] = expand_device_flag(values["devices"], span)
    if "tokenizer_first_path" in values:
        values["tokenizer_second_path"] = values["tokenizer_first_path"]
    values |= dict(parse_override(item) for item in args.set)
    return load_recipe(recipe_cls, args.config, values, check_paths=not args.dry_run)


def baseline_settings(args: argparse.Namespace, samples: int = 8, temperature: float = 0.5) -> BaselineSettings:
    """Sampling and debate settings of the baselines from the flags."""
    return BaselineSettings(samples, temperature, DebateSettings(args.mad_agents, args.mad_rounds, args.mad_context))


def run_eval_script(recipe_cls: type, description: str, argv: list[str] | None) -> int:
    """Body of the two evaluation scripts: flags -> recipe -> plan or run."""
    multi_sc = recipe_cls.method == "multi_sc"
    args = build_eval_parser(description, multi_sc).parse_args(argv)
    setup_logging()

    def body() -> int:
        recipe = eval_recipe(recipe_cls, args, SC_FLAGS if multi_sc else SWEEP_FLAGS)
        envs = resolve_envs(args.vllm_env, train=False)
        baselines = tuple(dict.fromkeys(args.baseline or ()))
        settings = baseline_settings(args, recipe.num_samples, recipe.sc_temperature) if multi_sc else None
        hardware = allocate_this_machine(recipe, resolve_hardware(args.hardware))
        if args.dry_run:
            shown = ", ".join("cot, cot-SC" if b == "cot" and multi_sc else b for b in baselines)
            text = sweep.render_dry_run(recipe, envs) + (f"\n  baseline: {shown}" if baselines else "")
            emit(text + "\n" + "\n".join(hardware.render()))
            return 0
        hardware.check()
        with run_lock(Path(recipe.output_root_path)):  # one evaluation writes a folder at a time
            if multi_sc:
                options = self_consistency.SCOptions(baselines, args.max_k, settings.debate)
                emit(self_consistency.run_self_consistency(recipe, envs, options))
            else:
                table = sweep.run_sweep(recipe, envs, baselines, baseline_settings(args))
                write_conversations_page(Path(recipe.output_root_path))  # every conversation of every model and method
                emit(table)
        return 0

    return guarded(body)


def build_compare_parser() -> argparse.ArgumentParser:
    """Flags of ``python -m optima compare``."""
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
    add_eval_args(parser, SC_DEVICE_SPAN)  # one model, as multi_sc_data_generate_script.py
    return parser


def compare_tasks(args: argparse.Namespace) -> list[str | None]:
    """The tasks of ``compare``: ``--tasks a,b`` or ``--dataset_type`` (None: the ``--config`` recipe's)."""
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


def compare_recipe(args: argparse.Namespace, task: str | None, own_folder: bool) -> MultiSCRecipe:
    """The ``MultiSCRecipe`` of one task of ``compare`` (in ``<output>/<task>/`` with ``own_folder``)."""
    flags = {"model": "model_root_path", "output_path": "output_root_path"}
    flags |= {"samples": "num_samples", "temperature": "sc_temperature"}
    task_args = argparse.Namespace(**vars(args))
    task_args.samples = 8 if args.samples is None else args.samples
    task_args.dataset_type = task
    if own_folder:
        task_args.output_path = str(Path(args.output_path) / task)
    # The base model is also the fallback tokenizer of token counts.
    return eval_recipe(MultiSCRecipe, task_args, flags, {"initial_model_path": args.model})


def run_compare_script(argv: list[str] | None) -> int:
    """Body of ``python -m optima compare``: flags -> recipe and options -> dry run or run."""
    args = build_compare_parser().parse_args(argv)
    setup_logging()

    def body() -> int:
        tasks = compare_tasks(args)
        recipes = [compare_recipe(args, task, len(tasks) > 1 or bool(args.tasks)) for task in tasks]
        settings = baseline_settings(args, recipes[0].num_samples, recipes[0].sc_temperature)
        methods = tuple(dict.fromkeys(m for m in args.methods if m != "none"))
        options = compare.CompareOptions(methods, compare.parse_optima_rows(args.optima), settings, args.optima_sc)
        machine = resolve_hardware(args.hardware)  # detected once for all tasks
        hardware = [allocate_this_machine(recipe, machine) for recipe in recipes]
        if args.dry_run:
            for recipe, allocation in zip(recipes, hardware, strict=True):
                emit(compare.render_compare_dry_run(recipe, options) + "\n" + "\n".join(allocation.render()))
            return 0
        for allocation in hardware:
            allocation.check()  # an impossible placement stops here, before any server starts
        envs = resolve_envs(args.vllm_env, train=False)
        with run_lock(Path(args.output_path) if args.tasks else Path(recipes[0].output_root_path)):
            if args.tasks:
                text = compare.run_compare_tasks(recipes, envs, options, Path(args.output_path))
            else:
                text = compare.run_compare(recipes[0], envs, options)
            for recipe in recipes:  # every answer, debate and conversation behind each task's table
                write_conversations_page(Path(recipe.output_root_path))
        emit(text)
        return 0

    return guarded(body)
