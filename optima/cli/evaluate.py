"""The two evaluation scripts (``inference_script.py``: the checkpoint sweep; ``multi_sc_data_generate_script.py``:
self-consistency) and the evaluation flags ``python -m optima compare`` shares with them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from optima.cli.common import add_control_args, add_env_args, emit, guarded, overrides_from_flags, resolve_envs
from optima.config import SC_DEVICE_SPAN, SWEEP_DEVICE_SPAN, expand_device_flag, load_recipe
from optima.lineage import run_lock
from optima.logging_utils import setup_logging

if TYPE_CHECKING:
    from optima.config import InferenceRecipe

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
    from optima.config import parse_override

    values |= dict(parse_override(item) for item in args.set)
    return load_recipe(recipe_cls, args.config, values, check_paths=not args.dry_run)


def baseline_settings(args: argparse.Namespace, samples: int = 8, temperature: float = 0.5):
    """Sampling and debate settings of the baselines from the flags."""
    from optima.evaluation.debate import DebateSettings
    from optima.evaluation.methods import BaselineSettings

    debate = DebateSettings(args.mad_agents, args.mad_rounds, args.mad_context)
    return BaselineSettings(samples, temperature, debate)


def resolve_machine(given: str | None):
    """The machine of ``--hardware``, else the detected one (detected once per command, for all its tasks)."""
    from optima.hardware.machine import resolve_hardware

    return resolve_hardware(given)


def allocate_evaluation(recipe: InferenceRecipe, machine):
    """The hardware allocation of an evaluation run (its servers only) on ``machine`` (``resolve_machine``)."""
    from optima.hardware.allocation import allocate_this_machine

    return allocate_this_machine(recipe, machine)


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
        hardware = allocate_evaluation(recipe, resolve_machine(args.hardware))
        if args.dry_run:
            from optima.evaluation.dry_run import render_dry_run

            shown = ", ".join("cot, cot-SC" if b == "cot" and multi_sc else b for b in baselines)
            text = render_dry_run(recipe, envs) + (f"\n  baseline: {shown}" if baselines else "")
            emit(text + "\n" + "\n".join(hardware.render()))
            return 0
        hardware.check()
        with run_lock(Path(recipe.output_root_path)):  # one evaluation writes a folder at a time
            if multi_sc:
                from optima.evaluation.self_consistency import SCOptions, run_self_consistency

                emit(run_self_consistency(recipe, envs, SCOptions(baselines, args.max_k, settings.debate)))
            else:
                from optima.browser import write_conversations_page
                from optima.evaluation.sweep import run_sweep

                table = run_sweep(recipe, envs, baselines, settings)
                write_conversations_page(Path(recipe.output_root_path))  # every conversation of every model and method
                emit(table)
        return 0

    return guarded(body)
