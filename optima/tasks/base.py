"""What one dataset looks like to the rest of Optima: `Example`, `Task`, and the answer constraint of a reply.

A `Task` names its family ("qa": information exchange, each agent holds part of the context; "debate": Alice
solves, Bob critiques), its answer style ("tag" `<A>..</A>`, "boxed" `\\boxed{}`), score type and splits; a
subclass only converts one row of its dataset (`build_example`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from optima.tasks.answers import ANSWER_PARSERS, BOXED_OPEN, TAG_CLOSE, TAG_OPEN, is_placeholder, render_answer
from optima.tasks.sources import DataError, read_hub_rows, read_split, resolve_data_dir, split_sources

logger = logging.getLogger(__name__)

# Eval size rule: qa eval sets use the first 1000 examples in dataset order; debate uses the full split.
QA_EVAL_LIMIT = 1000

__all__ = ["DataError", "Example", "Task", "QA_EVAL_LIMIT", "row_id", "reply_pattern"]


@dataclass(frozen=True)
class Example:
    """One question, ready for a two-agent conversation.

    Parameters:
        id (`str`): the dataset's own id where it has one, else `"<split>-<row index>"`.
        task (`str`): the task in `TASKS` that produced it (for `mix`, the sub-task).
        question (`str`): the text both agents see (multiple choice: with its options listed).
        answer (`str | tuple[str, ...]`): the gold answer; a tuple of aliases for TriviaQA.
        score_type (`str`): "f1", "choice", "number" or "math".
        context_first, context_second (`tuple[str, ...]`): Alice's and Bob's private paragraphs (debate: none).
        options (`tuple[tuple[str, str], ...]`): (label, text) of each option of a multiple-choice question.
        group (`str`): the question's group in its split (MMLU subject, MATH subject and level) for a
            stratified `--limit` sample; "" when the task has none.
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
        """The private paragraphs of agent 0 (Alice) or 1 (Bob)."""
        if agent_index not in (0, 1):
            raise ValueError(f"agent_index must be 0 (Alice) or 1 (Bob), got {agent_index!r}")
        return self.context_first if agent_index == 0 else self.context_second

    def to_dict(self) -> dict:
        """A JSON-ready dict (tuples become lists)."""
        record = asdict(self)
        record["options"] = [list(option) for option in self.options]
        return record

    @classmethod
    def from_dict(cls, record: dict) -> Example:
        """The Example that `to_dict` wrote."""
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


def row_id(row: dict, keys: tuple[str, ...], split: str, index: int) -> str:
    """The row's own id (the first of `keys` present and not blank; 0 counts), else `"<split>-<index>"`."""
    for key in keys:
        value = row.get(key)
        if value is not None and str(value).strip():
            return str(value).strip()
    return f"{split}-{index}"


class Task:
    """One dataset. Subclasses set the class attributes and implement `build_example`.

    Attributes:
        name: its key in `TASKS`.
        family: "qa" (information exchange) or "debate".
        answer_style: "tag" (`<A>..</A>`) or "boxed" (`\\boxed{}`).
        score_type: "f1", "choice", "number" or "math" (the scorer, `optima.tasks.scoring`).
        prompt_set: the role prompts and format pool of its agents ("qa", "choice", "gsm8k", "math").
        train_split / eval_split: the split names for training data and for evaluation.
        hub_name / hub_configs: the Hugging Face dataset and the configs to concatenate.
        local_folder: its folder under the local data root.
        eval_limit: the eval set's cap (the first N in dataset order), or None for the full split.
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
        """One row of the dataset's own schema as an Example (None skips the row); `seed` seeds context splits."""
        raise NotImplementedError

    def finalize(self, examples: list[Example], *, split: str, data_dir: str | os.PathLike | None, seed: int):
        """Run after every row is converted (filters, summary logs); the default keeps them all."""
        return examples

    def read_rows(self, split: str, data_dir: str | os.PathLike | None) -> list[dict]:
        """The raw rows of `split`: from `data_dir`, else `$OPTIMA_DATA_DIR`, else the hub."""
        root = resolve_data_dir(data_dir)
        if root is None:
            return read_hub_rows(self.hub_name, self.hub_configs, split)
        return read_split(root, self.local_folder, self.hub_configs, split)

    def sources(self, split: str, data_dir: str | os.PathLike | None) -> list[str | Path]:
        """What `split` is read from: its local files, or `hub:<name>/<config>` (stage keys hash them).

        Raises:
            DataError: a local split that is not there.
        """
        root = resolve_data_dir(data_dir)
        if root is None:
            return [f"hub:{self.hub_name}/{config}" for config in self.hub_configs]
        return list(split_sources(root, self.local_folder, split))

    def load(self, split: str, *, data_dir: str | os.PathLike | None = None, seed: int = 0) -> list[Example]:
        """Every example of `split`, in dataset order, with ids made unique (`seed`: the context splits)."""
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
        """The training split (`load`)."""
        return self.load(self.train_split, data_dir=data_dir, seed=seed)

    def load_eval(self, *, data_dir: str | os.PathLike | None = None, seed: int = 0) -> list[Example]:
        """The evaluation set: the eval split, capped by `eval_size`."""
        examples = self.load(self.eval_split, data_dir=data_dir, seed=seed)
        return examples[: self.eval_size(len(examples))]

    def eval_size(self, available: int) -> int:
        """Eval questions used out of `available`: qa tasks the first `eval_limit` (1000), debate all."""
        return available if self.eval_limit is None else min(self.eval_limit, available)

    def parse_answer(self, text: str | None) -> str | None:
        """The answer an utterance states in this task's style; None when it states none or copies a placeholder."""
        answer = ANSWER_PARSERS[self.answer_style](text)
        return None if is_placeholder(answer, self.prompt_set) else answer

    def copies_placeholder(self, text: str | None) -> bool:
        """Whether the answer an utterance states copies a prompt's placeholder (no answer, never trained on)."""
        return is_placeholder(ANSWER_PARSERS[self.answer_style](text), self.prompt_set)

    def render_answer(self, answer: str) -> str:
        """`answer` in this task's style (`<A>..</A>` or `\\boxed{..}`)."""
        return render_answer(answer, self.answer_style)


