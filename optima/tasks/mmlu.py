"""MMLU (Hendrycks et al. 2021): 57-subject multiple choice, a debate task.

Hub: `cais/mmlu`, config `all`; train = `auxiliary_train`, eval = `test`. Local folder `mmlu/` with
`auxiliary_train.jsonl` and `test.jsonl` in the HF schema `{"question", "subject", "choices": [4], "answer": int}`.
The question lists options A-D; gold = the text of the correct option. Eval: the full test split.
Training questions that also occur in ARC-Challenge's train split are dropped (compared
case- and space-insensitively; ARC is read from the same source; if it cannot be read, nothing is dropped and a
warning says so). No extra shuffle is applied: question slices are drawn by `select_questions`.
Ids are `"<split>-<row index>"` of the source file, so they survive the filter.
"""

from __future__ import annotations

import logging

from optima.tasks.arc import ARCChallenge
from optima.tasks.base import DataError, Example, Task, row_id
from optima.tasks.multiple_choice import LETTERS, normalize_question, question_stem, render_choice_question

logger = logging.getLogger(__name__)


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
        """Convert one row (hub auxiliary_train rows may nest the fields under "train")."""
        if "question" not in row and isinstance(row.get("train"), dict):
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
        """The split's files, and ARC-Challenge's train split for the train split (its questions are dropped)."""
        if split != self.train_split:
            return super().sources(split, data_dir)
        arc = ARCChallenge()
        try:
            arc_sources = arc.sources(arc.train_split, data_dir)
        except DataError:
            arc_sources = []  # not readable: nothing is dropped (``finalize``)
        return super().sources(split, data_dir) + arc_sources

    def finalize(self, examples, *, split, data_dir, seed):
        """On the train split, drop questions that also occur in ARC-Challenge train (original behaviour)."""
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
