"""The Optima reward: pure functions (docs/method.md#reward; the paper's overview figure).

    R = R_task − λ_token · tokens / T_max + λ_loss / max_i L_i

with the recipes' signs: ``lambda1`` (< 0) multiplies ``tokens / T_max`` and ``lambda2`` divides the largest
per-utterance LM loss ``L_i`` (mean NLL of utterance i under the fixed initial model), so a conversation earns
more when it is correct, short, and every utterance stays readable. The overrides:

* token term = ``overlong_penalty`` (−1) when the conversation is too long / failed, or has ≤ ``min_tokens``;
* loss term = ``overlong_penalty`` when it has more than ``max_total_tokens`` tokens or no utterance, and 0
  when an utterance repeats an earlier one (compared without the name prefix, case-insensitively, not with a
  character-set ``strip``: docs/method.md D15); an utterance whose loss is NaN (nothing in it was scored) is
  skipped (``finite_losses``, the one rule wherever losses are aggregated), and with no finite loss left the
  term is ``overlong_penalty`` as for no utterance;
* ``impersonation_penalty`` (−10) for each utterance that speaks for both agents, scanning stops at
  the first one that names both.

The task score reads a conversation's answer only when it finished (``scored_answer``): a conversation cut at
``max_tokens`` or failed has no answer, here as in evaluation (docs/method.md#cut-replies; ``compat: original``
scores the last answer it stated: docs/method.md D32).

``T_max`` is the largest token count among a question's conversations that did not run too long
(``question_t_max``); the tree search passes a global quantile of a probe's token counts instead
(``search_t_max``, docs/method.md#rollout-reward). Both count the same conversations (``counted_tokens``). Every part
is kept for analysis.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from optima.agents.prompts import AGENT_NAMES, Utterance, is_impersonation
from optima.quantiles import interpolated_quantile
from optima.tasks import get_task
from optima.tasks.flexible import flexible_answer as flexible_reply_answer

if TYPE_CHECKING:
    from optima.config import LoopRecipe

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
        token_count: Tokens of all utterances (system prompts excluded, docs/method.md#token-count).
        task_score: Score of its final answer against the gold answer (0 when none).
        status: ``ok``, ``too_long`` or ``error`` (generation's status).
        losses: Mean NLL of each utterance under the initial model (``None`` without the loss term).
    """

    utterances: Sequence[Utterance]
    token_count: int
    task_score: float
    status: str = OK
    losses: Sequence[float] | None = None


def scored_answer(final_answer: str | None, status: str, compat: str = "default") -> str | None:
    """The answer a conversation is scored on: its final answer when it finished (``ok``), else none.

    One rule for the reward, the tree search and evaluation (docs/method.md#cut-replies): a conversation cut at
    ``max_tokens`` did not end, so an answer stated before the cut was never confirmed, and the tokens it spent
    count in full; rewarding it would teach what evaluation scores 0.

    Args:
        final_answer: The last answer the conversation stated ("" or None when none).
        status: ``ok``, ``too_long`` or ``error``.
        compat: ``original`` scores the last stated answer whatever the status (docs/method.md D32).
    """
    if status != OK and compat != "original":
        return None
    return final_answer or None


def has_answer(record: dict) -> bool:
    """Whether a conversation record ended normally with a parsed answer (cut and failed ones have none).

    Args:
        record: A generation record, rewarded result or tree-search rollout (``final_answer``, ``status``).
    """
    return scored_answer(record.get("final_answer"), record.get("status", "")) is not None


def flexible_answer(record: dict) -> str | None:
    """The answer a conversation record names, in the answer format or not (docs/method.md#metrics).

    Its strict answer (``scored_answer``) when it has one, else the flexible answer of its replies
    (``optima.tasks.flexible``: an option named in words, the last number, ...); None for a cut or failed
    conversation, as for the strict answer.

    Args:
        record: A generation record (``final_answer``, ``status``, ``utterances``, ``example``).
    """
    strict = scored_answer(record.get("final_answer"), record.get("status", ""))
    if strict is not None or record.get("status") != OK:
        return strict
    example = record["example"]
    options = tuple((str(label), str(text)) for label, text in example.get("options", ()))
    texts = [utterance["text"] for utterance in record.get("utterances", ())]
    return flexible_reply_answer(texts, example["score_type"], options)


