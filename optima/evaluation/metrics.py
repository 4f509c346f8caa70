"""Scores of result files, pure (no server, no files): per-model metrics, the majority vote over samples
(self-consistency, CoT-SC, MAD's verdict) and the 95% interval (docs/method.md#metrics).

A conversation cut for length (``too_long``) or failed (``error``) scores 0 even if an earlier utterance stated an
answer; a question's score is the mean over its records, the metric the mean over questions. Every metric comes
strict (the answer format) and flexible (the answer named in words, ``optima.tasks.scoring``), as lm-eval-harness
reports ``strict-match`` beside ``flexible-extract``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from optima.agents.conversation import ConversationResult
from optima.reward import flexible_answer, has_answer, is_cut
from optima.store import group_by_question
from optima.tasks import Example, get_task
from optima.tasks.answers import PARSER_VERSION, PARSER_VERSION_KEY
from optima.tasks.math_equiv import MathVerifier
from optima.tasks.scoring import ScoreContext, is_current, score_by_type, score_example

Tokenize = Callable[[str], list[str]]
_FIRST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")  # gsm8k's ``accuracy_original``: the first number of the answer
TIMEOUTS = "verifier_timeouts"  # MATH: symbolic checks that timed out on every try, each scored 0
Z_95 = 1.959964  # two-sided 95% normal quantile


def metric_names(score_type: str) -> tuple[str, str]:
    """(our metric, its ``_original`` variant): F1 for ``f1`` tasks, accuracy for the others."""
    return ("f1", "f1_original_subword") if score_type == "f1" else ("accuracy", "accuracy_original")


def flexible_name(metric: str) -> str:
    """The key of a metric's flexible variant (``accuracy`` -> ``accuracy_flexible``)."""
    return f"{metric}_flexible"


def record_example(record: dict) -> Example:
    """The question a record was about (records carry it whole under ``example``)."""
    return Example.from_dict(record["example"])


@dataclass(frozen=True)
class RecordScorer:
    """Scores one record against its gold answer; 0 for too long, failed or unanswered ones.

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
        """Our score of the record's flexible answer (0 when it names none)."""
        answer = flexible_answer(record)
        return score_example(record_example(record), answer, verifier=self.verifier) if answer else 0.0


def verifier_timeouts(scorer: RecordScorer) -> int:
    """Timed-out symbolic checks of the scorer's MATH verifier so far (0 without one); take differences."""
    return scorer.verifier.timeouts if scorer.verifier is not None else 0


def with_timeouts(columns: Sequence[str], rows: Sequence[dict]) -> list[str]:
    """A table's ``columns`` plus ``verifier_timeouts`` when one of its rows carries it (MATH scores)."""
    return [*columns, TIMEOUTS] if any(TIMEOUTS in row for row in rows) else list(columns)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize_records(records: Sequence[dict], scorer: RecordScorer) -> dict:
    """Metrics of one result file: ``questions``, ``conversations``, the metric (strict, ``_original``, flexible),
    ``answer_rate`` and ``flexible_answer_rate``, ``mean_tokens`` (the paper's #Tok: every generated token, cut
    replies included) and ``mean_tokens_original`` (failed and too-long records add 0), ``cut_rate``,
    ``no_answer_rate``, ``too_long_rate``, ``error_rate``, and ``verifier_timeouts`` for MATH."""
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


@dataclass
class AnswerMatcher:
    """Whether two final answers of one question vote together (cached per pair): equal up to case and spaces, or
    the task's scorer says so with one in the gold's place (F1 >= ``cluster_f1``, the same option or number, MATH
    equivalence: docs/method.md, D29)."""

    example: Example
    cluster_f1: float = 0.9
    verifier: MathVerifier | None = None
    _cache: dict[tuple[str, str], bool] = field(default_factory=dict)

    def __call__(self, first: str, second: str) -> bool:
        if first.strip().casefold() == second.strip().casefold():
            return True
        key = (first, second)
        if key not in self._cache:
            context = ScoreContext(options=self.example.options, verifier=self.verifier)
            similarity = score_by_type(self.example.score_type, first, second, context)
            threshold = self.cluster_f1 if self.example.score_type == "f1" else 1.0
            self._cache[key] = similarity >= threshold
        return self._cache[key]


def cluster_answers(answers: Sequence[str | None], matcher: AnswerMatcher) -> list[list[list[int]]]:
    """Greedy vote clusters after each sample (element k-1: the clusters of the first k answers, as lists of sample
    positions in the order they were opened); an answer joins the first cluster holding a member it matches, and
    samples without an answer (None or "") do not vote. Incremental, so every k comes from one pass."""
    clusters: list[list[int]] = []
    history = []
    for position, answer in enumerate(answers):
        if answer:
            home = next((c for c in clusters if any(matcher(answer, answers[i]) for i in c)), None)
            if home is None:
                clusters.append([position])
            else:
                home.append(position)
        history.append([list(c) for c in clusters])
    return history


def majority_score(clusters: Sequence[Sequence[int]], scores: Sequence[float]) -> float:
    """Mean score of the largest cluster (the first opened on ties); 0 without any cluster."""
    if not clusters:
        return 0.0
    winner = max(clusters, key=len)  # max keeps the first of equal maxima: the earliest cluster
    return sum(scores[i] for i in winner) / len(winner)


