"""The Optima reward, pure functions (docs/method.md#reward):

    R = task score + lambda1 * tokens / T_max + lambda2 / max_i L_i

`lambda1` (< 0) weighs the tokens against `T_max`, the most tokens among the question's finished conversations (the
tree search: a quantile of a probe's); `lambda2` divides the largest per-utterance LM loss under the fixed initial
model, so a conversation earns more when it is right, short, and every utterance stays readable. The overrides
(`overlong_penalty` for a cut, failed, too short or too long conversation, 0 for a repeated utterance,
`impersonation_penalty` for speaking for the partner) and the tree search's format rule are below.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from optima.agents.prompts import AGENT_NAMES, Utterance, is_impersonation, render_utterance
from optima.tasks import Example, get_task
from optima.tasks.scoring import flexible_answer as flexible_reply_answer
from optima.tasks.scoring import score_example

if TYPE_CHECKING:
    from optima.config import LoopRecipe

OK = "ok"
ScoreTexts = Callable[[Sequence[str]], list[float]]


@dataclass(frozen=True)
class RewardParts:
    """One conversation's reward and its parts."""

    task_score: float
    token_term: float
    loss_term: float
    penalty: float

    @property
    def reward(self) -> float:
        return self.task_score + self.token_term + self.loss_term + self.penalty

    def to_dict(self) -> dict[str, float]:
        return asdict(self) | {"reward": self.reward}


@dataclass(frozen=True)
class Conversation:
    """What the reward needs to know about one conversation: its utterances, every token it generated, its
    task score, generation's status, and each utterance's mean NLL under the loss model (None without the term)."""

    utterances: Sequence[Utterance]
    token_count: int
    task_score: float
    status: str = OK
    losses: Sequence[float] | None = None


def scored_answer(final_answer: str | None, status: str, compat: str = "default") -> str | None:
    """The answer a conversation is scored on: its last stated answer when it finished (`ok`), else none; one rule
    for the reward, the tree search and evaluation (docs/method.md#cut-replies). `compat: original` scores the last
    stated answer whatever the status (docs/method.md D32)."""
    if status != OK and compat != "original":
        return None
    return final_answer or None


def has_answer(record: dict) -> bool:
    """Whether a conversation record (generated, rewarded or a rollout) finished with an answer."""
    return scored_answer(record.get("final_answer"), record.get("status", "")) is not None


def flexible_answer(record: dict) -> str | None:
    """The answer a conversation record names: its strict answer, else the flexible answer of its replies
    (docs/method.md#metrics); None for a cut or failed conversation."""
    strict = scored_answer(record.get("final_answer"), record.get("status", ""))
    if strict is not None or record.get("status") != OK:
        return strict
    example = record["example"]
    options = tuple((str(label), str(text)) for label, text in example.get("options", ()))
    texts = [utterance["text"] for utterance in record.get("utterances", ())]
    return flexible_reply_answer(texts, example["score_type"], options)


def placeholder_copies(record: dict) -> int:
    """The utterances of a conversation record whose answer copies a prompt's placeholder: no answer, but training
    on it would teach the copy, so selection never keeps such a conversation."""
    utterances = record.get("utterances") or ()
    if not utterances:
        return 0
    task = get_task(record.get("task") or record["example"]["task"])
    return sum(task.copies_placeholder(u["text"]) for u in utterances)


def is_cut(record: dict) -> bool:
    """Whether a conversation record holds a reply cut at `max_tokens` (older records: a `too_long` status)."""
    return record.get("cut_replies", int(record.get("status") == "too_long")) > 0


def counted_tokens(conversations: Iterable[Conversation | dict]) -> list[int]:
    """The token counts `T_max` is taken from: conversations (or records) that finished with at least one token."""
    pairs = (
        (c["status"], c["token_count"]) if isinstance(c, dict) else (c.status, c.token_count) for c in conversations
    )
    return [count for status, count in pairs if status == OK and count > 0]


def question_t_max(conversations: Sequence[Conversation]) -> int | None:
    """`T_max` of one question: the most tokens among its finished conversations."""
    counts = counted_tokens(conversations)
    return max(counts) if counts else None


