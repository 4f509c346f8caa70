"""The only place that runs a plan: the stages of ``optima.plan``'s tables, iteration by iteration.

``run_plan`` runs exactly the plan's stages, in its order (what ``--dry-run`` printed), in the run's
``RunContext``: for each stage it builds a frozen ``StageCall`` from the run, the part and the model the part really
starts from, with the results of the part's earlier stages, which it keeps itself. Every stage records
itself in the iteration's ``manifest.json`` after it succeeds, with its key (the recipe fields it depends on and
the identities of what it reads, chained from stage to stage and iteration to iteration: ``optima.stage_identity``),
so the same command resumes at the first unfinished stage, a finished run is a no-op, and changing (say)
``initial_epsilon`` redoes selection and training but keeps the conversations, then redoes every later iteration,
whose model is the retrained one. A run folder holds one lineage (``optima.lineage``): the run holds its lock, what
a change made stale (a redone stage's outputs, the later parts, iterations past ``iteration_times``) is moved
aside before anything is redone. Servers are stopped before training (and before HF scoring), which need the
cores on a CPU and the memory on a GPU. With ``heldout_size`` the run ends with the held-out evaluation of the
base model and every checkpoint (``optima.stages.heldout``), keyed and resumed by its result files' fingerprints.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

from optima.environments import check_env
from optima.lineage import run_lock, set_aside, set_aside_beyond
from optima.manifest import Manifest, StageKey
from optima.plan import Plan, PlanPart
from optima.reporting import write_run_report
from optima.run_context import RunContext, check_writable, write_iteration_report
from optima.serving.processes import sigterm_as_exit
from optima.stage_identity import link, part_keys
from optima.stages.heldout import run_heldout_stage
from optima.training.hosts import verify_hosts
from optima.training.nodes import ssh_resolver

logger = logging.getLogger(__name__)


class NothingSelected(RuntimeError):
    """No conversation passed selection and the recipe says to stop."""


def handle_empty(ctx: RunContext, label: str, message: str, model: str) -> None:
    """Nothing to train on: stop (default) or carry ``model`` to the next iteration (``on_empty_selection``)."""
    if ctx.recipe.on_empty_selection == "stop":
        ctx.servers.stop_all()
        raise NothingSelected(
            f"{label}{message}. Lower the thresholds, sample more, or set on_empty_selection: carry_forward"
        )
    logger.warning("%s%s; carrying %s forward", label, message, model)


def set_aside_parts(ctx: RunContext, parts: Sequence[PlanPart]) -> None:
    """Move aside what ``parts`` wrote (folder, checkpoint, trainer logs): a part before them is redone, so they are
    of an earlier lineage (every key after a redone stage chains to it)."""
    for part in parts:
        stale = [part.sp.root, part.out, ctx.paths.trainer_logs(part.sp)]
        set_aside(stale, "old-lineage", {"why": "an earlier part of the run is redone under another key"})


def run_part(
    ctx: RunContext,
    part: PlanPart,
    model: str,
    keys: dict[str, StageKey] | None = None,
    later: Sequence[PlanPart] = (),
) -> str | None:
    """Run the stages of one iteration (or iSFT-DPO part) from ``model``; the new checkpoint, or None if none.

    Args:
        ctx: The run.
        part: The part: its stages, folder and checkpoint.
        model: The model it really starts from (the previous part's checkpoint, or the one carried forward).
        keys: The stages' keys (default: the part's keys with no previous part).
        later: The parts whose keys chain to this one's: set aside when a stage of this one is redone.

    Finished stages are skipped (their recorded results reused); an unfinished one continues under the same key; the
    first whose key changed, finished or not, is set aside and redone with every stage after it, and the later parts
    are set aside. When the stage that builds the training set leaves nothing to train on, the part stops there
    (``handle_empty``). Each stage gets its own ``StageCall`` with the results of the stages before it, which this
    function keeps.
    """
    first = part.stage_call(ctx, model)
    manifest = Manifest(part.sp.manifest, keys or part_keys(first, part.stages))
    outputs = {stage.name: [first.output(name) for name in stage.outputs] for stage in part.stages}
    if manifest.invalidate_changed([stage.name for stage in part.stages], outputs, [part.sp.metrics]):
        set_aside_parts(ctx, later)
    label = f"iteration {part.iteration + 1}/{ctx.recipe.iteration_times} | {part.part + ' | ' if part.part else ''}"
    results: dict[str, dict] = {}
    for stage in part.stages:
        call = part.stage_call(ctx, model, results)
        results[stage.name] = manifest.run(stage.name, functools.partial(stage.run, call), label)
        reason = stage.nothing_to_train(ctx.recipe, results[stage.name]) if stage.nothing_to_train else None
        if reason:
            handle_empty(ctx, label, reason, model)
            break
    trained = len(results) == len(part.stages)  # the last stage trains
    write_iteration_report(ctx, part.iteration, part.sp, manifest, part.out if trained else None)
    return str(part.out) if trained else None


def run_plan(ctx: RunContext, plan: Plan) -> str:
    """Run every stage of an iSFT, iDPO or iSFT-DPO plan in the run ``ctx``, in the plan's order; return the final
    model path."""
    recipe = ctx.recipe
    for role, env in ctx.envs.items():
        check_env(env, role)
    ctx.hardware.check()  # an impossible placement stops here, before any server or trainer starts
    training = ctx.hardware.training
    if training is not None and training.multi_node and training.launcher == "ssh":
        verify_hosts([n.host for n in training.nodes], ssh_resolver(training.executable))  # resolvable, reachable
    check_writable(ctx.paths.output_dir)
    with run_lock(ctx.paths.output_dir):  # one run writes a folder at a time
        ctx.prepare()
        set_aside_beyond(ctx.paths, recipe.iteration_times)
        model = run_parts(ctx, plan)
    if recipe.push_to_hub:
        from optima.hub import push_run

        push_run(recipe, ctx.paths, model)
    logger.info("done | final model %s", model)
    return model


def run_parts(ctx: RunContext, plan: Plan) -> str:
    """Run the plan's parts in order, each from the model the one before it trained; return the last model."""
    recipe = ctx.recipe
    model, upstream = recipe.initial_model_path, None
    # SIGTERM unwinds like Ctrl-C (exit code 143): the servers and a running trainer are stopped on the way out.
    with sigterm_as_exit(), ctx.servers:
        for index, part in enumerate(plan.parts):
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
            first = part.stage_call(ctx, model)
            keys = part_keys(first, part.stages, upstream)
            upstream = link(first, part.stages[-1].name, keys[part.stages[-1].name])
            # A part that trained nothing (carry_forward) hands its own starting model on.
            model = run_part(ctx, part, model, keys, chained_after(plan.parts, index)) or model
        if run_heldout_stage(ctx) is not None:
            write_run_report(ctx.paths.output_dir)  # the held-out table is the report's last
    return model


def chained_after(parts: Sequence[PlanPart], index: int) -> list[PlanPart]:
    """The parts after ``parts[index]`` whose keys chain to it: up to the first skipped one, which starts anew."""
    later = []
    for part in parts[index + 1 :]:
        if part.skipped:
            break
        later.append(part)
    return later
