"""Evaluation metrics and the self-consistency analysis on handcrafted result records (docs/method.md#evaluation)."""

from __future__ import annotations

import pytest

from optima.agents.prompts import Utterance
from optima.evaluation.compare import cell, wide_rows
from optima.evaluation.metrics import (
    AnswerMatcher,
    RecordScorer,
    analyze_self_consistency,
    cluster_answers,
    has_answer,
    majority_score,
    method_row,
    metric_names,
    summarize_records,
    with_timeouts,
)
from optima.reward import build_rollout_scorer
from optima.selection.tree import Rollout
from optima.stages import reward_question
from optima.tasks import Example
from optima.tasks.math_equiv import MathVerifier
from tests._task_fixtures import echo_check, timed_out_check
from tests.test_layout import sft_recipe

ARC = Example(
    "arc-1", "arc", "2 + 2?\nOptions:\nA) 3\nB) 4\nC) 5", "4", "choice", options=(("A", "3"), ("B", "4"), ("C", "5"))
)
TRIVIA = Example("tq-1", "trival_qa", "Capital of France?", ("Paris", "City of Paris"), "f1")
HOTPOT = Example("hp-1", "hotpot_qa", "Which tower?", "Eiffel Tower", "f1")
GSM8K = Example("gsm-1", "gsm8k", "How many?", "18", "number")
MATH = Example("math-1", "math", "Half of one?", "\\frac{1}{2}", "math")


def rec(
    example: Example, answer: str | None, status: str = "ok", tokens: int = 10, sample: int = 0, replies=()
) -> dict:
    """A result record as generate_conversations writes it (only the fields the metrics read)."""
    return {
        "task_id": example.id,
        "sample_index": sample,
        "final_answer": answer or "",
        "status": status,
        "token_count": tokens,
        "example": example.to_dict(),
        "utterances": [{"speaker": "Alice", "text": text, "tokens": 1} for text in replies],
    }


def samples(example: Example, answers: list, tokens: int = 10) -> list[dict]:
    """One record per answer, sample indices in order; an answer may be (text, status)."""
    out = []
    for k, item in enumerate(answers):
        text, status = item if isinstance(item, tuple) else (item, "ok")
        out.append(rec(example, text, status, tokens, k))
    return out


SCORER = RecordScorer(tokenize=str.split)


@pytest.mark.parametrize(
    ("example", "answer", "status", "ours", "original"),
    [
        (ARC, "B", "ok", 1.0, 0.0),  # the original compared option text only
        (ARC, "B) 4", "ok", 1.0, 1.0),  # ... the text after the prompt's "letter) " label (docs/method.md D28)
        (ARC, "(B) 4", "ok", 1.0, 0.0),  # ... exactly: another label form is not removed
        (ARC, "4", "ok", 1.0, 1.0),
        (ARC, "A", "ok", 0.0, 0.0),
        (ARC, "", "ok", 0.0, 0.0),  # no answer
        (ARC, "B", "too_long", 0.0, 0.0),  # cut for length: no answer, whatever an earlier utterance said
        (ARC, "B", "error", 0.0, 0.0),
        (
            TRIVIA,
            "the city of Paris",
            "ok",
            1.0,
            pytest.approx(6 / 7),
        ),  # aliases: max over golds; subword F1 keeps "the"
        (TRIVIA, "Paris", "ok", 1.0, 1.0),
        (TRIVIA, "Lyon", "ok", 0.0, 0.0),
        (HOTPOT, "Eiffel", "ok", pytest.approx(2 / 3), pytest.approx(2 / 3)),
        (GSM8K, "18", "ok", 1.0, 1.0),
        (GSM8K, "18.0", "ok", 1.0, 0.0),  # original: first number as a string
        (GSM8K, "18 apples and 3", "ok", 0.0, 1.0),  # ... which reads "18" here
        (MATH, "0.5", "ok", 1.0, 1.0),  # equivalence, not strings
        (MATH, "\\dfrac{1}{2}", "ok", 1.0, 1.0),
        (MATH, "\\frac{1}{3}", "ok", 0.0, 0.0),
    ],
)
def test_record_scores(example, answer, status, ours, original):
    record = rec(example, answer, status)
    assert SCORER.score(record) == ours
    assert SCORER.score(record, original=True) == original


