"""The only place that runs a plan: the stages of ``optima.plan``'s tables, iteration by iteration.

``run_plan`` runs exactly the plan's stages, in its order (what ``--dry-run`` printed). Every stage records
itself in the iteration's ``manifest.json`` after it succeeds, with its key (the recipe fields it depends on and
the identities of what it reads, chained from stage to stage and iteration to iteration: ``optima.stage_identity``),
so the same command resumes at the first unfinished stage, a finished run is a no-op, and changing (say)
``initial_epsilon`` redoes selection and training but keeps the conversations, then redoes every later iteration,
whose model is the retrained one. Servers are stopped before
training (and before HF scoring), which need the cores on a CPU and the memory on a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from optima.environments import check_env
from optima.manifest import Manifest, StageKey, fields_hash
from optima.plan import Plan, PlanPart, StageDef
from optima.run_context import RunContext, write_iteration_report
from optima.serving.processes import sigterm_as_exit
from optima.stage_identity import link, part_keys
from optima.training.warm import warm_trainer_for

logger = logging.getLogger(__name__)


class NothingSelected(RuntimeError):
    """No conversation passed selection and the recipe says to stop."""


def stage_hashes(recipe, stages: Sequence[StageDef]) -> dict[str, str]:
    """Per stage, the hash of the recipe fields its output depends on (what the manifest compares)."""
    return {stage.name: fields_hash(recipe, stage.fields) for stage in stages}


def handle_empty(ctx: RunContext, label: str, message: str, model: str) -> None:
    """Nothing to train on: stop (default) or carry ``model`` to the next iteration (``on_empty_selection``)."""
    if ctx.recipe.on_empty_selection == "stop":
        ctx.servers.close()
        raise NothingSelected(
            f"{label}{message}. Lower the thresholds, sample more, or set on_empty_selection: carry_forward"
        )
    logger.warning("%s%s; carrying %s forward", label, message, model)


def run_part(
    ctx: RunContext, plan: Plan, part: PlanPart, model: str, keys: dict[str, StageKey] | None = None
) -> str | None:
    """Run the stages of one iteration (or iSFT-DPO part) from ``model``; the new checkpoint, or None if none.

    Finished stages are skipped (their recorded results reused); the first whose key changed (``keys``; default:
    the part's keys with no previous part) is redone with every stage after it. When the stage that builds the
    training set leaves nothing to train on, the part stops there (``handle_empty``).
    """
    recipe = ctx.recipe
    call = plan.call(part, model, ctx)
    manifest = Manifest(part.sp.manifest, keys or part_keys(call, part.stages))
    outputs = {stage.name: [call.output(name) for name in stage.outputs] for stage in part.stages}
    keep = tuple(stage.name for stage in part.stages if stage.set_aside)
    manifest.invalidate_changed([stage.name for stage in part.stages], outputs, keep=keep)
    label = f"iteration {part.iteration + 1}/{recipe.iteration_times} | {part.part + ' | ' if part.part else ''}"
    for stage in part.stages:
        result = manifest.run(stage.name, lambda stage=stage: stage.run(call), label)
        call.results[stage.name] = result
        reason = stage.nothing_to_train(recipe, result) if stage.nothing_to_train else None
        if reason:
            handle_empty(ctx, label, reason, model)
            break
    trained = len(call.results) == len(part.stages)  # the last stage trains
    write_iteration_report(ctx, part.iteration, part.sp, manifest, part.out if trained else None)
    return str(part.out) if trained else None


def run_plan(plan: Plan) -> str:
    """Run every stage of an iSFT, iDPO or iSFT-DPO plan, in the plan's order; return the final model path."""
    recipe = plan.recipe
    for role, env in plan.envs.items():
        check_env(env, role)
    if plan.hardware is not None:
        plan.hardware.check()  # an impossible placement stops here, before any server or trainer starts
    ctx = RunContext.create(recipe, plan.paths, plan.envs, plan.hardware)
    ctx.progress = plan.progress
    training = plan.hardware.training if plan.hardware is not None else None
    ctx.trainer = warm_trainer_for(recipe, plan.envs.get("train"), ctx.gpu, training, ctx.paths.driver_log.parent)
    model, upstream = recipe.initial_model_path, None
    # SIGTERM unwinds like Ctrl-C (exit code 143): the servers and a running trainer are stopped on the way out.
    with sigterm_as_exit(), ctx.servers, ctx.trainer:
        for part in plan.parts:
            if part.skipped:
                model, upstream = str(part.out), None
                logger.info(
                    "iteration %d/%d | skipped (--skip_iteration), using %s",
                    part.iteration + 1,
                    recipe.iteration_times,
                    model,
                )
                continue
            # Each part's keys chain to the previous part's last stage (docs/method.md#resume).
            call = plan.call(part, model, ctx)
            keys = part_keys(call, part.stages, upstream)
            upstream = link(call, part.stages[-1].name, keys[part.stages[-1].name])
            # A part that trained nothing (carry_forward) hands its own starting model on.
            model = run_part(ctx, plan, part, model, keys) or model
    if recipe.push_to_hub:
        from optima.hub import push_run

        push_run(recipe, ctx.paths, model)
    logger.info("done | final model %s", model)
    return model
