"""Tests for answer parsing and task scores (optima/tasks/answers.py, scoring.py, math_equiv.py;
docs/method.md#scoring)."""

from __future__ import annotations

import concurrent.futures
import logging
import time

import pytest

from optima.tasks import TASKS, get_task
from optima.tasks.answers import (
    AnswerTracker,
    normalize_final_answer,
    parse_boxed,
    parse_math_answer,
    parse_tag,
    render_answer,
    should_stop,
)
from optima.tasks.math_equiv import (
    MathVerifier,
    fast_equivalence,
    numeric_value,
    symbolic_backend_available,
    symbolic_check,
)
from optima.tasks.scoring import (
    ScoreContext,
    resolve_choice,
    score_answer,
    score_by_type,
    score_example,
    squad_f1,
    subword_f1,
)
from tests._task_fixtures import echo_check, hanging_check, resolve_test_data_dir, slow_once_check, timed_out_check

HUGE = 100_000


@pytest.fixture(scope="module")
def data_dir():
    path = resolve_test_data_dir()
    if not path.is_dir():
        pytest.skip(f"dataset samples not found at {path} (the repository's data/, or OPTIMA_DATA_DIR)")
    return path


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(max_workers=2, timeout_s=5) as shared:
        yield shared


# ---------------------------------------------------------------- parsers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<A>Paris</A>", "Paris"),
        ("first <A>a</A> then <A>b</A>", "b"),
        ("<A>  spaced  </A>", "spaced"),
        ("<A>\nmulti\nline\n</A>", "multi\nline"),
        ("<A></A>", ""),
        ("<A>unclosed", None),
        ("closed only</A>", None),
        ("</A> reversed <A>", None),
        ("<A>x</A> trailing <A>y", "x"),
        ("<A><A>nested</A>", "nested"),
        ("<a>lower case</a>", None),
        ("<A>Zürich – 東京 🙂</A>", "Zürich – 東京 🙂"),
        ("\x00\ufffd<A>\udcff\x7f</A>", "\udcff\x7f"),
        ("", None),
        (None, None),
    ],
)
def test_parse_tag(text, expected):
    assert parse_tag(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{5}.", "5"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{{a}{b}}", "{a}{b}"),
        ("\\boxed{x} }", "x"),
        ("\\boxed{}", ""),
        ("\\boxed{\\frac{1}{2}", None),
        ("\\boxed{1} and \\boxed{", None),
        ("no box here", None),
        ("\\boxed{√2 ≈ 1.41}", "√2 ≈ 1.41"),
        ("", None),
        (None, None),
    ],
)
def test_parse_boxed(text, expected):
    assert parse_boxed(text) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("5", "5"),
        ("x = 5", "5"),
        ("1,000", "1000"),
        ("1,2", "1,2"),  # a list, not twelve (Minerva dropped every comma of a digit string)
        ("12,345,678", "12345678"),
        ("\\$18", "18"),
        ("18 dollars", "18"),
        ("5 square feet", "5"),
        ("\\text{(A)}", "(A)"),
        ("\\textbf{7}", "7"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("$x^2$", "x^2"),
        ("90^\\circ", "90"),
        ("\\left( 1, 2 \\right)", "\\left(1,2\\right)"),
        ("an apple", "apple"),
        ("mean", "mean"),
        ("(1,2) \\text{ and } (3,4)", "(1,2),(3,4)"),
        ("", ""),
    ],
)
def test_normalize_final_answer(raw, expected):
    assert normalize_final_answer(raw) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("\\frac9{19}", "\\frac{9}{19}"),  # Minerva's rewrite made it \\frac{9}{{}19}
        ("\\sqrt[4]{8}", "\\sqrt[4]{8}"),  # Minerva's rewrite made it \\sqrt{[}4]{8}
        ("\\frac92", "\\frac{9}{2}"),
        ("\\dfrac\\pi2", "\\dfrac{\\pi}{2}"),
        ("\\frac1{\\sqrt3}", "\\frac{1}{\\sqrt{3}}"),
        ("\\sqrt\\pi", "\\sqrt{\\pi}"),
        ("\\frac{3}{4}", "\\frac{3}{4}"),
        ("2\\sqrt{2}", "2\\sqrt{2}"),
        ("\\frac", "\\frac"),
    ],
)
def test_normalize_final_answer_expands_shorthand_without_breaking_it(raw, expected):
    assert normalize_final_answer(raw) == expected


