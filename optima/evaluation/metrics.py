"""Per-model evaluation metrics from conversation records (docs/method.md#metrics), pure: no server, no files.

For one result file (one JSONL record per conversation, as ``generate_conversations`` writes it) this computes:

* the task metric, in two variants named after what they compute:
  - ``f1`` (SQuAD word F1) and ``f1_original_subword`` (a bag-of-subword F1 with the model tokenizer,
    docs/method.md D16) for the four information-exchange tasks;
  - ``accuracy`` and ``accuracy_original`` for the four debate tasks. ``accuracy_original`` (docs/method.md#metrics)
    is option-text equality for arc/mmlu ("B) text" read as "text"), the *first number* of the final answer for
    gsm8k (its eval-only ``gsm8k`` score type), and symbolic equivalence for math (as ours);
* ``<metric>_flexible`` (``accuracy_flexible``, ``f1_flexible``): the same score of the *flexible* answer, as
  lm-eval-harness reports ``flexible-extract`` beside ``strict-match``: the strict answer (the tag) when there is
  one, else what the replies name in words (an option, the last number, the last sentence:
  ``optima.tasks.flexible``), so a model that answers outside the format is not scored as if it had not answered;
  ``answer_rate`` and ``flexible_answer_rate`` are the shares of records with a strict / flexible answer;
* ``mean_tokens``: the paper's #Tok, the mean ``token_count`` per question (every generated token, cut replies
  included: docs/method.md#token-count), and ``mean_tokens_original``: the same mean where too-long and
  failed conversations add 0 tokens but still count in the denominator;
* ``cut_rate``: the share of records with a reply cut at ``max_tokens`` (a cut MAD debate may still answer), shown
  beside the tokens in every table;
* ``no_answer_rate`` (too long, failed, or no parsed answer), ``too_long_rate`` and ``error_rate``;
* ``verifier_timeouts`` (MATH only): symbolic checks that timed out on every try while this summary was computed,
  each scored 0 (``MathVerifier.timeouts``); every table with a MATH score shows it (``with_timeouts``).

A conversation that was cut for length (``too_long``) or failed (``error``) scores 0 even if an
earlier utterance stated an answer; a question's score is the mean over its conversations, and the metric is the
mean over questions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from optima.reward import flexible_answer, has_answer, is_cut
from optima.store import group_by_question
from optima.tasks import Example
from optima.tasks.math_equiv import MathVerifier
from optima.tasks.scoring import score_example

Tokenize = Callable[[str], list[str]]
# First number of a final answer: the eval-only ``gsm8k`` score type of ``accuracy_original``.
_FIRST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def metric_names(score_type: str) -> tuple[str, str]:
    """(our metric, its ``_original`` variant) for a score type: F1 for ``f1`` tasks, accuracy for the others.

    Args:
        score_type: ``f1``, ``choice``, ``number`` or ``math``.
    """
    return ("f1", "f1_original_subword") if score_type == "f1" else ("accuracy", "accuracy_original")


def flexible_name(metric: str) -> str:
    """The key of a metric's flexible variant (``accuracy`` -> ``accuracy_flexible``)."""
    return f"{metric}_flexible"


def record_example(record: dict) -> Example:
    """The question a record was about (records carry it whole under ``example``)."""
    return Example.from_dict(record["example"])


@dataclass(frozen=True)
class RecordScorer:
    """Scores one conversation record against its gold answer; 0 for too long, failed or unanswered ones.

    Args:
        tokenize: The model tokenizer's ``tokenize`` (needed for ``f1_original_subword`` only).
        verifier: A shared ``MathVerifier`` (math tasks).
    """

    tokenize: Tokenize | None = None
    verifier: MathVerifier | None = None

    def score(self, record: dict, original: bool = False) -> float:
        """Our score (``original=False``) or the ``_original`` variant's score of ``record``."""
        if not has_answer(record):
            return 0.0
        example, prediction = record_example(record), record["final_answer"]
        if not original:
            return score_example(example, prediction, verifier=self.verifier)
        if example.score_type == "number":
            match = _FIRST_NUMBER.search(prediction)
            return float(match is not None and match.group(0) == example.answers[0].strip().lower())
        if example.score_type == "f1" and self.tokenize is None:
            raise ValueError("f1_original_subword needs the model tokenizer's tokenize function")
        return score_example(example, prediction, "original", self.tokenize, verifier=self.verifier)

    def score_flexible(self, record: dict) -> float:
        """Our score of the record's flexible answer (``optima.reward.flexible_answer``; 0 when it names none)."""
        answer = flexible_answer(record)
        return score_example(record_example(record), answer, verifier=self.verifier) if answer else 0.0


TIMEOUTS = "verifier_timeouts"


def verifier_timeouts(scorer: RecordScorer) -> int:
    """Timed-out symbolic checks of the scorer's MATH verifier so far (0 without one); take differences."""
    return scorer.verifier.timeouts if scorer.verifier is not None else 0


def with_timeouts(columns: Sequence[str], rows: Sequence[dict]) -> list[str]:
    """A table's ``columns`` plus ``verifier_timeouts`` when one of its rows carries it (MATH scores)."""
    return [*columns, TIMEOUTS] if any(TIMEOUTS in row for row in rows) else list(columns)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize_records(records: Sequence[dict], scorer: RecordScorer) -> dict:
    """Metrics of one model's result file (see the module docstring for each key).

    Args:
        records: Conversation records (any number per question).
        scorer: Scores a record (ours and its ``_original`` variant).

    Returns:
        ``{"questions", "conversations", <metric>, <metric>_original..., <metric>_flexible, "answer_rate",
        "flexible_answer_rate", "mean_tokens", "mean_tokens_original", "cut_rate", "no_answer_rate",
        "too_long_rate", "error_rate"}`` and ``verifier_timeouts`` for MATH; the metric keys follow ``metric_names``
        and ``flexible_name``.
    """
    groups = group_by_question(records)
    if not groups:
        return {"questions": 0, "conversations": 0}
    before = verifier_timeouts(scorer)
    score_type = record_example(groups[0][0]).score_type
    name, original_name = metric_names(score_type)
    ours = [_mean([scorer.score(r) for r in group]) for group in groups]
    theirs = [_mean([scorer.score(r, original=True) for r in group]) for group in groups]
    flexible = [_mean([scorer.score_flexible(r) for r in group]) for group in groups]
    tokens = [_mean([r["token_count"] for r in group]) for group in groups]
    # The ``_original`` variant leaves too long and failed results out of the token sum but not out of the count.
    tokens_original = [_mean([r["token_count"] if r["status"] == "ok" else 0 for r in group]) for group in groups]
    count = len(records)
    timeouts = {TIMEOUTS: verifier_timeouts(scorer) - before} if score_type == "math" else {}
    return {
        "questions": len(groups),
        "conversations": count,
        name: round(_mean(ours), 4),
        original_name: round(_mean(theirs), 4),
        flexible_name(name): round(_mean(flexible), 4),
        "answer_rate": round(sum(has_answer(r) for r in records) / count, 4),
        "flexible_answer_rate": round(sum(flexible_answer(r) is not None for r in records) / count, 4),
        "mean_tokens": round(_mean(tokens), 2),
        "mean_tokens_original": round(_mean(tokens_original), 2),
        "cut_rate": round(sum(is_cut(r) for r in records) / count, 4),
        "no_answer_rate": round(sum(not has_answer(r) for r in records) / count, 4),
        "too_long_rate": round(sum(r["status"] == "too_long" for r in records) / count, 4),
        "error_rate": round(sum(r["status"] == "error" for r in records) / count, 4),
    } | timeouts
