"""The only place that runs serve -> generate -> score -> select -> train (docs/method.md#the-three-loops).

``run_plan`` follows the stage list of ``optima.plan``. Every stage records itself in the iteration's
``manifest.json`` after it succeeds, with a hash of the recipe fields it depends on, so the same command resumes
at the first unfinished stage, a finished run is a no-op, and changing (say) ``initial_epsilon`` redoes selection
and training but keeps the conversations. Servers are stopped before training (and before HF scoring), which
need the cores on a CPU and the memory on a GPU.
"""

from __future__ import annotations

import logging

from optima.environments import check_env
from optima.manifest import Manifest
from optima.paths import RunPaths
from optima.plan import Plan
from optima.run_context import RunContext, write_iteration_report
from optima.serving.processes import sigterm_as_exit
from optima.stages import dpo as dpo_stages
from optima.stages import sft as sft_stages

logger = logging.getLogger(__name__)


class NothingSelected(RuntimeError):
    """No conversation passed selection and the recipe says to stop."""


# Recipe fields each stage's output depends on (a change redoes that stage and the ones after it).
SAMPLING_FIELDS = ("dataset_type", "data_dir", "seed", "temperature", "max_turns", "max_tokens", "served_model_name")
REWARD_FIELDS = ("lambda1", "lambda2", "cal_ppl", "loss_backend", "loss_model_path", "min_tokens", "max_total_tokens",
                 "overlong_penalty", "compat")  # fmt: skip
TRAIN_FIELDS = ("from_initial", "accelerate_config")
SFT_STAGE_FIELDS = {
    "generate": (*SAMPLING_FIELDS, "initial_model_path", "sample_count", "explore_count", "temperature_iteration0",
                 "use_prompt_pool", "prompt_pool_path", "prefill_answer_iteration0"),
    "score": (*REWARD_FIELDS, "impersonation_penalty"),
    "select": ("initial_epsilon", "selection_range", "sft_train_fraction"),
    "train": (*TRAIN_FIELDS, "origin_yaml_path"),
}  # fmt: skip
DPO_STAGE_FIELDS = {
    "probe": (*SAMPLING_FIELDS, "probe_count", "token_quantile"),
    "search": (*REWARD_FIELDS, "monte_sample_count", "mcts_selections", "mcts_rollouts", "mcts_top_k",
               "diversity_threshold", "merge_threshold"),
    "pairs": ("initial_dpo_min_value", "initial_dpo_epsilon", "dpo_keep_fraction", "dpo_train_fraction"),
    "train": (*TRAIN_FIELDS, "origin_dpo_yaml_path", "rpo_alpha"),
}  # fmt: skip


def handle_empty(ctx: RunContext, label: str, message: str, model: str) -> None:
    """Nothing to train on: stop (default) or carry ``model`` to the next iteration (``on_empty_selection``)."""
    if ctx.recipe.on_empty_selection == "stop":
        ctx.servers.close()
        raise NothingSelected(
            f"{label}{message}. Lower the thresholds, sample more, or set on_empty_selection: carry_forward"
        )
    logger.warning("%s%s; carrying %s forward", label, message, model)


def run_sft_iteration(ctx: RunContext, iteration: int, model: str, stage: str | None = None) -> str | None:
    """One iSFT iteration from ``model``; returns the new checkpoint, or None when nothing was trained."""
    recipe = ctx.recipe
    sp = ctx.paths.stage(iteration, stage)
    manifest = Manifest(sp.manifest, ctx.stage_hashes(SFT_STAGE_FIELDS))
    label = f"iteration {iteration + 1}/{recipe.iteration_times} | "
    out = ctx.paths.checkpoint(iteration, stage)
    outputs = {
        "generate": [sp.generations],
        "score": [sp.rewarded],
        "select": [sp.dataset, sp.selection_record],
        "train": [out],
    }
    manifest.invalidate_changed(list(SFT_STAGE_FIELDS), outputs, refuse=("generate",))
    manifest.run("generate", lambda: sft_stages.generate(ctx, iteration, model, sp), label)
    manifest.run("score", lambda: sft_stages.score(ctx, sp), label)
    selected = manifest.run("select", lambda: sft_stages.select(ctx, iteration, sp), label)
    trained = None
    if selected["kept_conversations"] == 0:
        handle_empty(ctx, label, sft_stages.describe_empty_selection(recipe, selected), model)
    else:
        trained = manifest.run("train", lambda: sft_stages.train(ctx, iteration, model, sp, out, stage), label)
    write_iteration_report(ctx, iteration, sp, manifest, out if trained else None)
    return str(out) if trained else None


