"""Answers re-parsed from the stored text when the parser changed since a row was written (docs/method.md#scoring).

A conversation row stores every utterance's text and the ``final_answer`` parsed when it was written, with the
``parser_version`` (``optima.tasks.answers.PARSER_VERSION``) that parsed it. A parser fix must reach the rows
written before it, so readers take a row through ``reparsed``: a row of another version (or of none: written before
versions were recorded) gets its ``final_answer`` parsed again from its utterances by the same rule as the turn loop
(the last answer any utterance states), and the current version. The stop point of the conversation stays as it
was: it was sampled. Rows that combine several answers otherwise (a debate's majority) are re-parsed by their
method (``optima.evaluation.baselines``).
"""

from __future__ import annotations

from collections.abc import Iterable

from optima.tasks import get_task
from optima.tasks.answers import PARSER_VERSION, AnswerTracker

PARSER_VERSION_KEY = "parser_version"


def last_answer(task_name: str, texts: Iterable[str]) -> str:
    """The answer a conversation ends with: the last one any of ``texts`` states ("" when none does)."""
    task, tracker = get_task(task_name), AnswerTracker()
    for text in texts:
        tracker.update(task.parse_answer(text))
    return tracker.final_answer


def is_current(record: dict) -> bool:
    """Whether ``record`` was parsed by the current parser."""
    return record.get(PARSER_VERSION_KEY) == PARSER_VERSION


def reparsed(record: dict) -> dict:
    """``record`` with ``final_answer`` as the current parser reads its stored utterances (itself when current).

    Args:
        record: A conversation row (``task`` or ``example``, ``utterances`` with ``text``, ``final_answer``).

    Raises:
        ValueError: a debate row (its answer is a majority: ``optima.evaluation.metrics.reparsed_debate``).
    """
    if is_current(record) or "utterances" not in record:
        return record
    if "debate" in record:
        raise ValueError(f"row {record.get('task_id')!r} is a debate: re-parse it with reparsed_debate")
    task = record.get("task") or record["example"]["task"]
    answer = last_answer(task, (u["text"] for u in record["utterances"]))
    return record | {"final_answer": answer, PARSER_VERSION_KEY: PARSER_VERSION}
