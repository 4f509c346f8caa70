"""The only place that runs serve -> generate -> score -> select -> train (SPEC 1.2-1.4).

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
from optima.stages import sft as sft_stages

logger = logging.getLogger(__name__)


class NothingSelected(RuntimeError):
    """No conversation passed selection and the recipe says to stop."""


# Recipe fields each stage's output depends on (a change redoes that stage and the ones after it).
SFT_STAGE_FIELDS = {
    "generate": (
        "dataset_type",
        "initial_model_path",
        "data_dir",
        "seed",
        "sample_count",
        "explore_count",
        "max_turns",
        "max_tokens",
        "temperature",
        "temperature_iteration0",
        "use_prompt_pool",
        "prompt_pool_path",
        "prefill_answer_iteration0",
        "served_model_name",
    ),
    "score": (
        "lambda1",
        "lambda2",
        "cal_ppl",
        "loss_backend",
        "min_tokens",
        "max_total_tokens",
        "overlong_penalty",
        "impersonation_penalty",
        "compat",
    ),
    "select": ("initial_epsilon", "selection_range", "sft_train_fraction"),
    "train": ("origin_yaml_path", "from_initial", "accelerate_config"),
}


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
        message = sft_stages.describe_empty_selection(recipe, selected)
        if recipe.on_empty_selection == "stop":
            ctx.servers.close()
            raise NothingSelected(
                f"{label}{message}. Lower initial_epsilon, sample more (sample_count, "
                "explore_count), or set on_empty_selection: carry_forward"
            )
        logger.warning("%s%s; carrying %s forward", label, message, model)
    else:
        trained = manifest.run("train", lambda: sft_stages.train(ctx, iteration, model, sp, out), label)
    write_iteration_report(ctx, iteration, sp, manifest, out if trained else None)
    return str(out) if trained else None


def run_plan(plan: Plan) -> str:
    """Run every iteration of an iSFT, iDPO or iSFT-DPO plan; return the final model path."""
    recipe = plan.recipe
    for role, env in plan.envs.items():
        check_env(env, role)
    ctx = RunContext.create(recipe, RunPaths.from_recipe(recipe), plan.envs)
    model = recipe.initial_model_path
    with ctx.servers:
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
    logger.info("done | final model %s", model)
    return model


def run_iteration(ctx: RunContext, method: str, iteration: int, model: str) -> str | None:
    """Dispatch one iteration of ``method`` (the loops of SPEC 1.2-1.4)."""
    if method == "sft":
        return run_sft_iteration(ctx, iteration, model)
    raise NotImplementedError(f"the {method} loop is not implemented yet; use --dry-run to see its plan")
