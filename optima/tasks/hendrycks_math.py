"""MATH (Hendrycks et al. 2021): competition mathematics, a debate task (task `math`; the module name does not
shadow the standard `math`).

Hub `EleutherAI/hendrycks_math` (one config per subject); local `math/` train/test as JSONL or the release's
`<split>/<subject>/<n>.json` files. The gold is the solution's last `\\boxed{}`, Minerva-normalised; a row without
one is skipped. Scored by symbolic equivalence. Eval: the full test split.
"""

from __future__ import annotations

import logging

from optima.tasks.answers import parse_math_answer
from optima.tasks.base import Example, Task, row_id

logger = logging.getLogger(__name__)

SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)


class HendrycksMath(Task):
    """MATH: Alice solves, Bob critiques; answers in `\\boxed{}`, compared symbolically."""

    name = "math"
    family = "debate"
    answer_style = "boxed"
    score_type = "math"
    prompt_set = "math"
    train_split = "train"
    eval_split = "test"
    hub_name = "EleutherAI/hendrycks_math"
    hub_configs = SUBJECTS
    local_folder = "math"
    eval_limit = None

    def build_example(self, row: dict, *, split: str, index: int, seed: int) -> Example | None:
        gold = parse_math_answer(row["solution"])
        if not gold:
            logger.debug("%s %s row %d: no boxed answer in the solution; skipped", self.name, split, index)
            return None
        return Example(
            id=row_id(row, ("id",), split, index),
            task=self.name,
            question=row["problem"].strip(),
            answer=gold,
            score_type=self.score_type,
            group=f"{row.get('type', '')}/{row.get('level', '')}",
        )
