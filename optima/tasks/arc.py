"""ARC-Challenge (Clark et al. 2018): science multiple choice, a debate task (task `arc`).

Hub: `allenai/ai2_arc`, config `ARC-Challenge`; local folder `arc_challenge/` with `train.jsonl` and `test.jsonl`
in the HF schema `{"id", "question", "choices": {"text", "label"}, "answerKey"}` (some labels are "1".."4").
The question lists the labelled options; gold = the text of the correct option. Eval: the full test split.
"""

from __future__ import annotations

from optima.tasks.base import Example, Task, row_id
from optima.tasks.multiple_choice import render_choice_question


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
        """Convert one row; the gold is the text of the option labelled `answerKey`."""
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