def make_ids_unique(examples: Sequence[Example], where: str) -> list[Example]:
    """Repeated ids suffixed `#k`, so that ids key examples uniquely (resume, context seeds); one warning."""
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


# The answer constraint (`answer_bootstrap: grammar`, docs/method.md#answer-bootstrap): a regular expression every
# reply of an answering turn must match, free text around one answer span written as the prompt asks. It counts
# words, never characters: xgrammar compiles a bounded repetition of a character class into one state per count
# (13-26 s for one pattern on a busy 2-core machine, past vLLM's 5 s compile timeout).
WORDS_AFTER = 30  # free words after a tag answer
WORDS_BEFORE = 80  # words of reasoning before a boxed answer
SPAN_WORDS = 10  # words of an information-exchange answer at most
WORD_CHARS = 32  # characters of one word at most: a word never goes on instead of the answer
_SPECIAL = set("\\.^$*+?{}[]|()")
_QA_WORD = rf"[^\s<>{{}}\[\]]{{1,{WORD_CHARS}}}"  # no bracket or brace: no bracketed placeholder fits
_NUMBER_SPAN = r"-?[0-9]{1,15}(\.[0-9]{1,6})?"
_MATH_SPAN = r"([^{}\n]|\{[^{}\n]*\})+"
_TAG_WORD = rf"[^\s<:]{{1,{WORD_CHARS}}}"  # a word beside a tag answer: no second tag, no speaker's `Name:`
# A word of reasoning: LaTeX commands allowed, but no `\b...` (`\boxed`).
_BOX_WORD = rf"([^\\\s]|\\[^b\s]){{1,{WORD_CHARS}}}"
_SPACE = r"\s{1,4}"  # between words


def escape(text: str) -> str:
    """`text` as a regex literal: only the special characters escaped (xgrammar need not read `\\-`), `\\n` for a
    newline."""
    return "".join("\\" + char if char in _SPECIAL else "\\n" if char == "\n" else char for char in text)


def answer_span_pattern(task: Task, example: Example) -> str:
    """The answer in its tag or box: one of the question's options (`<A>X) text</A>`), a few words without
    brackets (information exchange), a number (GSM8K) or a short expression (MATH).

    Raises:
        ValueError: a multiple-choice question without options.
    """
    if task.answer_style == "boxed":
        inner = _NUMBER_SPAN if example.score_type == "number" else _MATH_SPAN
        return escape(BOXED_OPEN) + inner + escape("}")
    if example.score_type == "choice":
        if not example.options:
            raise ValueError(f"{example.task} question {example.id!r}: multiple choice without options")
        inner = "(" + "|".join(escape(f"{label}) {text}") for label, text in example.options) + ")"
    else:
        inner = f"{_QA_WORD}( {_QA_WORD}){{0,{SPAN_WORDS - 1}}}"
    return escape(TAG_OPEN) + inner + escape(TAG_CLOSE)


def reply_pattern(task: Task, example: Example, speaker: str) -> str:
    """The whole reply of `speaker`'s answering turn: a tag answer first (after an optional `Name: `, then at most
    `WORDS_AFTER` words without `<` or `:`), a boxed answer last (after at most `WORDS_BEFORE` words)."""
    span = answer_span_pattern(task, example)
    if task.answer_style == "boxed":
        return f"({_BOX_WORD}{_SPACE}){{0,{WORDS_BEFORE}}}({_BOX_WORD})?{span}"
    return f"({escape(speaker)}: ?)?{span}({_SPACE}{_TAG_WORD}){{0,{WORDS_AFTER}}}"