def test_original_subword_f1_needs_the_tokenizer():
    with pytest.raises(ValueError, match="tokenize"):
        RecordScorer().score(rec(TRIVIA, "Paris"), original=True)


@pytest.mark.parametrize(
    ("score_type", "names"),
    [
        ("f1", ("f1", "f1_original_subword")),
        ("choice", ("accuracy", "accuracy_original")),
        ("math", ("accuracy", "accuracy_original")),
    ],
)
def test_metric_names(score_type, names):
    assert metric_names(score_type) == names


def test_summary_of_a_greedy_file():
    arc = [Example(f"q{i}", "arc", "?", "4", "choice", options=ARC.options) for i in range(5)]
    records = [
        rec(arc[0], "B", tokens=10),
        rec(arc[1], "A", tokens=20),
        rec(arc[2], "", tokens=30, replies=["<A>{letter}) {option text}</A> The answer is B."]),  # named in words
        rec(arc[3], "B", "too_long", tokens=40, replies=["The answer is B"]),  # cut: no answer, strict or flexible
        rec(arc[4], None, "error", tokens=0),
    ]
    summary = summarize_records(records, SCORER)
    assert summary == {
        "questions": 5,
        "conversations": 5,
        "accuracy": 0.2,
        "accuracy_original": 0.0,
        "accuracy_flexible": 0.4,
        "answer_rate": 0.4,
        "flexible_answer_rate": 0.6,
        "mean_tokens": 20.0,
        "mean_tokens_original": 12.0,  # too long / failed: 0 tokens, still counted
        "cut_rate": 0.2,
        "no_answer_rate": 0.6,
        "too_long_rate": 0.2,
        "error_rate": 0.2,
    }
    assert [has_answer(r) for r in records] == [True, True, False, False, False]


def test_summary_averages_per_question_first():
    records = samples(ARC, ["B", "A"]) + [rec(HOTPOT, "Eiffel Tower")]
    summary = summarize_records(records, SCORER)
    assert summary["questions"] == 2 and summary["accuracy"] == pytest.approx((0.5 + 1.0) / 2)


def test_empty_file_summary():
    assert summarize_records([], SCORER) == {"questions": 0, "conversations": 0}


def test_every_math_table_counts_the_verifier_timeouts(tmp_path):
    """A symbolic check that times out twice scores 0 and is counted in the row: sweep/SC summary, comparison row,
    self-consistency rows, the methods x tasks table; other tasks' tables are unchanged."""
    gold = str(tmp_path / "tries")  # timed_out_check notes each try there; never equal to an answer by the fast path
    examples = [Example(f"m{i}", "math", "?", gold, "math") for i in range(2)]
    records = [rec(examples[0], "x+1"), rec(examples[1], "x-1", sample=0), rec(examples[1], "", sample=1)]
    with MathVerifier(max_workers=1, check=timed_out_check) as verifier:
        scorer = RecordScorer(verifier=verifier)
        summary = summarize_records(records, scorer)
        # Two answers, each scored three times (ours, the original's, the flexible answer's): 6 checks timed out.
        assert (summary["accuracy"], summary["verifier_timeouts"]) == (0.0, 6)
        assert method_row(records, 1, scorer)["verifier_timeouts"] == 6
        voted = analyze_self_consistency(records, 2, scorer)
        assert [row["verifier_timeouts"] for row in voted] == [2, 2]  # scored once each, nothing to cluster
        assert summarize_records(records[:1], scorer)["verifier_timeouts"] == 3  # per table row, not cumulative
    assert with_timeouts(["model"], [summary]) == ["model", "verifier_timeouts"]
    arc = summarize_records([rec(ARC, "B")], SCORER)
    assert "verifier_timeouts" not in arc and with_timeouts(["model"], [arc]) == ["model"]
    row = {"method": "CoT", "accuracy": 0.5, "mean_tokens": 12.0, "verifier_timeouts": 2}
    assert cell(row, "accuracy") == "0.500 / 12 / 2 timeouts"
    assert wide_rows({"math": [row]})[0]["math_verifier_timeouts"] == 2
    assert cell(row | {"verifier_timeouts": 0}, "accuracy") == "0.500 / 12"


