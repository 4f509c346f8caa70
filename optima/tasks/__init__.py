"""The tasks: `TASKS` maps each name to its `Task` (a plain dict); one module per dataset (docs/method.md#tasks).

`mix` (no released recipe uses it) interleaves the information-exchange tasks round robin: the first example of
each, then the second of each, ... (an exhausted task is skipped); each example keeps its own task in
`Example.task` (its prompts, parser and scorer) and gets the id `"<task>:<id>"`. Importing the package needs only
the standard library (`datasets` on the hub path only, `math-verify` only in the MATH verifier's workers).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from itertools import zip_longest

from optima.tasks.base import QA_EVAL_LIMIT, DataError, Example, Task
from optima.tasks.cbt import CBT
from optima.tasks.choice import MMLU, ARCChallenge
from optima.tasks.gsm8k import GSM8K
from optima.tasks.hendrycks_math import HendrycksMath
from optima.tasks.multihop import HotpotQA, MultiWikiHopQA
from optima.tasks.sampling import select_questions
from optima.tasks.sources import DATA_DIR_ENV, resolve_data_dir
from optima.tasks.trival_qa import TriviaQA

logger = logging.getLogger(__name__)


def interleave(groups: Sequence[Sequence[Example]]) -> list[Example]:
    """Round-robin over the groups, skipping exhausted ones."""
    return [example for row in zip_longest(*groups) for example in row if example is not None]


class MixTask(Task):
    """Round-robin mixture of tasks of one family."""

    train_split = "train"
    eval_split = "eval"
    hub_name = None
    eval_limit = None

    def __init__(self, tasks: Sequence[Task], name: str = "mix") -> None:
        if not tasks:
            raise ValueError("MixTask needs at least one task")
        for attribute in ("family", "answer_style", "prompt_set"):
            values = {getattr(task, attribute) for task in tasks}
            if len(values) > 1:
                raise ValueError(
                    f"mixed tasks must share one {attribute}, got {sorted(values)} for {[t.name for t in tasks]}"
                )
        self.name = name
        self.tasks = tuple(tasks)
        first = self.tasks[0]
        self.family, self.answer_style, self.prompt_set = first.family, first.answer_style, first.prompt_set
        score_types = {task.score_type for task in tasks}
        self.score_type = score_types.pop() if len(score_types) == 1 else "mixed"

    def __repr__(self) -> str:
        return f"MixTask(name={self.name!r}, tasks={[task.name for task in self.tasks]})"

    def sources(self, split, data_dir):
        """Every sub-task's sources of `split` ("train"/"eval" = each one's own)."""
        names = {self.train_split: "train_split", self.eval_split: "eval_split"}
        return [
            source
            for task in self.tasks
            for source in task.sources(getattr(task, names[split]) if split in names else split, data_dir)
        ]

    def load(self, split: str, *, data_dir: str | os.PathLike | None = None, seed: int = 0) -> list[Example]:
        """`split` of every sub-task ("train"/"eval": each one's own), interleaved."""
        groups = []
        for task in self.tasks:
            if split == self.train_split:
                examples = task.load_train(data_dir=data_dir, seed=seed)
            elif split == self.eval_split:
                examples = task.load_eval(data_dir=data_dir, seed=seed)
            else:
                examples = task.load(split, data_dir=data_dir, seed=seed)
            groups.append([replace(example, id=f"{task.name}:{example.id}") for example in examples])
        return interleave(groups)

    def load_eval(self, *, data_dir: str | os.PathLike | None = None, seed: int = 0) -> list[Example]:
        """Every sub-task's eval set (each capped by its own rule), interleaved."""
        return self.load(self.eval_split, data_dir=data_dir, seed=seed)


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
