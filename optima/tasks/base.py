"""The task abstraction: what one dataset looks like to the rest of Optima (docs/method.md#tasks).

A `Task` describes one dataset: its family ("qa" = information exchange, each agent holds part of the context;
"debate" = no context, Alice solves and Bob critiques), how answers are written ("tag" = `<A>..</A>`, "boxed" =
`\\boxed{}`), how they are scored, its train/eval splits and where its rows live (hub name/configs, local folder).
`Task.load` turns the dataset's own rows into frozen `Example`s. Subclasses only convert one row
(`build_example`); everything else (data root resolution, errors, id uniqueness, eval caps) lives here.

Score types (our names, with the released recipes' in brackets): "f1" [f1-score], "choice" [exact-match on arc/mmlu],
"number" [exact-match on gsm8k], "math" [math]. See `optima.tasks.scoring`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from optima.tasks.answers import ANSWER_PARSERS, is_placeholder, render_answer
from optima.tasks.sources import DataError, read_hub_rows, read_split, resolve_data_dir, split_sources

logger = logging.getLogger(__name__)

FAMILIES = ("qa", "debate")
SCORE_TYPES = ("f1", "choice", "number", "math")
# Eval size rule: qa eval sets use the first 1000 examples in dataset order; debate uses the full
# split.
QA_EVAL_LIMIT = 1000

__all__ = ["DataError", "Example", "Task", "QA_EVAL_LIMIT", "FAMILIES", "SCORE_TYPES", "fallback_id", "row_id"]


@dataclass(frozen=True)
class Example:
    """One question, ready for a two-agent conversation.

    Parameters:
        id (`str`): stable id, the dataset's own id where it has one, else `"<split>-<row index>"`.
        task (`str`): name of the task in `TASKS` that produced it (for `mix`, the sub-task).
        question (`str`): the question text shown to both agents (options listed for multiple choice).
        answer (`str | tuple[str, ...]`): the gold answer; a tuple of aliases for TriviaQA.
        score_type (`str`): one of `SCORE_TYPES`.
        context_first (`tuple[str, ...]`): Alice's private paragraphs (empty for debate tasks).
        context_second (`tuple[str, ...]`): Bob's private paragraphs (empty for debate tasks).
        options (`tuple[tuple[str, str], ...]`): (label, text) of each option for multiple choice, else empty.
        group (`str`): the question's natural group in its split (MMLU subject, MATH subject and level), ""
            when the task has none; a `--limit` sample is stratified by it.
    """

    id: str
    task: str
    question: str
    answer: str | tuple[str, ...]
    score_type: str
    context_first: tuple[str, ...] = ()
    context_second: tuple[str, ...] = ()
    options: tuple[tuple[str, str], ...] = ()
    group: str = ""

    @property
    def answers(self) -> tuple[str, ...]:
        """The gold answer as a tuple (one element unless the task has aliases)."""
        return self.answer if isinstance(self.answer, tuple) else (self.answer,)

    def context_for(self, agent_index: int) -> tuple[str, ...]:
        """Return the private paragraphs of agent 0 (Alice) or 1 (Bob).

        Args:
            agent_index: 0 or 1.
        """
        if agent_index not in (0, 1):
            raise ValueError(f"agent_index must be 0 (Alice) or 1 (Bob), got {agent_index!r}")
        return self.context_first if agent_index == 0 else self.context_second

    def to_dict(self) -> dict:
        """Return a JSON-ready dict (tuples become lists)."""
        record = asdict(self)
        record["options"] = [list(option) for option in self.options]
        return record

    @classmethod
    def from_dict(cls, record: dict) -> Example:
        """Rebuild an Example from `to_dict` output.

        Args:
            record: a dict as written by `to_dict` (lists are turned back into tuples).
        """
        answer = record["answer"]
        return cls(
            id=str(record["id"]),
            task=record["task"],
            question=record["question"],
            answer=tuple(answer) if isinstance(answer, list) else answer,
            score_type=record["score_type"],
            context_first=tuple(record.get("context_first", ())),
            context_second=tuple(record.get("context_second", ())),
            options=tuple((str(label), str(text)) for label, text in record.get("options", ())),
            group=str(record.get("group", "")),
        )


def fallback_id(split: str, index: int) -> str:
    """The id of a row that has none of its own: `"<split>-<row index>"`.

    Args:
        split: the split name.
        index: the 0-based row index in the source file(s).
    """
    return f"{split}-{index}"


def row_id(row: dict, keys: tuple[str, ...], split: str, index: int) -> str:
    """The row's own id (first of `keys` that is present and not empty; 0 counts), else `fallback_id`.

    Args:
        row: the source row.
        keys: id fields to try, e.g. ("_id", "id").
        split: the split name.
        index: the 0-based row index.
    """
    for key in keys:
        value = row.get(key)
        if value is not None and str(value).strip():
            return str(value).strip()
    return fallback_id(split, index)


class Task:
    """One dataset. Subclasses set the class attributes and implement `build_example`.

    Attributes:
        name: key in `TASKS`.
        family: "qa" (information exchange) or "debate".
        answer_style: "tag" (`<A>..</A>`) or "boxed" (`\\boxed{}`).
        score_type: one of `SCORE_TYPES`.
        prompt_set: which base prompts and format pool the agents use ("qa", "choice", "gsm8k", "math").
        train_split / eval_split: split names used for training data and for evaluation.
        hub_name / hub_configs: the Hugging Face dataset and the configs to concatenate.
        local_folder: folder under the local data root.
        eval_limit: cap on the eval set (first N in dataset order), or None for the full split.
    """

    name: str = ""
    family: str = "qa"
    answer_style: str = "tag"
    score_type: str = "f1"
    prompt_set: str = "qa"
    train_split: str = "train"
    eval_split: str = "test"
    hub_name: str | None = None
    hub_configs: tuple[str | None, ...] = (None,)
    local_folder: str = ""
    eval_limit: int | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def build_example(self, row: dict, *, split: str, index: int, seed: int) -> Example | None:
        """Convert one source row into an Example (None to skip the row).

        Args:
            row: the row in the dataset's own schema (local JSONL or hub).
            split: the split it came from.
            index: its 0-based index in the split.
            seed: the context-split seed.
        """
        raise NotImplementedError

    def finalize(self, examples: list[Example], *, split: str, data_dir: str | os.PathLike | None, seed: int):
        """Hook run after all rows are converted (filters, summary logs). The default returns them unchanged.

        Args:
            examples: the converted examples in source order.
            split: the split name.
            data_dir: the data root argument given to `load`.
            seed: the context-split seed.
        """
        return examples

    def read_rows(self, split: str, data_dir: str | os.PathLike | None) -> list[dict]:
        """Read the raw rows of `split` from the local root (argument or `$OPTIMA_DATA_DIR`) or the hub.

        Args:
            split: the split name.
            data_dir: the local data root, or None for `$OPTIMA_DATA_DIR` / the hub.
        """
        root = resolve_data_dir(data_dir)
        if root is None:
            return read_hub_rows(self.hub_name, self.hub_configs, split)
        return read_split(root, self.local_folder, self.hub_configs, split)

    def sources(self, split: str, data_dir: str | os.PathLike | None) -> list[str | Path]:
        """What `split` is read from: its local files, or `hub:<name>/<config>` names (content hashes key on them).

        Args:
            split: the split name.
            data_dir: the local data root, or None for `$OPTIMA_DATA_DIR` / the hub.

        Raises:
            DataError: a local split that is not there.
        """
        root = resolve_data_dir(data_dir)
        if root is None:
            return [f"hub:{self.hub_name}/{config}" for config in self.hub_configs]
        return list(split_sources(root, self.local_folder, split))

    def load(self, split: str, *, data_dir: str | os.PathLike | None = None, seed: int = 0) -> list[Example]:
        """Load every example of `split`, in dataset order, with ids made unique.

        Args:
            split: the split name (e.g. `self.train_split`).
            data_dir: the local data root, or None for `$OPTIMA_DATA_DIR` / the hub.
            seed: seed of the context split (information-exchange tasks); eval sets are identical for a seed.
        """
        rows = self.read_rows(split, data_dir)
        examples = []
        for index, row in enumerate(rows):
            try:
                example = self.build_example(row, split=split, index=index, seed=seed)
            except (KeyError, TypeError, IndexError, ValueError) as error:
                raise DataError(
                    f"{self.name}: row {index} of split {split!r} does not fit the schema: {error!r}"
                ) from error
            if example is not None:
                examples.append(example)
        if len(examples) < len(rows):
            logger.info(
                "%s %s: skipped %d of %d rows without a usable answer",
                self.name,
                split,
                len(rows) - len(examples),
                len(rows),
            )
        examples = self.finalize(examples, split=split, data_dir=data_dir, seed=seed)
        return make_ids_unique(examples, f"{self.name}/{split}")

    def load_train(self, *, data_dir: str | os.PathLike | None = None, seed: int = 0) -> list[Example]:
        """Load the training split (see `load`)."""
        return self.load(self.train_split, data_dir=data_dir, seed=seed)

    def load_eval(self, *, data_dir: str | os.PathLike | None = None, seed: int = 0) -> list[Example]:
        """Load the evaluation set: the eval split, capped by `eval_size` .

        Args:
            data_dir: the local data root, or None for `$OPTIMA_DATA_DIR` / the hub.
            seed: the context-split seed.
        """
        examples = self.load(self.eval_split, data_dir=data_dir, seed=seed)
        return examples[: self.eval_size(len(examples))]

    def eval_size(self, available: int) -> int:
        """Number of eval examples used: qa tasks the first `eval_limit` (1000), debate tasks the full split.

        Args:
            available: how many examples the eval split has.
        """
        return available if self.eval_limit is None else min(self.eval_limit, available)

    def parse_answer(self, text: str | None) -> str | None:
        """Extract the answer an utterance states, in this task's answer style (None when it states none).

        The placeholder of the prompts' answer slot (`{your answer}`, ...) is no answer: None.

        Args:
            text: the utterance.
        """
        answer = ANSWER_PARSERS[self.answer_style](text)
        return None if is_placeholder(answer, self.prompt_set) else answer

    def copies_placeholder(self, text: str | None) -> bool:
        """Whether the answer an utterance states is a copied placeholder (`is_placeholder`): no answer, never trained.

        Args:
            text: the utterance.
        """
        return is_placeholder(ANSWER_PARSERS[self.answer_style](text), self.prompt_set)

    def render_answer(self, answer: str) -> str:
        """Write `answer` in this task's answer style (`<A>..</A>` or `\\boxed{..}`).

        Args:
            answer: the answer text.
        """
        return render_answer(answer, self.answer_style)


def make_ids_unique(examples: Sequence[Example], where: str) -> list[Example]:
    """Suffix repeated ids with `#k` so that ids key examples uniquely (resume, context seeds); warn once.

    Args:
        examples: examples in order.
        where: label for the log line.
    """
    seen: dict[str, int] = {}
    result = []
    for example in examples:
        count = seen.get(example.id, 0)
        seen[example.id] = count + 1
        result.append(example if count == 0 else replace(example, id=f"{example.id}#{count}"))
    repeated = sum(1 for count in seen.values() if count > 1)
    if repeated:
        logger.warning("%s: %d ids occur more than once; later copies got a '#k' suffix", where, repeated)
    return result
