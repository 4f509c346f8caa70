"""A round-robin mixture of several tasks (recipe `dataset_type: mix`; no released recipe uses it).

`MixTask(tasks)` loads each sub-task's split and interleaves the examples round-robin (first example of each
task, then the second of each, ...; a task that runs out is skipped, so nothing is dropped or repeated). Counts
are exact (docs/method.md, D19). Each example keeps its sub-task's name in
`Example.task` and its own score type, so per-example behaviour (prompts, parsing, scoring) comes from
`TASKS[example.task]`. Ids become `"<task>:<id>"` so they stay unique across sub-tasks.
Split names: "train" and "eval" map to each sub-task's own train and eval sets; any other name is passed through.
The sub-tasks must share a family, an answer style and a prompt set (one conversation protocol for the mixture).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from itertools import zip_longest

from optima.tasks.base import Example, Task


def interleave(groups: Sequence[Sequence[Example]]) -> list[Example]:
    """Round-robin over the groups, skipping exhausted ones.

    Args:
        groups: one list of examples per task.
    """
    return [example for row in zip_longest(*groups) for example in row if example is not None]


class MixTask(Task):
    """Round-robin mixture of tasks of one family."""

    train_split = "train"
    eval_split = "eval"
    hub_name = None
    eval_limit = None

    def __init__(self, tasks: Sequence[Task], name: str = "mix") -> None:
        """Create the mixture.

        Args:
            tasks: the sub-tasks (at least one), in round-robin order.
            name: the task name in `TASKS`.
        """
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
        """Load `split` of every sub-task ("train"/"eval" = each one's own) and interleave them round-robin.

        Args:
            split: "train", "eval", or a split name every sub-task has.
            data_dir: the local data root, or None for `$OPTIMA_DATA_DIR` / the hub.
            seed: the context-split seed.
        """
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
        """Load every sub-task's eval set (each capped by its own rule) and interleave them."""
        return self.load(self.eval_split, data_dir=data_dir, seed=seed)
