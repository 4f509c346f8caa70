"""The four stages of an iSFT iteration (SPEC 1.2): generate, score, select, train.

Each takes the run context and the iteration's folder, does its work, and returns a small JSON-able result that
the manifest records (and metrics.json reports).
"""

from __future__ import annotations

import logging
import shutil
from collections import Counter
from pathlib import Path

from optima.agents.generation import generate_conversations, plan_generation
from optima.agents.store import load_records
from optima.paths import StagePaths
from optima.rewarding import reward_generations
from optima.run_context import RunContext
from optima.selection.io import save_splits, write_jsonl
from optima.selection.sft import KEPT, select_questions, split_rows
from optima.tasks import select_questions as slice_questions
from optima.training.common import is_complete, read_completion
from optima.training.launch import (
    launch_for,
    render_trainer_config,
    run_training,
    write_trainer_config,
)

logger = logging.getLogger(__name__)


def training_questions(ctx: RunContext, iteration: int, stage: str, count: int | None = None):
    """This iteration's slice of the training split, derived from (seed, iteration, stage) (SPEC 9.1 item 12).

    Args:
        ctx: The run.
        iteration: The iteration.
        stage: ``sft``, ``probe`` or ``search`` (independent slices).
        count: Questions wanted (default ``sample_count``).
    """
    recipe = ctx.recipe
    examples = ctx.task.load_train(data_dir=recipe.data_dir, seed=recipe.seed)
    return slice_questions(examples, recipe.sample_count if count is None else count, recipe.seed, iteration, stage)


def generate(ctx: RunContext, iteration: int, model: str, sp: StagePaths) -> dict:
    """Serve ``model`` and sample ``explore_count`` conversations for each of ``sample_count`` questions."""
    examples = training_questions(ctx, iteration, "sft")
    endpoints = ctx.servers.endpoints(model, sp)
    stats = generate_conversations(
        ctx.recipe, examples, endpoints, sp.generations, plan_generation(ctx.recipe, iteration)
    )
    return {"questions": len(examples)} | stats.to_dict()


def loss_scorer(ctx: RunContext, sp: StagePaths):
    """The LM-loss function of the recipe's backend, or None without the loss term."""
    recipe = ctx.recipe
    if not recipe.cal_ppl:
        return None
    if recipe.loss_backend == "vllm":
        from optima.lm_loss import VLLMLossScorer

        urls = ctx.servers.endpoints(ctx.loss_model, sp)
        return VLLMLossScorer(
            urls, recipe.served_model_name, ctx.tokenizer(), recipe, 4 * recipe.loss_batch_size
        ).score
    from optima.lm_loss import HFLossScorer

    ctx.servers.close()  # the forward passes need the cores / memory
    return HFLossScorer(ctx.loss_model, ctx.tokenizer(), recipe.loss_batch_size).score


def score(ctx: RunContext, sp: StagePaths) -> dict:
    """Task score, token term and LM-loss term of every conversation (SPEC 3.1)."""
    tokenize = ctx.tokenizer().tokenize if ctx.recipe.compat == "original" else None
    stats = reward_generations(ctx.recipe, sp.generations, sp.rewarded, loss_scorer(ctx, sp), tokenize)
    return stats.to_dict()


def select(ctx: RunContext, iteration: int, sp: StagePaths) -> dict:
    """Keep the best conversations (SPEC 3.4) and save them as per-agent SFT rows."""
    recipe = ctx.recipe
    lines, _ = load_records(sp.rewarded)
    decisions = select_questions(lines, recipe)
    write_jsonl((d.to_record() for d in decisions), sp.selection_record)
    kept = [d.best for d in decisions if d.reason == KEPT]
    rows = save_splits(split_rows(kept, recipe.sft_train_fraction, recipe.seed, iteration), sp.dataset) if kept else {}
    best = [d.best for d in decisions if d.best is not None]
    top = max(best, key=lambda r: r["reward"], default=None)
    return {
        "questions": len(decisions),
        "conversations": sum(len(line["results"]) for line in lines),
        "kept_conversations": len(kept),
        "rows": rows,
        "reasons": dict(Counter(d.reason for d in decisions)),
        "epsilon": recipe.initial_epsilon,
        "best_reward": top["reward"] if top else None,
        "best_reward_parts": top["reward_parts"] if top else None,
    }


def describe_empty_selection(recipe, selected: dict) -> str:
    """One sentence on why nothing was kept."""
    return (
        f"no conversation passed selection: {selected['questions']} questions, {selected['conversations']} "
        f"conversations, best reward {selected['best_reward']} (parts {selected['best_reward_parts']}) "
        f"vs epsilon {recipe.initial_epsilon}; decisions {selected['reasons']}"
    )


def train(ctx: RunContext, iteration: int, model: str, sp: StagePaths, out: Path) -> dict:
    """Fine-tune with TRL under accelerate; the checkpoint is complete once its marker is written."""
    recipe = ctx.recipe
    if is_complete(out):
        return read_completion(out)
    if out.exists():
        shutil.rmtree(out)  # a partial checkpoint of a killed run
    ctx.servers.close()
    start = recipe.initial_model_path if recipe.from_initial else model
    config = render_trainer_config(
        Path(recipe.origin_yaml_path),
        {
            "model_name_or_path": start,
            "dataset_name": str(sp.dataset),
            "output_dir": str(out),
            "seed": recipe.seed + iteration,
        },
    )
    write_trainer_config(config, sp.trainer_yaml)
    launch = launch_for(recipe, "sft", ctx.envs["train"], sp.trainer_yaml, ctx.gpu)
    run_training(launch, sp.train_log)
    return read_completion(out) | {"model": start}
