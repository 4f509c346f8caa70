"""Self-consistency analysis: majority vote, coverage and token cost for k = 1..K samples.

See docs/method.md#self-consistency.

For each question the first k samples (by ``sample_index``) are taken and three numbers computed, then averaged
over questions:

* ``majority_vote``: the samples' final answers are clustered greedily, in sample order: an answer joins the first
  cluster holding a member it matches, else it opens a new cluster. The largest cluster wins (ties go to the
  cluster opened first) and scores the mean task score of its members. Samples without an answer (too long,
  failed, nothing parsed) do not vote; a question where no sample answered scores 0.
* ``coverage``: the best task score among the k samples (oracle, pass@k).
* ``tokens``: the summed ``token_count`` of the k samples (the cost of the k conversations, cut replies included);
* ``cut_rate``: the share of the k samples with a reply cut at ``max_tokens``.

Two answers match when they are the same string up to case and surrounding spaces, or when the task's scorer
says so with one answer taking the place of the gold: word F1 >= ``cluster_f1`` (0.9) for F1 tasks, the same
option for multiple choice (label or text), the same number for gsm8k, and symbolic equivalence
(``MathVerifier``) for math, so equivalent forms such as ``\\frac{1}{2}`` and ``0.5`` vote together
(docs/method.md, D29).

Greedy clustering in sample order is incremental (the clusters of k + 1 samples are those of k plus one answer),
so every k is computed in one pass per question.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from optima.evaluation.metrics import TIMEOUTS, RecordScorer, record_example, verifier_timeouts
from optima.reward import flexible_answer, has_answer, is_cut
from optima.store import group_by_question
from optima.tasks import Example
from optima.tasks.math_equiv import MathVerifier
from optima.tasks.scoring import ScoreContext, score_by_type


@dataclass
class AnswerMatcher:
    """Decides whether two final answers of one question vote together (cached per pair).

    Args:
        example: The question (its score type and options).
        cluster_f1: F1 at or above which two answers of an F1 task match.
        verifier: Shared ``MathVerifier`` (math).
    """

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
    """Greedy vote clusters after each sample: element k-1 holds the clusters of the first k answers.

    Args:
        answers: Final answers in sample order (None or "" for samples that do not vote).
        matcher: Whether two answers match.

    Returns:
        For each prefix, the clusters (lists of sample positions) in the order they were opened.
    """
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
    """(majority_vote, coverage, tokens, cut share) of one question for k = 1..min(max_k, samples).

    With ``flexible`` the samples vote with their flexible answers (``optima.reward.flexible_answer``).
    """
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
    """Majority vote, coverage and tokens per question, averaged over questions, for k = 1..K.

    K is ``max_k`` capped by the largest number of samples of any question; a question with fewer samples than k
    uses all of its samples.

    Args:
        records: Sample records of one model and method (several per question).
        max_k: Largest k to report.
        scorer: Scores a record against its gold answer (its verifier also matches math answers).
        cluster_f1: F1 at or above which two answers of an F1 task vote together.
        flexible: Vote with the flexible answers (strict ones where there are) instead of the strict ones.

    Returns:
        One row per k: ``{"k", "majority_vote", "coverage", "tokens", "cut_rate", "questions"}`` (tokens: mean per
        question of the summed tokens of its k samples; cut_rate: mean per question of its cut share), and for MATH
        ``verifier_timeouts``: the symbolic checks that timed out over the whole analysis (each scored 0).
    """
    before = verifier_timeouts(scorer)
    groups = group_by_question(records)
    per_question = [question_curves(group, max_k, scorer, cluster_f1, flexible) for group in groups]
    if not per_question:
        return []
    math = record_example(records[0]).score_type == "math"
    timeouts = {TIMEOUTS: verifier_timeouts(scorer) - before} if math else {}
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
