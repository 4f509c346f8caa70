"""The reward of one tree-search rollout: the reward formula with the search's global ``T_max`` and its format rule.

During the tree search (docs/method.md#rollout-reward) every rollout is scored on its own, as it ends, with the same
formula as the SFT reward (``optima.reward``) and two differences (docs/method.md#rollout-reward):

* ``T_max`` is not the question's longest conversation but a global quantile of the token-count probe
  (``optima.reward.token_quantile``, the probe stage);
* the **format rule** replaces the cleaning penalty: when an utterance speaks for both agents (``is_impersonation``:
  both ``Alice:`` and ``Bob:``, or one name twice) the task score is 0 and the LM-loss term only looks at the
  utterances *before* the first such utterance. There is no -10 penalty here (that belongs to SFT cleaning,
  docs/method.md#impersonation).

``build_rollout_scorer`` turns this into the ``score`` callable that ``optima.selection.mcts.search_question``
takes; the LM loss comes from an injected ``score_texts`` callable (``optima.lm_loss``), so this module stays pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from optima.agents.prompts import Utterance, is_impersonation, render_utterance
from optima.reward import Conversation, RewardParts, loss_term, scored_answer, token_term
from optima.tasks import Example
from optima.tasks.scoring import score_example

if TYPE_CHECKING:
    from optima.config import LoopRecipe

ScoreTexts = Callable[[Sequence[str]], list[float]]


def first_impersonation(utterances: Sequence[Utterance]) -> int | None:
    """Index of the first utterance that speaks for both agents, or None.

    Args:
        utterances: The conversation, oldest first.
    """
    for index, utterance in enumerate(utterances):
        if is_impersonation(utterance):
            return index
    return None


def score_rollout_parts(conversation: Conversation, t_max: float | None, recipe: LoopRecipe) -> RewardParts:
    """Reward parts of one rollout under the tree search's format rule (no impersonation penalty).

    Args:
        conversation: The whole rollout; ``losses`` may cover only the utterances before the first impersonation
            (or all of them), or be None when ``cal_ppl`` is off.
        t_max: The global token quantile.
        recipe: Supplies ``lambda1``, ``lambda2``, ``cal_ppl`` and the override constants.
    """
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
    """The ``score(rollout) -> RewardParts`` callable of one question's tree search.

    Args:
        example: The question (gold answer, score type, options).
        recipe: Reward fields and ``compat``.
        t_max: The global token quantile (``token_quantile`` of the probe).
        score_texts: Mean LM loss of each rendered utterance under the initial model (needed when ``cal_ppl``).
        tokenize: The initial tokenizer's ``tokenize`` (subword F1 under ``compat: original``).
        verifier: A shared ``MathVerifier`` for MATH answers.
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
