"""The four stages of an iSFT iteration (docs/method.md#isft): generate, score, select, train.

Each takes its own ``StageCall`` (``optima.plan.PlanPart.stage_call``), does its work, and returns a small JSON-able
result that the manifest records (and metrics.json reports).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import TYPE_CHECKING

from optima.agents.generation import GenerationHooks, generate_conversations, generation_settings
from optima.config.rules import loss_model, train_start
from optima.lm_loss import StreamingLosses, load_known_losses
from optima.methods import SFT
from optima.selection.sft import KEPT, select_questions, split_rows
from optima.stages import common
from optima.stages.common import StageCall
from optima.stages.reward_stage import RewardScorers, reward_generations
from optima.store import load_records, save_splits, write_jsonl

if TYPE_CHECKING:
    from optima.config import SFTLoopRecipe

logger = logging.getLogger(__name__)


def generate(call: StageCall) -> dict:
    """Serve the part's model and sample ``explore_count`` conversations for each of ``sample_count`` questions.

    With a loss server beside the policy, each conversation's LM loss is scored as soon as it is written. Generation
    starts as soon as the policy answers: the loss server (started beside it) is waited for by the first score.
    """
    ctx, sp = call.ctx, call.sp
    examples = common.training_questions(ctx, call.iteration, SFT)
    endpoints = ctx.servers.serve(call.model, sp)
    generation = generation_settings(call.ctx.recipe, call.iteration)
    with contextlib.ExitStack() as stack:
        stream = None
        if call.ctx.recipe.cal_ppl and ctx.servers.loss is not None:
            scorer = common.built_on_first_use(lambda: common.served_loss_scorer(ctx, ctx.servers.loss_urls()))
            stream = stack.enter_context(StreamingLosses(scorer, sp.losses, loss_model(call.ctx.recipe)))
        hooks = GenerationHooks(on_record=stream.submit if stream else None)
        stats = generate_conversations(call.ctx.recipe, examples, endpoints, sp.generations, generation, hooks)
        streamed = {"loss_stream": stream.finish()} if stream else {}
    return {"questions": len(examples)} | stats.to_dict() | streamed


def score(call: StageCall) -> dict:
    """Task score, token term and LM-loss term of every conversation (docs/method.md#reward).

    LM losses scored while generating (``losses.jsonl``) are used as they are; the rest are scored now.
    """
    ctx, sp = call.ctx, call.sp
    tokenize = ctx.tokenizer().tokenize if ctx.recipe.compat == "original" else None
    known = load_known_losses(sp.losses, loss_model(ctx.recipe))
    scorer = common.loss_scorer(ctx, sp)
    with common.math_verifier(ctx) as verifier:
        scorers = RewardScorers(score_texts=scorer, known=known, tokenize=tokenize, verifier=verifier)
        stats = reward_generations(ctx.recipe, sp.generations, sp.rewarded, scorers)
    return stats.to_dict() | common.verifier_stats(verifier)


def select(call: StageCall) -> dict:
    """Keep the best conversations (docs/method.md#isft-selection) and save them as per-agent SFT rows."""
    recipe, sp, iteration = call.ctx.recipe, call.sp, call.iteration
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


def nothing_kept(recipe: SFTLoopRecipe, selected: dict) -> str | None:
    """Why selection left nothing to train on (one sentence), or None when it kept conversations."""
    if selected["kept_conversations"]:
        return None
    return (
        f"no conversation passed selection: {selected['questions']} questions, {selected['conversations']} "
        f"conversations, best reward {selected['best_reward']} (parts {selected['best_reward_parts']}) "
        f"vs epsilon {recipe.initial_epsilon}; decisions {selected['reasons']}"
    )


def train(call: StageCall) -> dict:
    """Fine-tune with TRL under accelerate, from the part's model (or the initial model with ``from_initial``)."""
    return common.train_checkpoint(call, SFT, train_start(call.ctx.recipe, call.model, call.part))
