"""Multiple-choice helpers shared by ARC-Challenge and MMLU (debate tasks).

The question lists labelled options, one per line (not a Python list of option texts: docs/method.md, D28), and
the scorer accepts the label or the option text (`optima.tasks.scoring.score_choice`).
"""

from __future__ import annotations

from collections.abc import Sequence

LETTERS = "ABCDEFGHIJ"
OPTIONS_HEADER = "Options:"


def render_choice_question(question: str, options: Sequence[tuple[str, str]]) -> str:
    """Render a question followed by its labelled options ("A) text" lines).

    Args:
        question: the question stem.
        options: (label, text) pairs.
    """
    lines = [question.strip(), OPTIONS_HEADER]
    lines.extend(f"{label}) {text}" for label, text in options)
    return "\n".join(lines)


def normalize_question(text: str) -> str:
    """Case- and whitespace-insensitive form of a question, for de-duplication across datasets.

    Args:
        text: a question stem.
    """
    return " ".join(text.casefold().split())


def question_stem(rendered: str) -> str:
    """Return the stem of a question rendered by `render_choice_question` (the inverse of the rendering).

    Args:
        rendered: the full question text with its options.
    """
    return rendered.rsplit(f"\n{OPTIONS_HEADER}\n", 1)[0]
