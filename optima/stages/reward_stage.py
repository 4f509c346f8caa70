"""The score stage: generated conversations -> rewarded questions (docs/method.md#reward).

Reads ``generations.jsonl`` (one line per conversation), groups it by question, and for each question computes
every conversation's task score, per-utterance LM losses (under the initial model, through an injected
``score_texts`` callable: ``optima.lm_loss``) and reward parts (``optima.reward``). Writes ``rewarded.jsonl``,
one line per question ``{"task_id", "t_max", "results": [record + "losses" + "reward_parts" + "reward"]}``,
appended in chunks, so a killed stage resumes at the first question not yet written.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from optima.agents.prompts import Utterance
from optima.lm_loss import conversation_texts, needs_losses, to_json_losses
from optima.reward import (
    Conversation,
    flexible_answer,
    is_cut,
    placeholder_copies,
    question_t_max,
    score_conversation,
    scored_answer,
)
from optima.store import JsonlWriter, group_by_question, load_records, prepare_resume
from optima.tasks import Example
from optima.tasks.scoring import reparsed, score_example

if TYPE_CHECKING:
    from optima.config import LoopRecipe

logger = logging.getLogger(__name__)

ScoreTexts = Callable[[Sequence[str]], list[float]]
KnownLosses = Callable[[dict], list[float] | None]
QUESTIONS_PER_CHUNK = 32


@dataclass(frozen=True)
class RewardScorers:
    """What scores a conversation beside the recipe's reward fields (each optional).

    Args:
        score_texts: Mean LM loss of each text (``None`` when ``cal_ppl`` is off).
        known: ``losses_of(record)``: losses scored while generating (``optima.lm_loss``), None if missing;
            ``score_texts`` is called only for the rest.
        tokenize: The initial tokenizer's ``tokenize`` (subword F1 under ``compat: original``).
        verifier: One ``MathVerifier`` for the whole stage (MATH answers); without it each answer that needs the
            symbolic check starts its own worker.
    """

    score_texts: ScoreTexts | None = None
    known: KnownLosses | None = None
    tokenize: Callable[[str], list[str]] | None = None
    verifier: object | None = None


@dataclass
class RewardStats:
    """What the score stage saw (goes into metrics.json)."""

    questions: int = 0
    conversations: int = 0
    answered: int = 0
    flexible_answered: int = 0
    task_score_sum: float = 0.0
    flexible_score_sum: float = 0.0
    token_sum: int = 0
    cut: int = 0  # conversations cut for length
    placeholder_copies: int = 0  # conversations that copy a prompt's placeholder as an answer
    best_rewards: list[float] = field(default_factory=list)
    parts_sum: Counter = field(default_factory=Counter)
    verifier: object | None = None  # the stage's MathVerifier (flexible MATH answers)

    def add(self, line: dict) -> None:
        results = line["results"]
        for r in results:
            self.parts_sum.update(r["reward_parts"])
        self.questions += 1
        self.conversations += len(results)
        self.answered += sum(scored_answer(r.get("final_answer"), r.get("status", "ok")) is not None for r in results)
        self.task_score_sum += sum(r["reward_parts"]["task_score"] for r in results)
        for r in results:
            self.add_flexible(r)
        self.token_sum += sum(r["token_count"] for r in results)
        self.cut += sum(is_cut(r) for r in results)
        self.placeholder_copies += sum(placeholder_copies(r) > 0 for r in results)
        self.best_rewards.append(max(r["reward"] for r in results))

    def add_flexible(self, result: dict) -> None:
        """Count a rewarded conversation's flexible answer: its strict one scores as the reward scored it."""
        if scored_answer(result.get("final_answer"), result.get("status", "ok")) is not None:
            self.flexible_answered += 1
            self.flexible_score_sum += result["reward_parts"]["task_score"]
            return
        answer = flexible_answer(result)
        if answer is not None:
            self.flexible_answered += 1
            example = Example.from_dict(result["example"])
            self.flexible_score_sum += score_example(example, answer, verifier=self.verifier)

    def to_dict(self) -> dict:
        n = max(self.conversations, 1)
        best = sorted(self.best_rewards)
        return {
            "questions": self.questions,
            "conversations": self.conversations,
            "answer_rate": round(self.answered / n, 4),
            "accuracy": round(self.task_score_sum / n, 4),
            # The answer named in words when not in the format (optima.tasks.scoring): reported, never rewarded.
            "flexible_answer_rate": round(self.flexible_answered / n, 4),
            "flexible_accuracy": round(self.flexible_score_sum / n, 4),
            "mean_tokens": round(self.token_sum / n, 2),
            "cut_rate": round(self.cut / n, 4),
            "placeholder_copies": self.placeholder_copies,
            "best_reward_max": round(best[-1], 4) if best else None,
            "best_reward_median": round(best[len(best) // 2], 4) if best else None,
            "mean_reward_parts": mean_parts(self.parts_sum, self.conversations),
        }


def mean_parts(parts_sum: Counter, count: int) -> dict[str, float] | None:
    """Per-conversation means of summed reward parts (None when nothing was scored)."""
    return {name: round(total / count, 4) for name, total in parts_sum.items()} if count else None


def _utterances(record: dict) -> list[Utterance]:
    return [Utterance(u["speaker"], u["text"]) for u in record["utterances"]]


def reward_question(
    records: Sequence[dict], losses: Sequence[Sequence[float] | None], recipe: LoopRecipe, tokenize=None, verifier=None
) -> dict:
    """The rewarded line of one question (``verifier``: the stage's shared ``MathVerifier`` for MATH answers)."""
    conversations = []
    records = [reparsed(record) for record in records]  # rows parsed by an older parser: their stored text again
    for record, record_losses in zip(records, losses, strict=True):
        example = Example.from_dict(record["example"])
        answer = scored_answer(record.get("final_answer"), record["status"], recipe.compat)
        task_score = score_example(example, answer, recipe.compat, tokenize, verifier=verifier)
        conversations.append(
            Conversation(_utterances(record), record["token_count"], task_score, record["status"], record_losses)
        )
    t_max = question_t_max(conversations)
    parts = [score_conversation(c, t_max, recipe) for c in conversations]
    results = [
        record
        | {"losses": to_json_losses(loss) if loss is not None else None, "reward_parts": p.to_dict()}
        | {"reward": p.reward}
        for record, loss, p in zip(records, losses, parts, strict=True)
    ]
    return {"task_id": records[0]["task_id"], "t_max": t_max, "results": results}


def _losses_for(chunk: Sequence[Sequence[dict]], score_texts: ScoreTexts | None, known: KnownLosses | None) -> list:
    """LM losses of every utterance of every conversation in ``chunk``: stored ones, the rest in one batched call."""
    if score_texts is None:
        return [[None] * len(group) for group in chunk]
    records = [record for group in chunk for record in group]
    losses = [known(record) if known else None for record in records]
    # Only finished conversations' losses are read by the reward (a cut or failed one gets the loss penalty).
    missing = [i for i, record in enumerate(records) if losses[i] is None and needs_losses(record)]
    texts = [text for i in missing for text in conversation_texts(records[i])]
    flat = iter(score_texts(texts) if texts else [])
    for i in missing:
        losses[i] = [next(flat) for _ in records[i]["utterances"]]
    ordered = iter(losses)
    return [[next(ordered) for _ in group] for group in chunk]


def reward_generations(
    recipe: LoopRecipe, generations: Path, out_path: Path, scorers: RewardScorers = RewardScorers()
) -> RewardStats:
    """Reward every question of ``generations`` into ``out_path``, resuming what is there.

    Args:
        recipe: Reward fields (lambdas, cal_ppl, overrides) and ``compat``.
        generations: ``generations.jsonl`` of the stage.
        out_path: ``rewarded.jsonl``.
        scorers: LM losses (to score, or scored while generating) and the answer checks.
    """
    from tqdm.auto import tqdm

    records, _ = load_records(generations)
    groups = group_by_question(records)
    # One line per question (no sample_index): the question's id is the resume key.
    done = prepare_resume(out_path, retry_errors=False, key=lambda line: str(line["task_id"]))
    stats = RewardStats(verifier=scorers.verifier)
    for line in load_records(out_path)[0]:
        stats.add(line)
    todo = [g for g in groups if str(g[0]["task_id"]) not in done]
    logger.info(
        "score | %d questions (%d already rewarded) | LM loss %s",
        len(groups),
        len(done),
        "on" if scorers.score_texts else "off",
    )
    with JsonlWriter(out_path) as writer, tqdm(total=len(todo), unit="question", desc="score") as bar:
        for start in range(0, len(todo), QUESTIONS_PER_CHUNK):
            chunk = todo[start : start + QUESTIONS_PER_CHUNK]
            for group, losses in zip(chunk, _losses_for(chunk, scorers.score_texts, scorers.known), strict=True):
                line = reward_question(group, losses, recipe, scorers.tokenize, scorers.verifier)
                writer.write(line)
                stats.add(line)
                bar.update()
    return stats
