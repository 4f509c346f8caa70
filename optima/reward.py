"""The Optima reward: pure functions (SPEC 3.1, 3.3; the paper's overview figure).

    R = R_task − λ_token · tokens / T_max + λ_loss / max_i L_i

with the original's signs: ``lambda1`` (< 0) multiplies ``tokens / T_max`` and ``lambda2`` divides the largest
per-utterance LM loss ``L_i`` (mean NLL of utterance i under the fixed initial model), so a conversation earns
more when it is correct, short, and every utterance stays readable. The overrides of the original:

* token term = ``overlong_penalty`` (−1) when the conversation is too long / failed, or has ≤ ``min_tokens``;
* loss term = ``overlong_penalty`` when it has more than ``max_total_tokens`` tokens or no utterance, and 0
  when an utterance repeats an earlier one (compared without the name prefix, case-insensitively; the original
  used a character-set ``strip``, SPEC 9.2 item 18);
* ``impersonation_penalty`` (−10) for each utterance that speaks for both agents (SPEC 3.3), scanning stops at
  the first one that names both.

``T_max`` is the largest token count among a question's conversations that did not run too long (SPEC 3.1);
the tree search passes a global quantile instead (SPEC 4.1). Every part is kept for analysis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from optima.agents.prompts import AGENT_NAMES, Utterance, is_impersonation

OK = "ok"


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
    """What the reward needs to know about one conversation.

    Args:
        utterances: The conversation, oldest first (speaker + text without the name prefix).
        token_count: Tokens of all utterances (system prompts excluded, SPEC 2.6).
        task_score: Score of its final answer against the gold answer (0 when none).
        status: ``ok``, ``too_long`` or ``error`` (generation's status).
        losses: Mean NLL of each utterance under the initial model (``None`` without the loss term).
    """

    utterances: Sequence[Utterance]
    token_count: int
    task_score: float
    status: str = OK
    losses: Sequence[float] | None = None


def question_t_max(conversations: Sequence[Conversation]) -> int | None:
    """``T_max`` of one question: the most tokens among its conversations that did not run too long."""
    counts = [c.token_count for c in conversations if c.status == OK and c.token_count > 0]
    return max(counts) if counts else None


def token_term(conversation: Conversation, t_max: float | None, recipe) -> float:
    """``lambda1 · tokens / T_max``, or the penalty for failed, too long or too short conversations."""
    if conversation.status != OK or t_max is None or conversation.token_count <= recipe.min_tokens:
        return recipe.overlong_penalty
    return recipe.lambda1 * conversation.token_count / t_max


def _normalised(text: str) -> str:
    return " ".join(text.lower().split())


def has_repeat(utterances: Sequence[Utterance]) -> bool:
    """True when an utterance repeats an earlier one (whitespace and case aside)."""
    seen: set[str] = set()
    for utterance in utterances:
        key = _normalised(utterance.text)
        if key in seen:
            return True
        seen.add(key)
    return False


def loss_term(conversation: Conversation, recipe) -> float:
    """``lambda2 / max_i L_i`` with the original's overrides; 0 when ``cal_ppl`` is off."""
    if not recipe.cal_ppl:
        return 0.0
    if conversation.token_count > recipe.max_total_tokens or not conversation.utterances:
        return recipe.overlong_penalty
    if conversation.status != OK:
        return recipe.overlong_penalty
    if has_repeat(conversation.utterances):
        return 0.0
    if conversation.losses is None or len(conversation.losses) != len(conversation.utterances):
        raise ValueError("loss term needs one LM loss per utterance")
    worst = max(conversation.losses)
    # A loss of exactly 0 cannot come from a real model; guard the division all the same.
    return recipe.lambda2 / max(worst, 1e-6)


def impersonation_penalty(utterances: Sequence[Utterance], penalty: float) -> float:
    """``penalty`` per utterance that speaks for its partner; stop at the first naming both agents."""
    total = 0.0
    for utterance in utterances:
        if is_impersonation(utterance):
            total += penalty
            text = f"{utterance.speaker}: {utterance.text}"
            if all(f"{name}:" in text for name in AGENT_NAMES):
                break
    return total


def score_conversation(conversation: Conversation, t_max: float | None, recipe) -> RewardParts:
    """The reward of one conversation.

    Args:
        conversation: Its utterances, tokens, task score, status and utterance losses.
        t_max: The question's ``T_max`` (``question_t_max``) or the tree search's global quantile.
        recipe: Supplies ``lambda1``, ``lambda2``, ``cal_ppl`` and the override constants.
    """
    return RewardParts(
        task_score=conversation.task_score,
        token_term=token_term(conversation, t_max, recipe),
        loss_term=loss_term(conversation, recipe),
        penalty=impersonation_penalty(conversation.utterances, recipe.impersonation_penalty),
    )


def score_question(conversations: Sequence[Conversation], recipe) -> list[RewardParts]:
    """Rewards of all conversations of one question (``T_max`` taken among them)."""
    t_max = question_t_max(conversations)
    return [score_conversation(c, t_max, recipe) for c in conversations]
