"""GSM8K (Cobbe et al. 2021): grade-school maths word problems, a debate task without context.

Hub `openai/gsm8k`, config `main`; local `gsm8k/` train/test in the release schema. The gold is the number after
the last `####`; answers are written as `\\boxed{number}` and compared as numbers. Eval: the full test split.
"""

from __future__ import annotations

from optima.tasks.base import Example, Task, row_id


class GSM8K(Task):
    """GSM8K: Alice solves, Bob critiques; answers in `\\boxed{}`."""

    name = "gsm8k"
    family = "debate"
    answer_style = "boxed"
    score_type = "number"
    prompt_set = "gsm8k"
    train_split = "train"
    eval_split = "test"
    hub_name = "openai/gsm8k"
    hub_configs = ("main",)
    local_folder = "gsm8k"
    eval_limit = None

    def build_example(self, row: dict, *, split: str, index: int, seed: int) -> Example | None:
        return Example(
            id=row_id(row, ("id",), split, index),
            task=self.name,
            question=row["question"].strip(),
            answer=row["answer"].split("####")[-1].strip(),
            score_type=self.score_type,
        )
