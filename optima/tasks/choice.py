"""The multiple-choice debate tasks: ARC-Challenge (Clark et al. 2018, task `arc`) and MMLU (Hendrycks et al. 2021).

The question lists its labelled options, one `"A) text"` per line (not a list repr: docs/method.md D28); the gold
is the correct option's text. ARC: hub `allenai/ai2_arc`, config `ARC-Challenge`; local `arc_challenge/` train/test
(HF schema: `choices: {text, label}`, `answerKey`; some labels are "1".."4"). MMLU: hub `cais/mmlu`, config `all`;
train `auxiliary_train`, eval `test`; local `mmlu/` (HF schema: `choices: [4]`, `answer: int`); its training
questions that also occur in ARC-Challenge's train split are dropped, as the original did (compared casefolded;
if ARC cannot be read, nothing is dropped, with a warning). Eval: the full test splits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from optima.tasks.base import DataError, Example, Task, row_id

logger = logging.getLogger(__name__)

LETTERS = "ABCDEFGHIJ"
OPTIONS_HEADER = "Options:"


def render_choice_question(question: str, options: Sequence[tuple[str, str]]) -> str:
    """The question stem, then `Options:` and one `"A) text"` line per option."""
    lines = [question.strip(), OPTIONS_HEADER]
    lines.extend(f"{label}) {text}" for label, text in options)
    return "\n".join(lines)


def normalize_question(text: str) -> str:
    """A question stem compared across datasets: casefolded, whitespace collapsed."""
    return " ".join(text.casefold().split())


def question_stem(rendered: str) -> str:
    """The stem of a question rendered by `render_choice_question`."""
    return rendered.rsplit(f"\n{OPTIONS_HEADER}\n", 1)[0]


class ARCChallenge(Task):
    """ARC-Challenge: Alice answers, Bob critiques; answers in `<A>..</A>`, label or option text."""

    name = "arc"
    family = "debate"
    answer_style = "tag"
    score_type = "choice"
    prompt_set = "choice"
    train_split = "train"
    eval_split = "test"
    hub_name = "allenai/ai2_arc"
    hub_configs = ("ARC-Challenge",)
    local_folder = "arc_challenge"
    eval_limit = None

    def build_example(self, row: dict, *, split: str, index: int, seed: int) -> Example | None:
        choices = row["choices"]
        options = tuple(
            (str(label).strip(), text.strip()) for label, text in zip(choices["label"], choices["text"], strict=True)
        )
        gold = dict(options)[str(row["answerKey"]).strip()]
        return Example(
            id=row_id(row, ("id",), split, index),
            task=self.name,
            question=render_choice_question(row["question"], options),
            answer=gold,
            score_type=self.score_type,
            options=options,
        )


class MMLU(Task):
    """MMLU: Alice answers, Bob critiques; answers in `<A>..</A>`, letter or option text."""

    name = "mmlu"
    family = "debate"
    answer_style = "tag"
    score_type = "choice"
    prompt_set = "choice"
    train_split = "auxiliary_train"
    eval_split = "test"
    hub_name = "cais/mmlu"
    hub_configs = ("all",)
    local_folder = "mmlu"
    eval_limit = None

    def build_example(self, row: dict, *, split: str, index: int, seed: int) -> Example | None:
        if "question" not in row and isinstance(row.get("train"), dict):  # hub auxiliary_train rows nest them
            row = row["train"]
        options = tuple((LETTERS[i], str(text).strip()) for i, text in enumerate(row["choices"]))
        return Example(
            id=row_id(row, ("id",), split, index),
            task=self.name,
            question=render_choice_question(row["question"], options),
            answer=options[int(row["answer"])][1],
            score_type=self.score_type,
            options=options,
            group=str(row.get("subject") or ""),
        )

    def sources(self, split, data_dir):
        """The split's files; the train split also reads ARC-Challenge's (its questions are dropped)."""
        if split != self.train_split:
            return super().sources(split, data_dir)
        arc = ARCChallenge()
        try:
            arc_sources = arc.sources(arc.train_split, data_dir)
        except DataError:
            arc_sources = []  # not readable: nothing is dropped (``finalize``)
        return super().sources(split, data_dir) + arc_sources

    def finalize(self, examples, *, split, data_dir, seed):
        """On the train split, drop the questions that also occur in ARC-Challenge train."""
        if split != self.train_split:
            return examples
        arc = ARCChallenge()
        try:
            arc_rows = arc.read_rows(arc.train_split, data_dir)
        except DataError as error:
            logger.warning("mmlu: ARC-Challenge train unavailable (%s); ARC overlap not removed", error)
            return examples
        arc_questions = {normalize_question(row["question"]) for row in arc_rows}
        kept = [ex for ex in examples if normalize_question(question_stem(ex.question)) not in arc_questions]
        logger.info(
            "mmlu %s: dropped %d questions that also occur in ARC-Challenge train", split, len(examples) - len(kept)
        )
        return kept
