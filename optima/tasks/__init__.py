"""The tasks: `TASKS` maps each name to its `Task` (a plain dict); one module per dataset (docs/method.md#tasks).

Importing it needs only the standard library (`datasets` is imported on the hub path only, `math-verify` only in
the MATH verifier's worker processes).
"""

from __future__ import annotations

import logging

from optima.tasks.arc import ARCChallenge
from optima.tasks.base import QA_EVAL_LIMIT, DataError, Example, Task
from optima.tasks.cbt import CBT
from optima.tasks.gsm8k import GSM8K
from optima.tasks.hendrycks_math import HendrycksMath
from optima.tasks.mix import MixTask
from optima.tasks.mmlu import MMLU
from optima.tasks.multihop import HotpotQA, MultiWikiHopQA
from optima.tasks.sampling import select_questions
from optima.tasks.sources import DATA_DIR_ENV, resolve_data_dir
from optima.tasks.trival_qa import TriviaQA

logger = logging.getLogger(__name__)

_QA_TASKS = (HotpotQA(), MultiWikiHopQA(), TriviaQA(), CBT("CN", name="cbt"))
_DEBATE_TASKS = (GSM8K(), HendrycksMath(), ARCChallenge(), MMLU())

TASKS: dict[str, Task] = {
    **{task.name: task for task in _QA_TASKS},
    "cbt_ne": CBT("NE", name="cbt_ne"),
    **{task.name: task for task in _DEBATE_TASKS},
    "mix": MixTask(_QA_TASKS, name="mix"),
}

# Accepted spellings -> the names in TASKS (the released recipes spell TriviaQA `trival_qa`).
TASK_ALIASES: dict[str, str] = {"trivia_qa": "trival_qa"}


def get_task(name: str) -> Task:
    """The task called `name` or one of its `TASK_ALIASES`.

    Raises:
        KeyError: an unknown name; the message lists the valid ones.
    """
    if name in TASKS:
        return TASKS[name]
    if name in TASK_ALIASES:
        logger.info("task %r is an alias of %r", name, TASK_ALIASES[name])
        return TASKS[TASK_ALIASES[name]]
    valid = sorted(TASKS) + sorted(TASK_ALIASES)
    raise KeyError(f"unknown task {name!r}; valid names: {', '.join(valid)}")


__all__ = [
    "DATA_DIR_ENV",
    "QA_EVAL_LIMIT",
    "TASKS",
    "TASK_ALIASES",
    "DataError",
    "Example",
    "MixTask",
    "Task",
    "get_task",
    "resolve_data_dir",
    "select_questions",
]
