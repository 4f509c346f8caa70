"""iSFT selection: top-1 per question, rank slice, epsilon, per-agent rows, seeded split.

See docs/method.md#isft-selection.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from optima.selection.sft import (
    BELOW_EPSILON,
    KEPT,
    NOT_BEST,
    NOTHING_USABLE,
    OUTSIDE_SLICE,
    best_conversation,
    conversation_rows,
    select_questions,
    split_rows,
)
from optima.tasks import Example

EXAMPLE = Example(
    id="x",
    task="arc",
    question="2+2?\nOptions: (A) 3 (B) 4",
    answer="4",
    score_type="choice",
    options=(("A", "3"), ("B", "4")),
)


def record(task_id, sample, reward, status="ok"):
    example = EXAMPLE.to_dict() | {"id": task_id}
    utterances = [{"speaker": "Alice", "text": f"<A>B</A> {task_id}-{sample}"}, {"speaker": "Bob", "text": "ok"}]
    return {
        "task_id": task_id,
        "sample_index": sample,
        "reward": reward,
        "status": status,
        "utterances": utterances,
        "reward_parts": {"task_score": 1.0},
        "final_answer": "B",
        "token_count": 20,
        "example": example,
    }


def line(task_id, *rewards):
    return {"task_id": task_id, "results": [record(task_id, k, r) for k, r in enumerate(rewards)]}


def recipe(**over):
    values = {"dataset_type": "arc", "selection_range": None, "initial_epsilon": 0.5} | over
    return SimpleNamespace(**values)


def test_best_conversation_prefers_reward_then_lower_sample():
    assert best_conversation(line("q", 0.2, 0.9, 0.9))["sample_index"] == 1
    failed = {"task_id": "q", "results": [record("q", 0, 5.0, status="too_long")]}
    assert best_conversation(failed) is None


def test_top_70_percent_then_epsilon():
    lines = [line(f"q{i}", r) for i, r in enumerate([1.0, 0.9, 0.8, 0.7, 0.6, 0.55, 0.4, 0.3, 0.2, 0.1])]
    decisions = {d.task_id: d for d in select_questions(lines, recipe())}
    # ranks 0..6 are in the slice; of those, rewards >= 0.5 are kept
    assert [k for k, d in decisions.items() if d.reason == KEPT] == ["q0", "q1", "q2", "q3", "q4", "q5"]
    assert decisions["q6"].reason == BELOW_EPSILON and decisions["q7"].reason == OUTSIDE_SLICE


def test_math_drops_the_top_ten_percent():
    lines = [line(f"q{i}", 2.0 - i / 10) for i in range(10)]
    decisions = select_questions(lines, recipe(dataset_type="math", initial_epsilon=0.0))
    kept = [d.task_id for d in decisions if d.reason == KEPT]
    assert kept == [f"q{i}" for i in range(1, 8)]


def test_explicit_range_and_unusable_questions():
    lines = [line("q0", 1.0), {"task_id": "q1", "results": [record("q1", 0, 9.0, status="error")]}, line("q2", 0.8)]
    decisions = {d.task_id: d for d in select_questions(lines, recipe(selection_range=[0.0, 1.0]))}
    assert decisions["q1"].reason == NOTHING_USABLE and decisions["q1"].to_record()["kept"] is False
    assert decisions["q0"].reason == decisions["q2"].reason == KEPT


@pytest.mark.parametrize("epsilon", [0.5, -10.0])
def test_a_conversation_that_copies_a_placeholder_is_never_kept(epsilon):
    """Whatever the threshold: the best-rewarded conversation copies the slot, so the next one is kept."""
    copy = record("q0", 0, 2.0)
    copy["utterances"][0]["text"] = "<A>X) option text</A>"  # no answer, but the reward may still rank it first
    question = {"task_id": "q0", "results": [copy, record("q0", 1, 0.9)]}
    (decision,) = select_questions([question], recipe(selection_range=[0.0, 1.0], initial_epsilon=epsilon))
    assert decision.reason == KEPT and decision.best["sample_index"] == 1
    assert decision.dropped == {"0": "copies a placeholder"}
    only_copies = {"task_id": "q1", "results": [copy | {"task_id": "q1"}]}
    (decision,) = select_questions([only_copies], recipe(initial_epsilon=epsilon))
    assert decision.reason == NOTHING_USABLE and decision.dropped == {"0": "copies a placeholder"}


def test_rows_are_the_two_agents_views_with_base_prompts():
    rows = conversation_rows(record("q9", 0, 1.0) | {"system_prompts": {"Alice": "POOL PROMPT", "Bob": "POOL"}})
    assert [r["speaker"] for r in rows] == ["Alice", "Bob"]
    alice, bob = (r["messages"] for r in rows)
    assert alice[0]["role"] == "system" and "POOL" not in alice[0]["content"]  # never the iteration-0 pool
    assert alice[-2] == {"role": "assistant", "content": "Alice: <A>B</A> q9-0"}
    assert bob[-1] == {"role": "assistant", "content": "Bob: ok"}


@pytest.mark.parametrize(("n", "fraction", "n_test"), [(50, 0.98, 1), (10, 0.9, 1), (3, 0.98, 0), (8, 1.0, 0)])
def test_split_is_seeded_and_keeps_conversations_together(n, fraction, n_test):
    kept = [record(f"q{i}", 0, 1.0) for i in range(n)]
    splits = split_rows(kept, fraction, seed=1, iteration=0)
    assert len(splits["test"]) == 2 * n_test and len(splits["train"]) == 2 * (n - n_test)
    test_ids = {r["task_id"] for r in splits["test"]}
    assert not test_ids & {r["task_id"] for r in splits["train"]}
    assert split_rows(kept, fraction, seed=1, iteration=0) == splits
    if n >= 10:
        assert split_rows(kept, fraction, seed=2, iteration=0)["train"] != splits["train"]


def test_the_rule_that_drops_every_other_conversation_is_recorded():
    mixed = line("q0", 0.4, 0.9, 0.7)
    mixed["results"].append(record("q0", 3, 5.0, status="too_long"))  # a higher reward, but cut for length
    failed = {"task_id": "q1", "results": [record("q1", 0, 9.0, status="error")]}
    decisions = {d.task_id: d.to_record() for d in select_questions([mixed, failed], recipe(selection_range=[0, 1]))}
    assert (decisions["q0"]["sample_index"], decisions["q0"]["reason"]) == (1, KEPT)
    assert decisions["q0"]["dropped"] == {
        "0": NOT_BEST,
        "2": NOT_BEST,
        "3": "unfinished (status too_long)",
    }
    assert decisions["q1"]["dropped"] == {"0": "unfinished (status error)"}


def test_the_order_the_questions_finished_in_changes_nothing():
    """Generation writes questions as they finish (timing decides); what is trained on must not follow it."""
    import random

    lines = [line(f"q{i}", 0.9 if i % 3 else 0.7, 0.5) for i in range(12)]  # ties at the rank slice's edge
    shuffled = list(lines)
    random.Random(3).shuffle(shuffled)
    decide = lambda ls: [d.to_record() for d in select_questions(ls, recipe(initial_epsilon=0.0))]  # noqa: E731
    assert decide(shuffled) == decide(lines) == decide(lines[::-1])
    kept = [d.best for d in select_questions(lines, recipe(initial_epsilon=0.0)) if d.reason == KEPT]
    assert split_rows(kept[::-1], 0.8, seed=1, iteration=0) == split_rows(kept, 0.8, seed=1, iteration=0)