def run_dpo_iteration(ctx: RunContext, iteration: int, model: str, stage: str | None = None) -> str | None:
    """One DPO iteration from ``model`` (probe, search, pairs, train); returns the new checkpoint or None.

    In iDPO ``from_initial`` trains the initial model on pairs from ``model``; in iSFT-DPO (``stage="dpo"``) DPO
    always starts from the iteration's SFT checkpoint (docs/method.md#isft-dpo).
    """
    recipe = ctx.recipe
    sp = ctx.paths.stage(iteration, stage)
    manifest = Manifest(sp.manifest, ctx.stage_hashes(DPO_STAGE_FIELDS))
    label = f"iteration {iteration + 1}/{recipe.iteration_times} | {stage + ' | ' if stage else ''}"
    out = ctx.paths.checkpoint(iteration)
    outputs = {
        "probe": [sp.probe],
        "search": [sp.rollouts],
        "pairs": [sp.dataset, sp.selection_record],
        "train": [out],
    }
    manifest.invalidate_changed(list(DPO_STAGE_FIELDS), outputs, refuse=("probe",))
    probed = manifest.run("probe", lambda: dpo_stages.probe(ctx, iteration, model, sp), label)
    manifest.run("search", lambda: dpo_stages.search(ctx, iteration, model, sp, probed["t_max"]), label)
    mined = manifest.run("pairs", lambda: dpo_stages.pairs(ctx, iteration, sp), label)
    trained = None
    if mined["pairs_kept"] == 0:
        handle_empty(ctx, label, f"no preference pair passed the thresholds ({mined})", model)
    else:
        trained = manifest.run("train", lambda: dpo_stages.train(ctx, iteration, model, sp, out, stage), label)
    write_iteration_report(ctx, iteration, sp, manifest, out if trained else None)
    return str(out) if trained else None


def run_sft_dpo_iteration(ctx: RunContext, iteration: int, model: str) -> str | None:
    """A whole iSFT iteration, then a DPO stage on its checkpoint (docs/method.md#isft-dpo)."""
    sft_model = run_sft_iteration(ctx, iteration, model, stage="sft") or model
    return run_dpo_iteration(ctx, iteration, sft_model, stage="dpo") or (sft_model if sft_model != model else None)


def run_plan(plan: Plan) -> str:
    """Run every iteration of an iSFT, iDPO or iSFT-DPO plan; return the final model path."""
    recipe = plan.recipe
    for role, env in plan.envs.items():
        check_env(env, role)
    ctx = RunContext.create(recipe, RunPaths.from_recipe(recipe), plan.envs)
    model = recipe.initial_model_path
    # SIGTERM unwinds like Ctrl-C (exit code 143): the servers and a running trainer are stopped on the way out.
    with sigterm_as_exit(), ctx.servers:
        for iteration in range(recipe.iteration_times):
            if iteration < plan.skip_iteration:
                model = str(ctx.paths.checkpoint(iteration))
                logger.info(
                    "iteration %d/%d | skipped (--skip_iteration), using %s",
                    iteration + 1,
                    recipe.iteration_times,
                    model,
                )
                continue
            model = run_iteration(ctx, plan.method, iteration, model) or model
    if recipe.push_to_hub:
        from optima.hub import push_run

        push_run(recipe, ctx.paths, model)
    logger.info("done | final model %s", model)
    return model


def run_iteration(ctx: RunContext, method: str, iteration: int, model: str) -> str | None:
    """Dispatch one iteration of ``method`` (the loops of docs/method.md#the-three-loops)."""
    loops = {"sft": run_sft_iteration, "dpo": run_dpo_iteration, "sft_dpo": run_sft_dpo_iteration}
    return loops[method](ctx, iteration, model)
