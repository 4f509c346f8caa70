"""The four stages of an iSFT iteration (docs/method.md#isft): generate, score, select, train.

Each takes the run context and the iteration's folder, does its work, and returns a small JSON-able result that
the manifest records (and metrics.json reports).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from optima.agents.generation import generate_conversations, plan_generation
from optima.config.rules import train_start
from optima.paths import StagePaths
from optima.run_context import RunContext
from optima.selection.io import save_splits, write_jsonl
from optima.selection.sft import KEPT, select_questions, split_rows
from optima.stages import common
from optima.stages.reward_stage import reward_generations
from optima.store import load_records

logger = logging.getLogger(__name__)


def generate(ctx: RunContext, iteration: int, model: str, sp: StagePaths) -> dict:
    """Serve ``model`` and sample ``explore_count`` conversations for each of ``sample_count`` questions."""
    examples = common.training_questions(ctx, iteration, "sft")
    endpoints = ctx.servers.endpoints(model, sp)
    stats = generate_conversations(
        ctx.recipe, examples, endpoints, sp.generations, plan_generation(ctx.recipe, iteration)
    )
    return {"questions": len(examples)} | stats.to_dict()


def score(ctx: RunContext, sp: StagePaths) -> dict:
    """Task score, token term and LM-loss term of every conversation (docs/method.md#reward)."""
    tokenize = ctx.tokenizer().tokenize if ctx.recipe.compat == "original" else None
    stats = reward_generations(ctx.recipe, sp.generations, sp.rewarded, common.loss_scorer(ctx, sp), tokenize)
    return stats.to_dict()


def select(ctx: RunContext, iteration: int, sp: StagePaths) -> dict:
    """Keep the best conversations (docs/method.md#isft-selection) and save them as per-agent SFT rows."""
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


def train(ctx: RunContext, iteration: int, model: str, sp: StagePaths, out: Path, stage: str | None = None) -> dict:
    """Fine-tune with TRL under accelerate, from ``model`` (or the initial model with ``from_initial``)."""
    return common.train_checkpoint(ctx, "sft", iteration, train_start(ctx.recipe, model, stage), sp, out)
