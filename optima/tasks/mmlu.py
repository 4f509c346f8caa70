"""MMLU (Hendrycks et al. 2021): 57-subject multiple choice, a debate task.

Hub `cais/mmlu`, config `all`; train = `auxiliary_train`, eval = `test` (the full split); local `mmlu/` in the HF
schema (`choices: [4]`, `answer: int`). Training questions that also occur in ARC-Challenge's train split are
dropped, as the original did (compared casefolded; if ARC cannot be read, nothing is dropped, with a warning).
"""

from __future__ import annotations

import logging

from optima.tasks.arc import LETTERS, ARCChallenge, normalize_question, question_stem, render_choice_question
from optima.tasks.base import DataError, Example, Task, row_id

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
