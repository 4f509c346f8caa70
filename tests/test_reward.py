"""The reward (docs/method.md#reward): table tests for every term and override."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from optima.agents.prompts import Utterance
from optima.browser.collect import conversation_view
from optima.reward import (
    Conversation,
    has_repeat,
    impersonation_penalty,
    question_t_max,
    score_conversation,
    score_question,
)

RECIPE = SimpleNamespace(
    lambda1=-0.5,
    lambda2=0.6,
    cal_ppl=True,
    min_tokens=40,
    max_total_tokens=2000,
    overlong_penalty=-1.0,
    impersonation_penalty=-10.0,
)
A = Utterance("Alice", "I think the answer is 4. <A>4</A>")
B = Utterance("Bob", "Checked: 2+2 is 4.")


def conv(tokens=100, score=1.0, status="ok", losses=(2.0, 3.0), utterances=(A, B)):
    return Conversation(list(utterances), tokens, score, status, list(losses) if losses is not None else None)


@pytest.mark.parametrize(
    ("conversation", "t_max", "expected"),
    [
        # task 1 + (-0.5 * 100/200) + 0.6 / max(2, 3)
        (conv(), 200, (1.0, -0.25, 0.2, 0.0)),
        (conv(score=0.0, tokens=200), 200, (0.0, -0.5, 0.2, 0.0)),
        # too short: token term -1
        (conv(tokens=40), 200, (1.0, -1.0, 0.2, 0.0)),
        # too many tokens in total: loss term -1
        (conv(tokens=2001), 2001, (1.0, -0.5, -1.0, 0.0)),
        # failed or too long conversation: both terms -1
        (conv(status="too_long", score=0.0), 200, (0.0, -1.0, -1.0, 0.0)),
        (conv(status="error", score=0.0, losses=None), 200, (0.0, -1.0, -1.0, 0.0)),
        # no T_max for the question (every conversation too long)
        (conv(), None, (1.0, -1.0, 0.2, 0.0)),
        # a repeated utterance zeroes the loss term (compared without prefix, case-insensitively)
        (
            conv(utterances=(A, Utterance("Bob", "x y"), Utterance("Alice", A.text.upper())), losses=(1, 1, 1)),
            200,
            (1.0, -0.25, 0.0, 0.0),
        ),
        # impersonation: Alice writes Bob's turn
        (conv(utterances=(Utterance("Alice", "4\nBob: yes, 4"), B)), 200, (1.0, -0.25, 0.2, -10.0)),
        # empty conversation
        (conv(utterances=(), losses=()), 200, (1.0, -0.25, -1.0, 0.0)),
    ],
)
def test_reward_terms(conversation, t_max, expected):
    parts = score_conversation(conversation, t_max, RECIPE)
    got = (parts.task_score, parts.token_term, parts.loss_term, parts.penalty)
    assert got == pytest.approx(expected)
    assert parts.reward == pytest.approx(sum(expected))
    assert parts.to_dict()["reward"] == pytest.approx(sum(expected))


def test_no_loss_term_without_cal_ppl():
    recipe = SimpleNamespace(**vars(RECIPE) | {"cal_ppl": False})
    assert score_conversation(conv(losses=None), 200, recipe).loss_term == 0.0


def test_missing_losses_are_an_error_not_a_zero():
    with pytest.raises(ValueError, match="one LM loss per utterance"):
        score_conversation(conv(losses=(1.0,)), 200, RECIPE)


def test_t_max_ignores_failed_conversations():
    group = [conv(tokens=100), conv(tokens=300, status="too_long"), conv(tokens=250), conv(tokens=900, status="error")]
    assert question_t_max(group) == 250
    rewards = score_question(group, RECIPE)
    assert rewards[0].token_term == pytest.approx(-0.5 * 100 / 250)
    assert rewards[2].token_term == pytest.approx(-0.5)


def test_shorter_correct_conversation_wins():
    short, long = conv(tokens=60), conv(tokens=240)
    parts = score_question([short, long], RECIPE)
    assert parts[0].reward > parts[1].reward


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        ([("Alice", "fine")], 0.0),
        ([("Alice", "Alice: again")], -10.0),  # own name twice (with the rendered prefix)
        ([("Alice", "ok Bob: sure"), ("Bob", "Alice: hi")], -10.0),  # stops at the first naming both
        ([("Bob", "Bob: x"), ("Alice", "Alice: y")], -20.0),  # "twice" does not stop the scan
    ],
)
def test_impersonation_penalty(texts, expected):
    assert impersonation_penalty([Utterance(s, t) for s, t in texts], -10.0) == expected


def test_repeat_detection():
    assert has_repeat([Utterance("Alice", "a  b"), Utterance("Bob", "A B")])
    assert not has_repeat([Utterance("Alice", "a b"), Utterance("Bob", "a b c")])


@pytest.mark.parametrize("losses", [(math.nan, 2.0), (2.0, math.nan)])
def test_a_nan_loss_is_skipped_wherever_it_sits(losses):
    """``max([nan, 2.0])`` is nan but ``max([2.0, nan])`` is 2.0: one rule skips NaN whatever the order."""
    assert score_conversation(conv(losses=losses), 200, RECIPE).loss_term == pytest.approx(0.6 / 2.0)


def test_no_finite_loss_is_scored_as_no_utterance():
    assert score_conversation(conv(losses=(math.nan, math.nan)), 200, RECIPE).loss_term == RECIPE.overlong_penalty


def test_the_browser_averages_losses_with_the_same_rule():
    utterances = [{"speaker": name, "text": text} for name, text in [("Alice", "a"), ("Bob", "b"), ("Alice", "c")]]
    record = {"utterances": utterances, "tokens": [1, 1, 1], "losses": [math.nan, 2.0, None], "status": "ok"}
    assert conversation_view(record, "x").lm_loss == 2.0
    from optima.reward import finite_losses

    assert finite_losses([None, math.nan, 3, 1.5]) == [3.0, 1.5]


def test_tiny_loss_does_not_divide_by_zero():
    assert math.isfinite(score_conversation(conv(losses=(0.0, 0.0)), 200, RECIPE).loss_term)


@pytest.mark.parametrize("status", ["ok", "too_long", "error"])
def test_losses_are_scored_exactly_for_the_conversations_the_reward_reads_them_of(status):
    """The loss stream asks the reward's own rule: a conversation whose losses the reward does not read gets the
    penalty without them, and one whose losses it reads fails without them."""
    from optima.lm_loss import needs_losses
    from optima.reward import loss_term

    needed = needs_losses({"status": status})
    if needed:
        with pytest.raises(ValueError, match="one LM loss per utterance"):
            loss_term(conv(status=status, losses=None), RECIPE)
    else:
        assert loss_term(conv(status=status, losses=None), RECIPE) == RECIPE.overlong_penalty
    assert needed == (status == "ok")