@pytest.mark.parametrize(
    ("example", "answers", "clusters"),
    [
        (ARC, ["B", "4", "A", "b) 4"], [[0, 1, 3], [2]]),  # label, text and labelled text are one option
        (HOTPOT, ["the Eiffel Tower", "Eiffel Tower", "Eiffel"], [[0, 1], [2]]),  # F1 0.67 < 0.9
        (TRIVIA, ["Paris", None, "", "paris "], [[0, 3]]),  # empty answers do not vote
        (GSM8K, ["18", "18.00", "17"], [[0, 1], [2]]),
        (MATH, ["0.5", "\\frac{1}{2}", "1/2", "\\frac{1}{3}"], [[0, 1, 2], [3]]),
    ],
)
def test_vote_clusters(example, answers, clusters):
    with MathVerifier(check=echo_check) as verifier:
        history = cluster_answers(answers, AnswerMatcher(example, 0.9, verifier))
    assert history[-1] == clusters
    assert len(history) == len(answers)


def test_math_votes_by_symbolic_equivalence():
    with MathVerifier(max_workers=1) as verifier:
        history = cluster_answers(["x+1", "1+x", "x-1"], AnswerMatcher(MATH, 0.9, verifier))
    assert history[-1] == [[0, 1], [2]]


@pytest.mark.parametrize(
    ("clusters", "scores", "expected"),
    [
        ([[0], [1]], [0.0, 1.0], 0.0),  # tie: the earliest cluster wins
        ([[0], [1, 2]], [0.0, 1.0, 1.0], 1.0),
        ([[0, 2], [1]], [1.0, 0.0, 0.5], 0.75),  # mean score of the winning cluster (F1 members differ)
        ([], [0.0], 0.0),  # nobody answered
    ],
)
def test_majority_score(clusters, scores, expected):
    assert majority_score(clusters, scores) == expected


def test_self_consistency_curves():
    first = samples(ARC, ["A", "B", "B", ("B", "too_long"), ("B", "error")], tokens=10)
    other = Example("arc-2", "arc", "?", "3", "choice", options=ARC.options)
    second = samples(other, ["", "A", "C"], tokens=4)  # three samples only
    rows = analyze_self_consistency(first + second, max_k=5, scorer=SCORER)
    assert [r["k"] for r in rows] == [1, 2, 3, 4, 5]
    # k=1: A wrong, "" no vote; k=2: A vs B tie -> A (earliest); k=3: B wins for q1, A (right) for q2
    assert [r["majority_vote"] for r in rows] == [0.0, 0.5, 1.0, 1.0, 1.0]
    assert [r["coverage"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    # too long / failed samples neither vote nor cover; q2 keeps its 3 samples beyond k=3
    assert [r["tokens"] for r in rows] == [7.0, 14.0, 21.0, 26.0, 31.0]
    assert rows[0]["questions"] == 2


def test_self_consistency_caps_k_and_handles_nothing():
    rows = analyze_self_consistency(samples(ARC, ["B", "B"]), max_k=8, scorer=SCORER)
    assert [r["k"] for r in rows] == [1, 2]
    assert analyze_self_consistency([], max_k=3, scorer=SCORER) == []


@pytest.mark.parametrize("status", ["ok", "too_long", "error"])
@pytest.mark.parametrize("compat", ["default", "original"])
def test_the_reward_and_the_evaluation_score_a_cut_conversation_alike(tmp_path, status, compat):
    """One rule (docs/method.md#cut-replies): a conversation that did not finish has no answer, in both places."""
    recipe = sft_recipe(tmp_path, compat=compat, cal_ppl=False)
    record = rec(ARC, "4", status) | {"utterances": [{"speaker": "Alice", "text": "<A>4</A>"}]}
    line = reward_question([record], [None], recipe, tokenize=str.split)
    task_score = line["results"][0]["reward_parts"]["task_score"]
    assert task_score == (1.0 if status == "ok" or compat == "original" else 0.0)  # original: the original's reward
    if compat == "default":
        assert task_score == SCORER.score(record)  # the evaluation's score
    # The tree search's rollout scorer follows the same rule.
    rollout = Rollout((Utterance("Alice", "<A>4</A>"),), (10,), "4", status, status)
    assert build_rollout_scorer(ARC, recipe, t_max=100)(rollout).task_score == task_score
