"""Children's Book Test (Hill et al. 2016): information exchange over a 20-sentence story excerpt.

Two tasks: `cbt` (common nouns, config CN, the one the paper uses) and `cbt_ne` (named entities, config NE).
Hub: `cam-cbt/cbt`; local folder `cbt/CN/` or `cbt/NE/` with `train.jsonl`, `validation.jsonl`, `test.jsonl` in the
HF schema `{"sentences": [20], "question": "... XXXXX ...", "answer", "options": [10]}`. Eval: first 1000 test rows.
Context split (deterministic by construction): Alice gets the first half of the sentences,
Bob the second half; sentences are kept as they are (a story may repeat a short sentence such as "said he .").
The question asks for the word that fills XXXXX and lists the ten candidates; the score is F1.
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
        """Create the task for one CBT config.

        Args:
            config: "CN" (common nouns) or "NE" (named entities).
            name: the task name in `TASKS`.
        """
        if config not in ("CN", "NE"):
            raise ValueError(f"CBT config must be 'CN' or 'NE', got {config!r}")
        self.name = name
        self.config = config
        self.hub_configs = (config,)
        self.local_folder = f"cbt/{config}"

    def build_example(self, row: dict, *, split: str, index: int, seed: int) -> Example | None:
        """Convert one row: question with its candidate list, story halves as the two contexts."""
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