@pytest.mark.parametrize(
    ("prediction", "gold"),
    [("\\frac9{19}", "\\frac{9}{19}"), ("\\sqrt[4]{8}", "\\sqrt[4]{8}"), ("\\frac{9}{19}", "\\frac9{19}")],
)
def test_right_shorthand_answers_score(prediction, gold):
    assert score_answer("math", parse_math_answer(f"\\boxed{{{prediction}}}"), normalize_final_answer(gold)) == 1.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Total: \\boxed{1,000} dollars", "1000"),
        ("\\boxed{x = \\frac12}", "\\frac{1}{2}"),
        ("\\boxed{\\text{Monday}}", "Monday"),
        ("no answer", None),
        ("\\boxed{3", None),
    ],
)
def test_parse_math_answer(text, expected):
    assert parse_math_answer(text) == expected


@pytest.mark.parametrize("style", ["tag", "boxed"])
def test_render_then_parse_round_trip(style):
    task = TASKS["arc"] if style == "tag" else TASKS["gsm8k"]
    assert task.parse_answer("work... " + render_answer("42", style)) == "42"


def test_render_answer_rejects_unknown_style():
    with pytest.raises(ValueError, match="answer_style"):
        render_answer("1", "xml")


@pytest.mark.parametrize(
    "text",
    [
        "<A>" * (HUGE // 3),
        "</A>" * (HUGE // 4),
        "\\boxed{" * (HUGE // 7),
        "{" * HUGE,
        "\\text{" * (HUGE // 6),
        "$" * HUGE,
        "a " * (HUGE // 2),
        "x" * HUGE + "<A>end</A>",
        "\\boxed{" + "{}" * (HUGE // 2) + "}",
    ],
)
def test_parsers_and_scorers_are_fast_on_huge_output(text):
    start = time.perf_counter()
    parse_tag(text)
    parse_boxed(text)
    parse_math_answer(text)
    normalize_final_answer(text)
    squad_f1(text, "gold answer")
    score_by_type("number", text, "42", ScoreContext())
    score_by_type("choice", text, "copper", ScoreContext(options=(("A", "copper"), ("B", "iron"))))
    fast_equivalence(text, "42")
    assert time.perf_counter() - start < 2.0


# ---------------------------------------------------------------- stop rule


@pytest.mark.parametrize(
    ("answers", "stop_at", "final"),
    [
        (["X", None, "X"], 2, "X"),
        (["X", "X"], 1, "X"),
        (["X", "Y", "X", "X"], 3, "X"),
        (["X", "Y", "Z"], None, "Z"),
        ([None, "", None], None, ""),
        (["", "X", "", "X"], 3, "X"),
    ],
)
def test_answer_tracker(answers, stop_at, final):
    tracker = AnswerTracker()
    stops = [index for index, answer in enumerate(answers) if tracker.update(answer)]
    assert (stops[0] if stops else None) == stop_at
    assert tracker.final_answer == final


@pytest.mark.parametrize(
    ("previous", "new", "expected"),
    [("X", "X", True), ("X", "Y", False), ("", "", False), ("X", None, False), (None, None, False), ("", "X", False)],
)
def test_should_stop(previous, new, expected):
    assert should_stop(previous, new) is expected


# ---------------------------------------------------------------- F1


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        ("Paris", "paris", 1.0),
        ("The Paris.", "paris", 1.0),
        ("Paris France", "Paris", 2 / 3),
        ("London", "Paris", 0.0),
        ("a the an", "Paris", 0.0),
        ("Zürich", "zürich", 1.0),
        ("", "Paris", 0.0),
    ],
)
def test_squad_f1(prediction, gold, expected):
    assert squad_f1(prediction, gold) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        ("Paris", "paris", 1.0),
        ("the cat", "cat", 2 / 3),  # no SQuAD normalisation: "the" counts
        ("Miami", "iami", 1.0),  # the original character-set strip eats the leading "m"
        ("m", "Paris", 0.0),
    ],
)
def test_subword_f1_reproduces_original(prediction, gold, expected):
    assert subword_f1(prediction, gold, tokenize=str.split) == pytest.approx(expected)


def test_original_f1_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenize"):
        score_answer("hotpot_qa", "Paris", "Paris", ScoreContext(mode="original"))
    assert score_answer("hotpot_qa", "Paris", "paris", ScoreContext(mode="original", tokenize=list)) == 1.0


def test_aliases_take_the_maximum():
    aliases = ("Lauren Bacall", "Bacall", "Betty Joan Perske")
    assert score_answer("trivia_qa", "Bacall", aliases) == 1.0
    assert score_answer("trival_qa", "Betty Perske", aliases) == pytest.approx(0.8)


# ---------------------------------------------------------------- multiple choice

ARC_OPTIONS = (("A", "faster"), ("B", "made safer"), ("C", "look nicer"), ("D", "cheaper"))
MMLU_OPTIONS = (("A", "1"), ("B", "2"), ("C", "2,3"), ("D", "6"))
NUMERIC_OPTIONS = (("1", "copper"), ("2", "iron"), ("3", "1.5 m"), ("4", "wood"))


@pytest.mark.parametrize(
    ("prediction", "options", "gold", "expected"),
    [
        ("B", ARC_OPTIONS, "made safer", 1.0),
        ("b", ARC_OPTIONS, "made safer", 1.0),
        ("(B)", ARC_OPTIONS, "made safer", 1.0),
        ("B.", ARC_OPTIONS, "made safer", 1.0),
        ("B) made safer", ARC_OPTIONS, "made safer", 1.0),
        ("(B) made safer", ARC_OPTIONS, "made safer", 1.0),
        ("Option B", ARC_OPTIONS, "made safer", 1.0),
        ("Answer: B", ARC_OPTIONS, "made safer", 1.0),
        ("  Made   SAFER. ", ARC_OPTIONS, "made safer", 1.0),
        ("A", ARC_OPTIONS, "made safer", 0.0),
        ("E", ARC_OPTIONS, "made safer", 0.0),
        ("made safer and faster", ARC_OPTIONS, "made safer", 0.0),
        ("C", MMLU_OPTIONS, "2,3", 1.0),
        ("2,3", MMLU_OPTIONS, "2,3", 1.0),
        ("2", MMLU_OPTIONS, "2,3", 0.0),  # the text of option B, not label "2"
        ("1", NUMERIC_OPTIONS, "copper", 1.0),
        ("1.5 m", NUMERIC_OPTIONS, "1.5 m", 1.0),
        ("1.5 m", NUMERIC_OPTIONS, "copper", 0.0),
        ("🙂", ARC_OPTIONS, "made safer", 0.0),
    ],
)
def test_score_choice(prediction, options, gold, expected):
    assert score_by_type("choice", prediction, gold, ScoreContext(options=options)) == expected


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [
        ("made safer", 1.0),
        ("Made Safer ", 1.0),
        ("made safer\\", 1.0),  # the original strips backslashes from the prediction
        ("B) made safer", 1.0),  # the prompt asks for "letter) text": the text after the label is compared
        ("b)  Made Safer", 1.0),
        ("A) made safer", 1.0),  # the original compared texts only: the label is not checked
        ("B) look nicer", 0.0),
        ("E) made safer", 0.0),  # no option E: no label to remove
        ("(B) made safer", 0.0),  # not the prompt's form
        ("B) made safer.", 0.0),  # no trailing period forgiven
        ("made safer.", 0.0),
        ("B", 0.0),
        ("B)", 0.0),
    ],
)
def test_score_choice_original_mode_is_the_originals_exact_match(prediction, expected):
    context = ScoreContext(mode="original", options=ARC_OPTIONS)
    assert score_by_type("choice", prediction, "made safer", context) == expected


def test_resolve_choice_prefers_text_over_label():
    assert resolve_choice("1", MMLU_OPTIONS) == "A"
    assert resolve_choice("D", MMLU_OPTIONS) == "D"
    assert resolve_choice("nonsense", MMLU_OPTIONS) is None


# ---------------------------------------------------------------- numbers and math


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        ("1000", "1000", 1.0),
        ("1,000", "1000", 1.0),
        ("1000.0", "1,000", 1.0),
        ("\\$1,000", "1000", 1.0),
        ("-3", "-3", 1.0),
        ("1000.5", "1000", 0.0),
        ("abc", "1", 0.0),
        ("9" * 5000, "1", 0.0),
        ("1e400", "1", 0.0),
        ("70%", "70", 1.0),  # a percentage question: GSM8K's gold has no sign
        ("70\\%", "70", 1.0),
        ("70%", "7", 0.0),
        ("-1, 2", "-12", 0.0),  # two numbers are not one
        ("1,2", "12", 0.0),
        ("-1,000", "-1000", 1.0),
    ],
)
def test_score_number(prediction, gold, expected):
    assert score_answer("gsm8k", prediction, gold) == expected


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [("1000", "1000", 1.0), ("1,000", "1000", 0.0), (" 18\\", "18", 1.0), ("X", "x", 1.0)],
)
def test_score_number_original_mode_is_string_equality(prediction, gold, expected):
    assert score_answer("gsm8k", prediction, gold, ScoreContext(mode="original")) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3", 3),
        ("-2.5", -2.5),
        ("1/4", 0.25),
        ("\\frac{3}{4}", 0.75),
        ("-\\frac{1}{2}", -0.5),
        ("x", None),
        ("1/0", None),
        ("1,000", 1000),
        ("-12,345.5", -12345.5),
        ("-1,2", None),  # a list: the comma does not group thousands
        ("1,23", None),
    ],
)
def test_numeric_value(text, expected):
    value = numeric_value(text)
    assert (value is None) if expected is None else value == pytest.approx(expected)


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac{1}{2}", "\\frac12", True),
        ("\\left(1,2\\right)", "(1, 2)", True),
        ("2", "3", False),
        ("90^\\circ", "90", True),
        ("x+1", "1+x", None),
        ("-1, 2", "-12", None),  # never equal as numbers: left to the symbolic check
        ("1, 2", "12", None),
        ("\\frac9{19}", "\\frac{9}{19}", True),
        ("\\sqrt[4]{8}", "\\sqrt[4]{8}", True),
        ("\\frac12", "0.5", True),
    ],
)
def test_fast_equivalence(prediction, gold, expected):
    assert fast_equivalence(prediction, gold) is expected


