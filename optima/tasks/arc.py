"""ARC-Challenge (Clark et al. 2018): science multiple choice, a debate task (task `arc`), and the rendering of
multiple-choice questions it shares with MMLU.

Hub `allenai/ai2_arc`, config `ARC-Challenge`; local `arc_challenge/` train/test in the HF schema (`choices:
{text, label}`, `answerKey`; some labels are "1".."4"). The question lists its labelled options, one per line; the
gold is the correct option's text. Eval: the full test split.
"""

from __future__ import annotations

from collections.abc import Sequence

from optima.tasks.base import Example, Task, row_id

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
