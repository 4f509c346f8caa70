"""The four stages of an iSFT iteration (docs/method.md#isft): generate, score, select, train.

Each takes the run context and the iteration's folder, does its work, and returns a small JSON-able result that
the manifest records (and metrics.json reports).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from pathlib import Path

from optima.agents.generation import generate_conversations, plan_generation
from optima.config.rules import loss_model, train_start
from optima.loss_stream import StreamingLosses, load_known_losses
from optima.paths import StagePaths
from optima.run_context import RunContext
from optima.selection.io import save_splits, write_jsonl
from optima.selection.sft import KEPT, select_questions, split_rows
from optima.stages import common
from optima.stages.reward_stage import reward_generations
from optima.store import load_records

logger = logging.getLogger(__name__)


def generate(ctx: RunContext, iteration: int, model: str, sp: StagePaths) -> dict:
    """Serve ``model`` and sample ``explore_count`` conversations for each of ``sample_count`` questions.

    With a loss server beside the policy, each conversation's LM loss is scored as soon as it is written.
    """
    examples = common.training_questions(ctx, iteration, "sft")
    endpoints = ctx.servers.endpoints(model, sp)
    plan = plan_generation(ctx.recipe, iteration)
    with contextlib.ExitStack() as stack:
        stream = None
        if ctx.recipe.cal_ppl and ctx.servers.loss is not None:
            scorer = common.served_loss_scorer(ctx, ctx.servers.loss_endpoints())
            stream = stack.enter_context(StreamingLosses(scorer, sp.losses, loss_model(ctx.recipe)))
        stats = generate_conversations(
            ctx.recipe, examples, endpoints, sp.generations, plan, on_record=stream.submit if stream else None
        )
        streamed = {"loss_stream": stream.finish()} if stream else {}
    return {"questions": len(examples)} | stats.to_dict() | streamed


def score(ctx: RunContext, sp: StagePaths) -> dict:
    """Task score, token term and LM-loss term of every conversation (docs/method.md#reward).

    LM losses scored while generating (``losses.jsonl``) are used as they are; the rest are scored now.
    """
    tokenize = ctx.tokenizer().tokenize if ctx.recipe.compat == "original" else None
    known = load_known_losses(sp.losses, loss_model(ctx.recipe))
    scorer = common.loss_scorer(ctx, sp)
    stats = reward_generations(ctx.recipe, sp.generations, sp.rewarded, scorer, tokenize, known)
    return stats.to_dict()


def select(ctx: RunContext, iteration: int, sp: StagePaths) -> dict:
    """Keep the best conversations (docs/method.md#isft-selection) and save them as per-agent SFT rows."""
    recipe = ctx.recipe
    lines, _ = load_records(sp.rewarded)
    decisions = select_questions(lines, recipe)
    write_jsonl((d.to_record() for d in decisions), sp.selection_record)
    kept = [d.best for d in decisions if d.reason == KEPT]
    rows = (
        save_splits(split_rows(kept, recipe.sft_train_fraction, recipe.seed, iteration, recipe.compat), sp.dataset)
        if kept
        else {}
    )
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
