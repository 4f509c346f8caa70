"""Children's Book Test (Hill et al. 2016): fill the word XXXXX of a 20-sentence story excerpt.

`cbt` (common nouns, config CN, the paper's) and `cbt_ne` (named entities). Hub `cam-cbt/cbt`; local `cbt/CN/`
or `cbt/NE/` train/validation/test. Alice gets the first half of the sentences, Bob the second; the question lists
the ten candidates; the score is F1. Eval: the first 1000 test rows.
"""

from __future__ import annotations

from optima.tasks.base import QA_EVAL_LIMIT, Example, Task, row_id


class CBT(Task):
    """CBT: fill in XXXXX; the story is split in halves between Alice and Bob."""

    family = "qa"
    answer_style = "tag"
    score_type = "f1"
    prompt_set = "qa"
    train_split = "train"
    eval_split = "test"
    hub_name = "cam-cbt/cbt"
    eval_limit = QA_EVAL_LIMIT

    def __init__(self, config: str = "CN", name: str = "cbt") -> None:
        if config not in ("CN", "NE"):
            raise ValueError(f"CBT config must be 'CN' or 'NE', got {config!r}")
        self.name = name
        self.config = config
        self.hub_configs = (config,)
        self.local_folder = f"cbt/{config}"

    def build_example(self, row: dict, *, split: str, index: int, seed: int) -> Example | None:
        sentences = tuple(" ".join(s.split()) for s in row["sentences"] if s.strip())
        half = (len(sentences) + 1) // 2
        options = ", ".join(row["options"])
        question = f"{row['question'].strip()}\nWhich word fills XXXXX? Choose from: {options}"
        return Example(
            id=row_id(row, ("id",), split, index),
            task=self.name,
            question=question,
            answer=row["answer"].strip(),
            score_type=self.score_type,
            context_first=sentences[:half],
            context_second=sentences[half:],
        )
