"""The answer constraint of an answering turn: a regular expression that every reply of that turn must match.

Used by the answer bootstrap by constrained decoding (`answer_bootstrap: grammar`, docs/method.md#answer-bootstrap):
the server's structured outputs let the model choose, by its own probabilities, among well-formed replies only. The
reply stays free around one answer span, written as the task's prompt asks:

* multiple choice (`score_type` "choice"): `<A>X) option text</A>` with one of the question's own options;
* other tag answers (information exchange): `<A>` a short span `</A>` with no bracket, brace or newline, so that no
  bracketed placeholder (`{your answer}`, `[your answer]`) fits (a plain copy such as "your answer" still does, and
  the placeholder rule reads it as no answer: `optima.tasks.answers.is_placeholder`);
* GSM8K (`score_type` "number"): `\\boxed{}` around a number;
* MATH: `\\boxed{}` around a short expression (one level of braces inside).

Around the span: a tag answer may be preceded and followed by free text without `<` (so the span is the reply's
last tag), a boxed answer preceded by free text without `\\boxed` and followed by nothing (the prompts ask to end
with the box). The free text is bounded in characters (`free_chars`), so the model must reach the answer before the
bound and a constrained reply does not run into `max_tokens` waiting for it.

The patterns use only what xgrammar, the structured-output backend of vLLM, reads: literals, character classes,
alternation, groups and bounded repetition.
"""

from __future__ import annotations

from optima.tasks.answers import BOXED_OPEN, TAG_CLOSE, TAG_OPEN
from optima.tasks.base import Example, Task

MAX_FREE_CHARS = 400  # free text on one side of the span at most (a larger bound only grows the grammar)
# Tokens of max_tokens kept for the span itself (an option's text is rarely longer).
SPAN_TOKENS = 64
_SPECIAL = set("\\.^$*+?{}[]|()")
_QA_SPAN = r"[^\s<>{}\[\]][^\n<>{}\[\]]{0,79}"
_NUMBER_SPAN = r"-?[0-9]{1,15}(\.[0-9]{1,6})?"
_MATH_SPAN = r"([^{}\n\\]|\\[a-zA-Z]{1,12}|\{[^{}\n]{0,40}\}){1,80}"
_FREE_TAG = "[^<]"  # no second tag: the span is the reply's last answer
_FREE_BOXED = r"([^\\]|\\[^b]|\\b[^o])"  # LaTeX commands allowed, `\bo...` (`\boxed`) only at the span


def escape(text: str) -> str:
    """`text` as a regex literal: special characters escaped, a newline written `\\n` (nothing else is escaped).

    Python's `re.escape` also escapes spaces, `#`, `&`, `~` and `-`; xgrammar's regex reader need not accept those.
    """
    return "".join("\\" + char if char in _SPECIAL else "\\n" if char == "\n" else char for char in text)


def answer_span_pattern(task: Task, example: Example) -> str:
    """The answer of `example` written as `task`'s prompts ask, in its tag or box (see the module docstring).

    Args:
        task: the example's task.
        example: the question (its options, for multiple choice).

    Raises:
        ValueError: a multiple-choice question without options.
    """
    if task.answer_style == "boxed":
        inner = _NUMBER_SPAN if example.score_type == "number" else _MATH_SPAN
        return escape(BOXED_OPEN) + inner + escape("}")
    if example.score_type == "choice":
        if not example.options:
            raise ValueError(f"{example.task} question {example.id!r}: multiple choice without options")
        inner = "(" + "|".join(escape(f"{label}) {text}") for label, text in example.options) + ")"
    else:
        inner = _QA_SPAN
    return escape(TAG_OPEN) + inner + escape(TAG_CLOSE)


def free_chars(max_tokens: int) -> int:
    """Characters of free text allowed on each side of the span: about half of what `max_tokens` leaves (>= 0)."""
    return max(0, min(MAX_FREE_CHARS, (max_tokens - SPAN_TOKENS) // 2))


def reply_pattern(task: Task, example: Example, max_tokens: int) -> str:
    """The whole reply of an answering turn: free text, the answer span, free text (tag answers only).

    Args:
        task: the example's task.
        example: the question.
        max_tokens: the turn's token limit (bounds the free text: `free_chars`).
    """
    bound = free_chars(max_tokens)
    span = answer_span_pattern(task, example)
    if task.answer_style == "boxed":
        return _free(_FREE_BOXED, 2 * bound) + span
    return _free(_FREE_TAG, bound) + span + _free(_FREE_TAG, bound)


def _free(char: str, bound: int) -> str:
    return f"{char}{{0,{bound}}}" if bound else ""