def question_curves(
    group: Sequence[dict], max_k: int, scorer: RecordScorer, cluster_f1: float, flexible: bool = False
) -> list[tuple]:
    """(majority_vote, coverage, tokens, cut share) of one question for k = 1..min(max_k, samples)."""
    samples = list(group[:max_k])
    if flexible:
        scores, answers = [scorer.score_flexible(r) for r in samples], [flexible_answer(r) for r in samples]
    else:
        scores = [scorer.score(r) for r in samples]
        answers = [r["final_answer"] if has_answer(r) else None for r in samples]
    matcher = AnswerMatcher(record_example(samples[0]), cluster_f1, scorer.verifier)
    curves, tokens, cut = [], 0, 0
    for k, clusters in enumerate(cluster_answers(answers, matcher), start=1):
        tokens += samples[k - 1]["token_count"]
        cut += is_cut(samples[k - 1])
        curves.append((majority_score(clusters, scores), max(scores[:k]), tokens, cut / k))
    return curves


def analyze_self_consistency(
    records: Sequence[dict], max_k: int, scorer: RecordScorer, cluster_f1: float = 0.9, flexible: bool = False
) -> list[dict]:
    """One row per k = 1..K (``max_k`` capped by the most samples of a question), averaged over questions: the
    majority vote of the first k samples, their coverage (pass@k), summed tokens, cut share (``verifier_timeouts``
    for MATH); ``flexible``: the samples vote with their flexible answers."""
    before = verifier_timeouts(scorer)
    per_question = [question_curves(g, max_k, scorer, cluster_f1, flexible) for g in group_by_question(records)]
    if not per_question:
        return []
    math_task = record_example(records[0]).score_type == "math"
    timeouts = {TIMEOUTS: verifier_timeouts(scorer) - before} if math_task else {}
    rows = []
    for k in range(1, max(len(c) for c in per_question) + 1):
        at_k = [curve[min(k, len(curve)) - 1] for curve in per_question]
        rows.append(
            {
                "k": k,
                "majority_vote": round(sum(v for v, _, _, _ in at_k) / len(at_k), 4),
                "coverage": round(sum(c for _, c, _, _ in at_k) / len(at_k), 4),
                "tokens": round(sum(t for _, _, t, _ in at_k) / len(at_k), 2),
                "cut_rate": round(sum(x for _, _, _, x in at_k) / len(at_k), 4),
                "questions": len(at_k),
            }
            | timeouts
        )
    return rows


def method_row(records: list[dict], samples: int, scorer: RecordScorer, cluster_f1: float = 0.9) -> dict:
    """One comparison row: questions, the metric (strict and flexible), answer rates, tokens per question, cut and
    failure shares; a method with several samples per question scores their majority vote and costs their summed
    tokens."""
    before = verifier_timeouts(scorer)
    summary = summarize_records(records, scorer)
    if not summary["questions"]:
        return {"questions": 0}
    metric, _ = metric_names(record_example(records[0]).score_type)
    flexible = flexible_name(metric)
    row = {"questions": summary["questions"], metric: summary[metric], flexible: summary[flexible]}
    row |= {"mean_tokens": summary["mean_tokens"], "cut_rate": summary["cut_rate"]}
    if samples > 1:
        voted = analyze_self_consistency(records, samples, scorer, cluster_f1)[-1]
        voted_flexible = analyze_self_consistency(records, samples, scorer, cluster_f1, flexible=True)[-1]
        row |= {metric: voted["majority_vote"], flexible: voted_flexible["majority_vote"]}
        row["mean_tokens"] = voted["tokens"]
    row |= {"answer_rate": summary["answer_rate"], "flexible_answer_rate": summary["flexible_answer_rate"]}
    row |= {"too_long_rate": summary["too_long_rate"], "error_rate": summary["error_rate"]}
    return row | ({TIMEOUTS: verifier_timeouts(scorer) - before} if TIMEOUTS in summary else {})


def majority_answer(answers: Sequence[str | None], matcher: AnswerMatcher) -> str:
    """The answer of the largest vote cluster (the earliest cluster on ties); "" when nobody answered."""
    clusters = cluster_answers(answers, matcher)[-1] if answers else []
    if not clusters:
        return ""
    return answers[max(clusters, key=len)[0]] or ""


def settle_debate(
    result: ConversationResult, answers: Sequence[str | None], cut: Sequence[bool], matcher: AnswerMatcher
) -> ConversationResult:
    """A finished debate's final answer (the last round's majority) and status (``too_long`` when nobody answered
    and a last-round reply was cut)."""
    result.final_answer = majority_answer(answers, matcher)
    too_long = not result.final_answer and any(cut)
    result.status, result.stop_reason = ("too_long", "too_long") if too_long else ("ok", "majority")
    return result


def reparsed_debate(record: dict, cluster_f1: float) -> dict:
    """A debate row with its last round parsed and voted again by the current parser (a failed one as it is)."""
    if is_current(record) or record.get("status") == "error":
        return record
    agents = record["debate"]["agents"]
    last_round = [u["text"] for u in record["utterances"][-agents:]]
    cut = record["debate"].get("final_cut") or [False] * agents  # rows written before it was recorded: none
    task = get_task(record.get("task") or record["example"]["task"])
    answers = [None if was_cut else task.parse_answer(text) for text, was_cut in zip(last_round, cut, strict=True)]
    result = settle_debate(ConversationResult(), answers, cut, AnswerMatcher(record_example(record), cluster_f1))
    fresh = {"final_answer": result.final_answer, "status": result.status, "stop_reason": result.stop_reason}
    return record | fresh | {PARSER_VERSION_KEY: PARSER_VERSION}


def wilson_interval(successes: float, total: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ((0, 1) when ``total`` is 0; for F1 tasks ``successes`` is the
    summed score, and the interval an approximation)."""
    if total <= 0:
        return 0.0, 1.0
    share = successes / total
    centre = (share + z * z / (2 * total)) / (1 + z * z / total)
    half = z / (1 + z * z / total) * math.sqrt(share * (1 - share) / total + z * z / (4 * total * total))
    return max(0.0, centre - half), min(1.0, centre + half)
