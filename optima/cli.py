"""Command-line plumbing shared by the five top-level scripts.

The scripts take the flags of the released Optima commands (``--train_config_path``, ``--vllm_env``,
``--alignment_env``, ``--skip_iteration``, ``--model_root_path``, ``--dataset_type``, ...), so those commands work
unchanged, and add ``--set key=value`` (recipe overrides, YAML-typed) and ``--dry-run`` (validate and print
the plan; start nothing). Errors in the recipe or the environments end the script with exit code 2 and one
message naming the file, the field and the value.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optima.config import RecipeError, load_recipe
from optima.config.devices import SC_DEVICE_SPAN, SWEEP_DEVICE_SPAN, expand_device_flag
from optima.environments import EnvError, PythonEnv, resolve_env
from optima.logging_utils import setup_logging

if TYPE_CHECKING:
    from optima.config.types import InferenceRecipe

logger = logging.getLogger(__name__)

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


def resolve_envs(vllm_env: str | None, alignment_env: str | None = None, train: bool = True) -> dict[str, PythonEnv]:
    """Both environments (or only vLLM's); single-env mode is both flags naming the same env."""
    envs = {"vllm": resolve_env(vllm_env, "vllm")}
    if train:
        envs["train"] = resolve_env(alignment_env, "train")
    return envs


def expected_failures() -> tuple[type[BaseException], ...]:
    """Failures that end a run with one clear message instead of a traceback (each names what to look at)."""
    from optima.pipeline import NothingSelected
    from optima.serving import NoReplicaLeft, ServerStartupError
    from optima.tasks import DataError
    from optima.training.launch import TrainingError

    return (NothingSelected, ServerStartupError, NoReplicaLeft, DataError, TrainingError)


def guarded(body: Callable[[], int]) -> int:
    """Run a script body; bad input ends with one clear message and exit code 2, a failed stage with 1."""
    try:
        return body()
    except (RecipeError, EnvError) as exc:
        logger.error("%s", exc)
        return EXIT_BAD_INPUT
    except expected_failures() as exc:
        logger.error("%s: %s", type(exc).__name__, exc)
        return EXIT_FAILED


def emit(text: str) -> None:
    """Write a plan or table to stdout (the library never prints through ``print``)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def run_loop_script(recipe_cls: type, description: str, argv: list[str] | None) -> int:
    """Body of the three training scripts: parse, load, plan or run."""
    args = build_loop_parser(description).parse_args(argv)
    setup_logging()

    def body() -> int:
        if args.skipping:
            logger.warning(
                "--skipping %d ignored: question slices derive from (seed, iteration, stage)", args.skipping
            )
        overrides = args.set + trainer_set_overrides(args.trainer_set)
        recipe = load_recipe(recipe_cls, args.train_config_path, overrides, check_paths=not args.dry_run)
        envs = resolve_envs(args.vllm_env, args.alignment_env)
        from optima.hardware.spec import resolve_hardware
        from optima.plan import build_plan

        plan = build_plan(recipe, envs, skip_iteration=args.skip_iteration, hardware=resolve_hardware(args.hardware))
        plan.ctx.progress = not args.quiet
        if args.dry_run:
            emit(plan.render())
            return 0
        from optima.pipeline import run_plan

        run_plan(plan)
        return 0

    return guarded(body)


def overrides_from_flags(args: argparse.Namespace, mapping: dict[str, str]) -> dict[str, Any]:
    """Recipe values from explicit flags (``None`` means not given)."""
    return {key: getattr(args, flag, None) for flag, key in mapping.items() if getattr(args, flag, None) is not None}


# Original evaluation flags -> InferenceRecipe / MultiSCRecipe keys.
EVAL_FLAGS = {
    "dataset_type": "dataset_type",
    "tokenizer_path": "tokenizer_first_path",
    "device": "devices",
    "port": "port",
    "num_thread": "thread_count",
    "limit": "limit",
    "seed": "seed",
    "data_dir": "data_dir",
    "base_model_path": "initial_model_path",
}


def add_eval_args(parser: argparse.ArgumentParser, device_span: int) -> None:
    """Flags shared by the two evaluation scripts and ``python -m optima compare``.

    ``device_span``: GPUs that ``--device d`` names from d on (4 for the sweep, 8 for self-consistency:
    docs/method.md, D1).
    """
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
    parser.add_argument("--limit", type=int, help="evaluate only the first N questions")
    parser.add_argument("--seed", type=int, help="seed of contexts and sampling (default 42)")
    parser.add_argument("--data_dir", help="local dataset root (default $OPTIMA_DATA_DIR, else the hub)")
    add_env_args(parser, train=False)
    add_control_args(parser)


def add_debate_args(parser: argparse.ArgumentParser) -> None:
    """The shape of the MAD baseline (the paper's: 3 agents, 2 rounds, after Du et al.)."""
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
    add_debate_args(parser)
    parser.add_argument("--base_model_path", help="the base model (evaluated as 'base' with --include_base)")
    add_eval_args(parser, SC_DEVICE_SPAN if multi_sc else SWEEP_DEVICE_SPAN)
    return parser


def eval_recipe_from_args(recipe_cls: type, args: argparse.Namespace, flags: dict[str, str], defaults=None):
    """The evaluation recipe from ``defaults``, the flags (``flags``: flag -> recipe key), ``--config``, ``--set``."""
    values = dict(defaults or {}) | overrides_from_flags(args, EVAL_FLAGS | flags)
    if "devices" in values:  # --device d: four (sweep) or eight (self-consistency) GPUs from d (D1)
        span = SC_DEVICE_SPAN if recipe_cls.method == "multi_sc" else SWEEP_DEVICE_SPAN
        values["devices"] = expand_device_flag(values["devices"], span)
    if "tokenizer_first_path" in values:
        values["tokenizer_second_path"] = values["tokenizer_first_path"]
    from optima.config.fields import parse_override

    values |= dict(parse_override(item) for item in args.set)
    return load_recipe(recipe_cls, args.config, values, check_paths=not args.dry_run)


def baseline_settings(args: argparse.Namespace, samples: int = 8, temperature: float = 0.5):
    """Sampling and debate settings of the baselines from the flags."""
    from optima.evaluation.debate import DebateSettings
    from optima.evaluation.methods import BaselineSettings

    debate = DebateSettings(args.mad_agents, args.mad_rounds, args.mad_context)
    return BaselineSettings(samples, temperature, debate)


def eval_hardware_plan(recipe: InferenceRecipe, given: str | None):
    """The hardware plan of an evaluation run (its servers only) on ``--hardware`` or the detected machine."""
    import os

    from optima.hardware.plan import plan_hardware
    from optima.hardware.spec import resolve_hardware

    return plan_hardware(recipe, resolve_hardware(given), sorted(os.sched_getaffinity(0)))


def run_eval_script(recipe_cls: type, description: str, argv: list[str] | None) -> int:
    """Body of the two evaluation scripts: flags -> recipe -> plan or run."""
    multi_sc = recipe_cls.method == "multi_sc"
    args = build_eval_parser(description, multi_sc).parse_args(argv)
    setup_logging()

    def body() -> int:
        if multi_sc:
            flags = {
                "model_path": "model_root_path",
                "output_path": "output_root_path",
                "temperature": "sc_temperature",
                "num_samples": "num_samples",
            }
        else:
            flags = {
                "model_root_path": "model_root_path",
                "output_root_path": "output_root_path",
                "include_base": "include_base",
            }
        recipe = eval_recipe_from_args(recipe_cls, args, flags)
        envs = resolve_envs(args.vllm_env, train=False)
        baselines = tuple(dict.fromkeys(args.baseline or ()))
        if multi_sc:
            settings = baseline_settings(args, recipe.num_samples, recipe.sc_temperature)
        else:
            settings = baseline_settings(args)
        hardware = eval_hardware_plan(recipe, args.hardware)
        if args.dry_run:
            from optima.evaluation.plan import render_eval_plan

            shown = ", ".join("cot, cot-SC" if b == "cot" and multi_sc else b for b in baselines)
            text = render_eval_plan(recipe, envs) + (f"\n  baseline: {shown}" if baselines else "")
            emit(text + "\n" + "\n".join(hardware.render()))
            return 0
        hardware.check()
        if multi_sc:
            from optima.evaluation.self_consistency import SCOptions, run_self_consistency

            emit(run_self_consistency(recipe, envs, SCOptions(baselines, args.max_k, settings.debate)))
        else:
            from optima.evaluation.sweep import run_sweep

            emit(run_sweep(recipe, envs, baselines, settings))
        return 0

    return guarded(body)


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
    """Body of ``python -m optima compare``: flags -> recipe and options -> plan or run."""
    args = build_compare_parser().parse_args(argv)
    setup_logging()

    def body() -> int:
        from optima.evaluation.compare import CompareOptions, parse_optima_rows, render_compare_plan

        tasks = compare_tasks(args)
        recipes = [compare_recipe(args, task, len(tasks) > 1 or bool(args.tasks)) for task in tasks]
        settings = baseline_settings(args, recipes[0].num_samples, recipes[0].sc_temperature)
        methods = tuple(dict.fromkeys(m for m in args.methods if m != "none"))
        options = CompareOptions(methods, parse_optima_rows(args.optima), settings, args.optima_sc)
        hardware = [eval_hardware_plan(recipe, args.hardware) for recipe in recipes]
        if args.dry_run:
            for recipe, plan in zip(recipes, hardware, strict=True):
                emit(render_compare_plan(recipe, options) + "\n" + "\n".join(plan.render()))
            return 0
        for plan in hardware:
            plan.check()  # an impossible placement stops here, before any server starts
        envs = resolve_envs(args.vllm_env, train=False)
        if args.tasks:
            from optima.evaluation.compare import run_compare_tasks

            emit(run_compare_tasks(recipes, envs, options, Path(args.output_path)))
        else:
            from optima.evaluation.compare import run_compare

            emit(run_compare(recipes[0], envs, options))
        return 0

    return guarded(body)


def compare_tasks(args: argparse.Namespace) -> list[str | None]:
    """The tasks of ``compare``: ``--tasks a,b`` or ``--dataset_type`` (None: the ``--config`` recipe's)."""
    from optima.config.fields import resolve_path

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


def run_report_command(run_dir) -> int:
    """``python -m optima report RUN_DIR``: redraw the run's ``report.md``/``report.png`` and print the Markdown."""
    from optima.reporting import write_run_report

    def body() -> int:
        try:
            markdown, _ = write_run_report(run_dir)
        except (FileNotFoundError, ValueError) as exc:
            raise RecipeError("run_dir", str(exc)) from exc
        emit(markdown.read_text())
        return 0

    return guarded(body)


def run_show_command(folder, max_questions: int | None = None) -> int:
    """``python -m optima show DIR``: write ``DIR/conversations.html`` and print its path."""
    from optima.browser import MAX_QUESTIONS, write_conversations_page

    def body() -> int:
        try:
            page = write_conversations_page(folder, MAX_QUESTIONS if max_questions is None else max_questions)
        except (FileNotFoundError, ValueError) as exc:
            raise RecipeError("run_dir", str(exc)) from exc
        emit(str(page))
        return 0

    return guarded(body)