def interpolated_quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` by linear interpolation between the nearest ranks (numpy's default)."""
    if not values:
        raise ValueError("interpolated_quantile needs at least one value")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q!r}")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def token_quantile(token_counts: Sequence[int], q: float) -> int:
    """The tree search's `T_max`: `int(quantile_q(token_counts)) + 1` (recipe `token_quantile`: 0.85 for iDPO,
    0.8 for iSFT-DPO)."""
    if not token_counts:
        raise ValueError("token_quantile needs at least one token count (the probe produced no conversation)")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q!r}")
    return int(interpolated_quantile(token_counts, q)) + 1


def search_t_max(probe: Iterable[Conversation | dict], q: float) -> int:
    """`T_max` of the tree search: `token_quantile` of the probe's counted tokens."""
    return token_quantile(counted_tokens(probe), q)


def token_term(conversation: Conversation, t_max: float | None, recipe: LoopRecipe) -> float:
    """`lambda1 * tokens / T_max`; `overlong_penalty` when cut or failed, or at most `min_tokens` tokens."""
    if conversation.status != OK or t_max is None or conversation.token_count <= recipe.min_tokens:
        return recipe.overlong_penalty
    return recipe.lambda1 * conversation.token_count / t_max


def _normalised(text: str) -> str:
    return " ".join(text.lower().split())


def has_repeat(utterances: Sequence[Utterance]) -> bool:
    """Whether an utterance repeats an earlier one (whitespace and case aside; not a character-set strip, D15)."""
    seen: set[str] = set()
    for utterance in utterances:
        key = _normalised(utterance.text)
        if key in seen:
            return True
        seen.add(key)
    return False


def reads_losses(status: str | None) -> bool:
    """Whether `loss_term` reads a conversation's LM losses: only a finished one's (a cut or failed one gets
    `overlong_penalty`)."""
    return status == OK


def finite_losses(losses: Iterable[float | None]) -> list[float]:
    """The LM losses that count, NaN and None (nothing scored in the utterance) skipped: the one rule wherever
    losses are aggregated, so no result depends on where a NaN sits (`max([nan, 2.0])` is nan)."""
    return [float(x) for x in losses if x is not None and not math.isnan(x)]


def loss_term(conversation: Conversation, recipe: LoopRecipe) -> float:
    """`lambda2 / max_i L_i`: `overlong_penalty` past `max_total_tokens`, without utterances or finite losses, or
    when cut or failed; 0 with a repeated utterance, or when `cal_ppl` is off."""
    if not recipe.cal_ppl:
        return 0.0
    if conversation.token_count > recipe.max_total_tokens or not conversation.utterances:
        return recipe.overlong_penalty
    if not reads_losses(conversation.status):
        return recipe.overlong_penalty
    if has_repeat(conversation.utterances):
        return 0.0
    if conversation.losses is None or len(conversation.losses) != len(conversation.utterances):
        raise ValueError("loss term needs one LM loss per utterance")
    scored = finite_losses(conversation.losses)
    if not scored:
        return recipe.overlong_penalty  # no utterance could be scored: as for no utterance
    worst = max(scored)
    # A loss of exactly 0 cannot come from a real model; guard the division all the same.
    return recipe.lambda2 / max(worst, 1e-6)


def impersonation_penalty(utterances: Sequence[Utterance], penalty: float) -> float:
    """`penalty` per utterance that speaks for its partner, up to the first that names both agents."""
    total = 0.0
    for utterance in utterances:
        if is_impersonation(utterance):
            total += penalty
            text = f"{utterance.speaker}: {utterance.text}"
            if all(f"{name}:" in text for name in AGENT_NAMES):
                break
    return total


def score_conversation(conversation: Conversation, t_max: float | None, recipe: LoopRecipe) -> RewardParts:
    """The reward of one conversation, under the question's `T_max` (`question_t_max`)."""
    return RewardParts(
        task_score=conversation.task_score,
        token_term=token_term(conversation, t_max, recipe),
        loss_term=loss_term(conversation, recipe),
        penalty=impersonation_penalty(conversation.utterances, recipe.impersonation_penalty),
    )


def score_question(conversations: Sequence[Conversation], recipe: LoopRecipe) -> list[RewardParts]:
    """The rewards of one question's conversations (`T_max` taken among them)."""
    t_max = question_t_max(conversations)
    return [score_conversation(c, t_max, recipe) for c in conversations]


def first_impersonation(utterances: Sequence[Utterance]) -> int | None:
    """The index of the first utterance that speaks for both agents, or None."""
    for index, utterance in enumerate(utterances):
        if is_impersonation(utterance):
            return index
    return None


def score_rollout_parts(conversation: Conversation, t_max: float | None, recipe: LoopRecipe) -> RewardParts:
    """The reward of one tree-search rollout (docs/method.md#rollout-reward): the same formula under the search's
    `T_max`, with the format rule instead of the impersonation penalty: from the first utterance that speaks for
    both agents on, the task score is 0 and the loss term reads only the utterances before it (`losses` may cover
    only those)."""
    cut = first_impersonation(conversation.utterances)
    task_score = conversation.task_score
    kept = conversation.utterances
    losses = conversation.losses
    if cut is not None:
        task_score = 0.0
        kept = conversation.utterances[:cut]
        losses = None if losses is None else losses[:cut]
    # The loss term sees only the well-formed prefix; the >max_total_tokens check still uses the whole count.
    prefix = Conversation(kept, conversation.token_count, task_score, conversation.status, losses)
    return RewardParts(
        task_score=task_score,
        token_term=token_term(conversation, t_max, recipe),
        loss_term=loss_term(prefix, recipe),
        penalty=0.0,
    )


def build_rollout_scorer(
    example: Example,
    recipe: LoopRecipe,
    t_max: float | None,
    score_texts: ScoreTexts | None = None,
    tokenize: Callable[[str], list[str]] | None = None,
    verifier=None,
) -> Callable:
    """The `score(rollout) -> RewardParts` of one question's tree search.

    Args:
        score_texts: The mean LM loss of each rendered utterance (needed when `cal_ppl`).
        tokenize: The initial tokenizer's `tokenize` (subword F1 under `compat: original`).
        verifier: A shared `MathVerifier` for MATH answers.
    """
    if recipe.cal_ppl and score_texts is None:
        raise ValueError("cal_ppl is on: the rollout scorer needs a score_texts callable (LM loss)")

    def score(rollout) -> RewardParts:
        utterances = list(rollout.utterances)
        cut = first_impersonation(utterances)
        scored = utterances if cut is None else utterances[:cut]
        losses = None
        if recipe.cal_ppl:
            losses = score_texts([render_utterance(u) for u in scored]) if scored else []
        answer = scored_answer(rollout.final_answer, rollout.status, recipe.compat)
        task_score = score_example(example, answer, recipe.compat, tokenize, verifier=verifier)
        conversation = Conversation(utterances, rollout.token_count, task_score, rollout.status, losses)
        return score_rollout_parts(conversation, t_max, recipe)

    return score
