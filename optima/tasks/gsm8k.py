"""GSM8K (Cobbe et al. 2021): grade-school math word problems, a debate task.

Hub: `openai/gsm8k`, config `main`; local folder `gsm8k/` with `train.jsonl` and `test.jsonl` in the release
schema `{"question", "answer"}`, where the answer ends with `#### <number>`. Gold = the text after the last `####`.
Answers are written as `\\boxed{number}` and compared as numbers ("1,000" == "1000" == "1000.0"). No context.
Eval: the full test split.
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
        """Convert one row; the gold answer is the text after `####`."""
        return Example(
            id=row_id(row, ("id",), split, index),
            task=self.name,
            question=row["question"].strip(),
            answer=row["answer"].split("####")[-1].strip(),
            score_type=self.score_type,
        )