def test_math_verifier_hard_deadline_recycles_the_pool():
    with MathVerifier(max_workers=1, timeout_s=1, check=hanging_check, hard_timeout_s=1.0) as hanging:
        start = time.perf_counter()
        assert hanging.symbolic_equal("a", "b") is False
        assert time.perf_counter() - start < 30  # two tries of 1 s, each in a fresh pool
        assert hanging.timeouts == 1  # timed out twice: counted, not only logged
    with MathVerifier(max_workers=1, check=echo_check) as echo:
        assert echo.is_equivalent("x+y", "x+y") is True
        assert echo.is_equivalent("x+y", "y+x") is False


def test_a_timed_out_math_check_is_tried_once_more_then_counted(tmp_path):
    tries = tmp_path / "tries"
    with MathVerifier(max_workers=1, check=timed_out_check) as verifier:
        assert verifier.symbolic_equal("x", str(tries)) is False
        assert verifier.timeouts == 1
        assert verifier.symbolic_equal("y", str(tries)) is False
        assert verifier.timeouts == 2
    assert tries.read_text().count("try") == 4  # each check: its first try and one more
    with MathVerifier(max_workers=1, check=slow_once_check) as verifier:
        assert verifier.symbolic_equal("x", str(tmp_path / "once")) is True
        assert verifier.timeouts == 0  # the second try answered


