"""Flexible answers (optima.tasks.scoring) on hand-written replies, and how records, metrics and votes use them."""

from __future__ import annotations

import pytest

from optima.evaluation.metrics import RecordScorer, method_row, summarize_records
from optima.reward import flexible_answer
from optima.tasks import Example
from optima.tasks.scoring import extract_choice, extract_number, extract_span
from optima.tasks.scoring import flexible_answer as reply_answer

OPTIONS = (("A", "water"), ("B", "salt water"), ("C", "sand"), ("D", "ice"))
NUMBERED = (("1", "heat"), ("2", "light"), ("3", "sound"), ("4", "motion"))


@pytest.mark.parametrize(
    ("reply", "options", "label"),
    [
        ("The correct answer is option A", OPTIONS, "A"),  # what SmolLM2 writes instead of the tag
        ("<A>{letter}) {option text}</A> The answer is C.", OPTIONS, "C"),  # the copied placeholder, then words
        ("<A>{letter}) {option text}</A>", OPTIONS, None),  # the placeholder names nothing
        ("Option A is wrong. The answer is D.", OPTIONS, "D"),  # the last sentence that names an option
        ("I think it is (B).", OPTIONS, "B"),
        ("B) salt water", OPTIONS, "B"),
        ("It must be salt water.", OPTIONS, "B"),  # by text, the longer of two overlapping texts
        ("It is sand. Let me know if you need more help!", OPTIONS, "C"),  # a sentence that names none is skipped
        ("So I pick C.", OPTIONS, "C"),  # a bare label ending a clause
        ("<A>D) ice", OPTIONS, "D"),  # an unclosed tag: no strict answer, the marked label
        ("Vitamin A is good for you", OPTIONS, None),  # a capital A inside a sentence is no label
        ("A big rock fell.", OPTIONS, None),  # nor an article
        ("The answer is a mineral.", OPTIONS, None),  # lower case: an article, not option A
        ("My choice: 2", NUMBERED, "2"),  # numeric labels (some ARC questions)
        ("The answer is option A", (), None),  # no options, nothing to name
        ("", OPTIONS, None),
        (None, OPTIONS, None),
    ],
)
def test_choice_replies(reply, options, label):
    assert extract_choice(reply, options) == label


@pytest.mark.parametrize(
    ("reply", "number"),
    [
        ("She pays $1,250.50 in total.", "1250.50"),
        ("x = -3", "-3"),
        ("Step 1: 5 + 3 = 8. So she has 8 apples.", "8"),
        ("<A>{number}</A>", None),  # the placeholder holds no number
        ("no number here", None),
        ("The answer is \\boxed{12}, or 12.", "12"),
    ],
)
def test_number_replies(reply, number):
    assert extract_number(reply) == number


@pytest.mark.parametrize(
    ("reply", "span"),
    [
        ("<A>Paris</A>", "Paris"),
        ("<A>{your answer}</A> I believe the answer is Paris.", "Paris"),  # the placeholder, then words
        ("So the answer: the Eiffel Tower", "the Eiffel Tower"),
        ("The capital is Paris. It is Paris.", "It is Paris"),  # else the last sentence
        ("", None),
    ],
)
def test_span_replies(reply, span):
    assert extract_span(reply) == span


def test_a_conversation_answers_with_its_last_reply_that_names_one():
    replies = ["The answer is option A.", "Hmm, I am not sure.", "Thanks!"]
    assert reply_answer(replies, "choice", OPTIONS) == "A"
    assert reply_answer(["It is 4.", "No, it is 5."], "number") == "5"
    assert reply_answer([], "number") is None
    with pytest.raises(ValueError, match="unknown score type"):
        reply_answer(["x"], "nope")


ARC = Example("arc-1", "arc", "?", "sand", "choice", options=OPTIONS)


def record(final: str, status: str, replies: list[str], sample: int = 0, example: Example = ARC) -> dict:
    return {
        "task_id": example.id,
        "sample_index": sample,
        "final_answer": final,
        "status": status,
        "token_count": 10,
        "example": example.to_dict(),
        "utterances": [{"speaker": "Alice", "text": text, "tokens": 5} for text in replies],
    }


def test_a_record_has_its_strict_answer_first_and_none_when_cut():
    assert flexible_answer(record("D) ice", "ok", ["<A>D) ice</A> but the answer is C."])) == "D) ice"
    assert flexible_answer(record("", "ok", ["<A>{letter}) {option text}</A> The answer is C."])) == "C"
    assert flexible_answer(record("", "too_long", ["The answer is C."])) is None  # cut: no answer at all
    assert flexible_answer(record("", "error", ["The answer is C."])) is None


def test_strict_and_flexible_columns_of_a_method_row():
    records = [
        record("", "ok", ["The correct answer is option C."], sample=0),
        record("", "ok", ["I pick C."], sample=1),
        record("A) water", "ok", ["<A>A) water</A>"], sample=2),
    ]
    scorer = RecordScorer()
    summary = summarize_records(records, scorer)
    assert summary["accuracy"] == 0.0 and summary["accuracy_flexible"] == pytest.approx(2 / 3, abs=1e-4)
    assert summary["answer_rate"] == pytest.approx(1 / 3, abs=1e-4) and summary["flexible_answer_rate"] == 1.0
    # Three samples of one question: the strict vote has only "A", the flexible one C (two votes against one).
    row = method_row(records, 3, scorer)
    assert row["accuracy"] == 0.0 and row["accuracy_flexible"] == 1.0
    assert row["answer_rate"] == pytest.approx(1 / 3, abs=1e-4) and row["flexible_answer_rate"] == 1.0
