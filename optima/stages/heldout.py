"""The held-out evaluation at the end of a training run (docs/method.md#held-out-evaluation).

With ``heldout_size`` > 0, after the last iteration the run's policy server takes each model in turn (the base model,
then ``checkpoints/iteration_<k>``; kept replicas load the weights in place, without a restart) and
``optima.evaluation.heldout`` holds one greedy conversation per held-out question with it. Keyed and resumable as
every evaluation file is (``optima.evaluation.runs``): a rerun of a finished run generates nothing, a new
checkpoint or another sample regenerates what it changes. The table goes into ``heldout/summary.*`` and, last, into
the run report.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from optima.evaluation.heldout import run_heldout
from optima.paths import StagePaths
from optima.run_context import RunContext

logger = logging.getLogger(__name__)


def heldout_models(ctx: RunContext) -> list[tuple[str, Path]]:
    """``base`` (the initial model) and every iteration's checkpoint that exists, in order."""
    recipe = ctx.recipe
    models = [("base", Path(recipe.initial_model_path))]
    for iteration in range(recipe.iteration_times):
        checkpoint = ctx.paths.checkpoint(iteration)
        if (checkpoint / "config.json").is_file():
            models.append((checkpoint.name, checkpoint))
    return models


def describe_heldout(ctx: RunContext) -> dict:
    """What ``--dry-run`` shows about the held-out evaluation."""
    recipe = ctx.recipe
    return {
        "questions": f"{recipe.heldout_size} of the {recipe.dataset_type} eval split, none of its training split "
        f"(seed {recipe.heldout_seed})",
        "models": f"base, then checkpoints/iteration_0..{recipe.iteration_times - 1}, greedy, one conversation each",
        "output": ctx.paths.heldout,
    }


def run_heldout_stage(ctx: RunContext) -> str | None:
    """Evaluate the base model and every checkpoint on the held-out sample; the table (None when it is off)."""
    recipe = ctx.recipe
    if not recipe.heldout_size:
        return None
    out_root = ctx.paths.heldout

    def serve_model(name: str, path: Path) -> contextlib.AbstractContextManager:
        # The run's holder keeps the servers (stopped with the run); nothing to stop per model.
        return contextlib.nullcontext(ctx.servers.serve_in_turn(str(path), StagePaths(out_root / name)))

    table = run_heldout(recipe, out_root, heldout_models(ctx), serve_model, ctx.envs)
    logger.info("heldout | done | %s\n%s", out_root, table)
    return table