def test_symbolic_check_reads_the_timeout_math_verify_only_logs(monkeypatch):
    math_verify = pytest.importorskip("math_verify")

    def timing_out_parse(text, parsing_timeout):
        logging.getLogger("math_verify.parser").warning("Timeout during parsing: %s", text)
        return []

    monkeypatch.setattr(math_verify, "parse", timing_out_parse)
    assert symbolic_check("x", "y", 1) is None  # undecided, not "not equivalent"
    monkeypatch.setattr(math_verify, "parse", lambda text, parsing_timeout: [])
    assert symbolic_check("x", "y", 1) is False


@pytest.mark.skipif(not symbolic_backend_available(), reason="math-verify is not installed")
@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        ("x+1", "1+x", 1.0),
        ("\\sqrt{8}", "2\\sqrt{2}", 1.0),
        ("\\frac{\\pi}{2}", "\\pi/2", 1.0),
        ("x+2", "x+1", 0.0),
        ("\\frac{", "1", 0.0),
        ("", "1", 0.0),
    ],
)
def test_score_math_symbolic(verifier, prediction, gold, expected):
    assert score_answer("math", prediction, gold, ScoreContext(verifier=verifier)) == expected


@pytest.mark.skipif(not symbolic_backend_available(), reason="math-verify is not installed")
def test_math_verifier_works_from_threads(verifier):
    cases = [("x+1", "1+x", True), ("2x", "x*2", True), ("x^2", "x^3", False)] * 4
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda case: verifier.is_equivalent(case[0], case[1]), cases))
    assert results == [expected for _, _, expected in cases]


