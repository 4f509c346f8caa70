"""The methods an evaluation can run on one served model, and one summary row per method (paper Table 1 rows).

    optima      Optima's two-agent conversation, greedy (the sweep's file; the trained checkpoints' rows)
    optima_sc   ``samples`` Optima conversations at ``temperature``, majority vote (the paper's Optima + SC rows)
    cot         one agent, chain of thought, greedy                          (``optima.evaluation.cot``)
    cot_sc      ``samples`` CoT answers at ``temperature``, majority vote     (``optima.evaluation.voting``)
    mad         multi-agent debate at ``temperature``, majority of the agents (``optima.evaluation.debate``)
    autoform    Optima's conversation loop, non-natural-language format rule, greedy (``optima.evaluation.autoform``)
    autoform_sc ``samples`` AutoForm conversations at ``temperature`` (the self-consistency script's variant)

Each method fills ``<output>/<model>.<method>.jsonl`` (resumable, one record per conversation, debate or answer;
its producer's fingerprint beside it: ``optima.evaluation.fingerprint``) and is summarised by the same scorer: the
task metric (majority vote over the samples for sampled methods), the answer rate, and the tokens per question (all
samples, agents and rounds of a question summed, cut replies included) beside the share of records with a cut reply
(``cut_rate``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from optima.agents.runner import GenerationSettings
from optima.config import RecipeError
from optima.evaluation.autoform import autoform_request_texts, generate_autoform
from optima.evaluation.cot import build_cot_messages, generate_cot_answers
from optima.evaluation.debate import DebateSettings, debate_prompts, generate_debates
from optima.evaluation.metrics import (
    TIMEOUTS,
    RecordScorer,
    flexible_name,
    metric_names,
    record_example,
    summarize_records,
    verifier_timeouts,
)
from optima.evaluation.runs import GenerationJob
from optima.evaluation.voting import analyze_self_consistency

BASELINES = ("cot", "cot_sc", "mad", "autoform")
LABELS = {
    "optima": "Optima",
    "optima_sc": "Optima SC",
    "cot": "CoT",
    "cot_sc": "CoT-SC",
    "mad": "MAD",
    "autoform": "AutoForm",
    "autoform_sc": "AutoForm SC",
}
# Tokens and the share of records with a cut reply side by side (docs/method.md#token-count).
# Strict (the answer format) and flexible (``optima.tasks.flexible``) side by side, as lm-eval-harness shows them.
ROW_COLUMNS = ("method", "model", "questions", "{metric}", "{metric}_flexible", "answer_rate", "flexible_answer_rate",
               "mean_tokens", "cut_rate", "too_long_rate", "error_rate")  # fmt: skip


@dataclass(frozen=True)
class BaselineSettings:
    """How the sampled baselines sample.

    Args:
        samples: Answers per question of CoT-SC (and AutoForm SC, Optima SC); the paper's CoT-SC uses 8.
        temperature: Sampling temperature of CoT-SC, AutoForm SC, Optima SC and the debaters.
        debate: Agents, rounds and context of MAD.
    """

    samples: int = 8
    temperature: float = 0.5
    debate: DebateSettings = field(default_factory=DebateSettings)

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise RecipeError("samples", f"must be >= 1, got {self.samples}")
        if not 0 <= self.temperature <= 2:
            raise RecipeError("temperature", f"must be in [0, 2], got {self.temperature}")


def method_job(
    method: str, out_root: Path, name: str, settings: BaselineSettings, iteration: int = -1
) -> GenerationJob:
    """The result file of ``method`` on the model called ``name``: ``<out_root>/<name>.<method>.jsonl``.

    Args:
        method: One of ``LABELS``' keys.
        out_root: Output folder.
        name: The model's name (file prefix).
        settings: Samples, temperature and debate shape.
        iteration: Recorded iteration (part of every seed).
    """
    path, t = out_root / f"{name}.{method}.jsonl", settings.temperature
    if method == "optima":
        return GenerationJob(method, path, GenerationSettings(iteration, 0.0, 1, stage="eval"))
    if method == "optima_sc":
        return GenerationJob(method, path, GenerationSettings(iteration, t, settings.samples, stage="sc"))
    cot = {"generate": generate_cot_answers, "prompts": build_cot_messages}
    if method == "cot":
        return GenerationJob(method, path, GenerationSettings(iteration, 0.0, 1, stage="cot"), **cot)
    if method == "cot_sc":
        return GenerationJob(method, path, GenerationSettings(iteration, t, settings.samples, stage="cot_sc"), **cot)
    if method == "mad":
        debate = functools.partial(generate_debates, settings=settings.debate)
        shape = {"agents": settings.debate.agents, "rounds": settings.debate.rounds}  # the context: in the prompts
        prompts = functools.partial(debate_prompts, settings=settings.debate)
        generation = GenerationSettings(iteration, t, 1, stage="mad")
        return GenerationJob(method, path, generation, debate, shape, prompts, reads=("cluster_f1",))  # the vote
    autoform = {"generate": generate_autoform, "prompts": autoform_request_texts}
    if method == "autoform":
        return GenerationJob(method, path, GenerationSettings(iteration, 0.0, 1, stage="autoform"), **autoform)
    if method == "autoform_sc":
        generation = GenerationSettings(iteration, t, settings.samples, stage="autoform_sc")
        return GenerationJob(method, path, generation, **autoform)
    raise RecipeError("methods", f"unknown method {method!r}; choose from {tuple(LABELS)}")


def method_row(records: list[dict], samples: int, scorer: RecordScorer, cluster_f1: float = 0.9) -> dict:
    """One comparison row: questions, the task metric, answer rate, tokens per question and cut share, failure rates.

    A method with several samples per question scores the majority vote of all of them and costs their summed
    tokens; the answer rate is the share of records (answers, conversations, debates) that state an answer, in the
    answer format (``answer_rate``) or in words (``flexible_answer_rate``); ``<metric>_flexible`` scores (votes on)
    the flexible answers. MATH rows count the symbolic checks that timed out while scoring and voting
    (``verifier_timeouts``).
    """
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