def placeholder_copies(record: dict) -> int:
    """Utterances of a conversation record whose answer copies a prompt's placeholder (``Task.copies_placeholder``).

    Such an answer is no answer (it neither scores nor stops the conversation), but training on it would teach the
    copy: selection never keeps a conversation with one, and the score stage counts them
    (docs/method.md#isft-selection).

    Args:
        record: A generation record or rewarded result (``utterances``; its task from ``task`` or ``example``).
    """
    utterances = record.get("utterances") or ()
    if not utterances:
        return 0
    task = get_task(record.get("task") or record["example"]["task"])
    return sum(task.copies_placeholder(u["text"]) for u in utterances)


def is_cut(record: dict) -> bool:
    """Whether a conversation record holds a reply cut at ``max_tokens``.

    Args:
        record: A generation record, rewarded result or tree-search rollout: its ``cut_replies`` count, else
            (records written before it existed) a ``too_long`` status.
    """
    return record.get("cut_replies", int(record.get("status") == "too_long")) > 0


def counted_tokens(conversations: Iterable[Conversation | dict]) -> list[int]:
    """Token counts that ``T_max`` is taken from: conversations that finished (``ok``) with at least one token.

    Args:
        conversations: ``Conversation`` objects or generation records (``status``, ``token_count``).
    """
    pairs = (
        (c["status"], c["token_count"]) if isinstance(c, dict) else (c.status, c.token_count) for c in conversations
    )
    return [count for status, count in pairs if status == OK and count > 0]


def question_t_max(conversations: Sequence[Conversation]) -> int | None:
    """``T_max`` of one question: the most tokens among its conversations that did not run too long."""
    counts = counted_tokens(conversations)
    return max(counts) if counts else None


def token_quantile(token_counts: Sequence[int], q: float) -> int:
    """The tree search's ``T_max``: ``int(quantile_q(token_counts)) + 1`` (linear interpolation, as numpy's default).

    Args:
        token_counts: Token counts of the probe conversations.
        q: The quantile in [0, 1] (recipe ``token_quantile``: 0.85 for iDPO, 0.8 for iSFT-DPO).
    """
    if not token_counts:
        raise ValueError("token_quantile needs at least one token count (the probe produced no conversation)")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q!r}")
    return int(interpolated_quantile(token_counts, q)) + 1


def search_t_max(probe: Iterable[Conversation | dict], q: float) -> int:
    """``T_max`` of the tree search: the ``q`` quantile (``token_quantile``) of the probe's counted tokens."""
    return token_quantile(counted_tokens(probe), q)


def token_term(conversation: Conversation, t_max: float | None, recipe: LoopRecipe) -> float:
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


def reads_losses(status: str | None) -> bool:
    """Whether ``loss_term`` may read a conversation's LM losses: only a finished one (``ok``); a cut or failed one
    gets ``overlong_penalty`` without them."""
    return status == OK


def finite_losses(losses: Iterable[float | None]) -> list[float]:
    """The LM losses that count: NaN and None (an utterance with nothing scored; JSON stores NaN as null) skipped.

    The one rule wherever per-utterance losses are aggregated (the loss term's maximum, the browser's mean), so the
    result never depends on where a NaN sits (``max([nan, 2.0])`` is nan, ``max([2.0, nan])`` is 2.0).
    """
    return [float(x) for x in losses if x is not None and not math.isnan(x)]


def loss_term(conversation: Conversation, recipe: LoopRecipe) -> float:
    """``lambda2 / max_i L_i`` with the overrides above; 0 when ``cal_ppl`` is off."""
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
    """``penalty`` per utterance that speaks for its partner; stop at the first naming both agents."""
    total = 0.0
    for utterance in utterances:
        if is_impersonation(utterance):
            total += penalty
            text = f"{utterance.speaker}: {utterance.text}"
            if all(f"{name}:" in text for name in AGENT_NAMES):
                break
    return total


def score_conversation(conversation: Conversation, t_max: float | None, recipe: LoopRecipe) -> RewardParts:
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


def score_question(conversations: Sequence[Conversation], recipe: LoopRecipe) -> list[RewardParts]:
    """Rewards of all conversations of one question (``T_max`` taken among them)."""
    t_max = question_t_max(conversations)
    return [score_conversation(c, t_max, recipe) for c in conversations]