# ---------------------------------------------------------------- dispatch and real gold answers


def test_score_answer_rejects_bad_mode_and_unknown_task():
    with pytest.raises(ValueError, match="mode"):
        score_answer("gsm8k", "1", "1", ScoreContext(mode="strict"))
    with pytest.raises(KeyError, match="valid names"):
        score_answer("nope", "1", "1")


@pytest.mark.parametrize("prediction", [None, ""])
@pytest.mark.parametrize("task_name", sorted(set(TASKS) - {"mix"}))
def test_missing_prediction_scores_zero(task_name, prediction):
    assert score_answer(task_name, prediction, "anything") == 0.0


@pytest.mark.parametrize("task_name", ["gsm8k", "math", "arc", "mmlu"])
def test_every_gold_answer_scores_one_after_rendering(data_dir, verifier, task_name):
    task = get_task(task_name)
    examples = task.load(task.train_split, data_dir=data_dir) + task.load(task.eval_split, data_dir=data_dir)
    failures = []
    for example in examples:
        utterance = f"Alice: step one, step two. {task.render_answer(example.answer)}"
        if score_example(example, task.parse_answer(utterance), verifier=verifier) != 1.0:
            failures.append((example.id, example.answer))
    assert not failures, failures[:10]


GARBAGE = [
    "",
    "\x00\x01\x02",
    "<A></A>",
    "<A>" + "\ufffd" * 50 + "</A>",
    "\\boxed{",
    "\\boxed{\\boxed{\\boxed{}}}",
    bytes(range(256)).decode("latin-1"),
    "🙂" * 1000,
    "<A>zzzz qqqq</A> \\boxed{zzzz}",
]


@pytest.mark.parametrize("task_name", ["hotpot_qa", "mwh_qa", "trival_qa", "cbt", "gsm8k", "math", "arc", "mmlu"])
def test_garbage_scores_zero(data_dir, verifier, task_name):
    task = get_task(task_name)
    for example in task.load(task.eval_split, data_dir=data_dir)[:20]:
        for text in GARBAGE:
            assert score_example(example, task.parse_answer(text), verifier=verifier) == 0.0


@pytest.mark.parametrize(
    ("text", "expected"), [("70%", "70"), ("70\\%", "70"), ("[10\\%,20\\%]", "[10,20]"), ("7", "7")]
)
def test_one_percent_rule_for_numbers_and_math_strings(text, expected):
    from optima.tasks.answers import without_percent
    from optima.tasks.math_equiv import canonical_answer

    assert without_percent(text) == expected
    assert canonical_answer(text) == canonical_answer(expected)
