"""The answer constraint of an answering turn: a regular expression that every reply of that turn must match.

Used by the answer bootstrap by constrained decoding (`answer_bootstrap: grammar`, docs/method.md#answer-bootstrap):
the server's structured outputs let the model choose, by its own probabilities, among well-formed replies only. The
reply stays free around one answer span, written as the task's prompt asks:

* multiple choice (`score_type` "choice"): `<A>X) option text</A>` with one of the question's own options;
* other tag answers (information exchange): `<A>` a few words `</A>` with no bracket, brace or newline, so that no
  bracketed placeholder (`{your answer}`, `[your answer]`) fits (a plain copy such as "your answer" still does, and
  the placeholder rule reads it as no answer: `optima.tasks.answers.is_placeholder`);
* GSM8K (`score_type` "number"): `\\boxed{}` around a number;
* MATH: `\\boxed{}` around a short expression (one level of braces inside).

Around the span, free text where the prompts and the pre-fill put it, bounded in words (a word is free):

* a tag answer (multiple choice, information exchange) comes first, where the pre-fill put its `<A>`: the speaker's
  name prefix (`Alice: `, optional), the span, then at most `WORDS_AFTER` words ("Reply as: <A>..</A> then one
  short reason"); free text beside a tag holds no `<`, so the span is the reply's only tag, and no `:`, so the
  reply never goes on into a turn of its own (`Bob: ...`, `Alice: ...`: about one iteration-0 conversation in
  twenty did, with free words that allowed it);
* a boxed answer (GSM8K, MATH) comes last, as the prompts ask: at most `WORDS_BEFORE` words of reasoning (LaTeX
  allowed, but no `\\boxed`), then the box, then nothing.

The bound keeps a constrained reply short and inside `max_tokens` (unbounded free text let SmolLM2-135M run on to
the limit: the reply is then cut and the conversation has no answer); words are `WORD_CHARS` characters at most, as
the space between them is short, else a model that would rather not write the box goes on in one endless word
(`1440.1440.1440...`, seen with an unbounded last word). It counts words, never characters: xgrammar,
vLLM's structured-output backend, compiles a bounded repetition of a character class (`[^<]{0,96}`) into one state
per count, which took 13 to 26 s for one pattern on a busy 2-core machine (vLLM gives up after
`VLLM_REGEX_COMPILATION_TIMEOUT_S`, 5 s by default); a bounded repetition of words compiles in well under a second.
"""

from __future__ import annotations

from optima.tasks.answers import BOXED_OPEN, TAG_CLOSE, TAG_OPEN
from optima.tasks.base import Example, Task

WORDS_AFTER = 30  # free words after a tag answer
WORDS_BEFORE = 80  # words of reasoning before a boxed answer
SPAN_WORDS = 10  # words of an information-exchange answer at most
WORD_CHARS = 32  # characters of one word at most: a word never goes on instead of the answer
_SPECIAL = set("\\.^$*+?{}[]|()")
_QA_WORD = rf"[^\s<>{{}}\[\]]{{1,{WORD_CHARS}}}"  # no bracket or brace: no bracketed placeholder fits
_NUMBER_SPAN = r"-?[0-9]{1,15}(\.[0-9]{1,6})?"
_MATH_SPAN = r"([^{}\n]|\{[^{}\n]*\})+"
_TAG_WORD = rf"[^\s<:]{{1,{WORD_CHARS}}}"  # a word beside a tag answer: no second tag, no speaker's `Name:`
# A word of reasoning: LaTeX commands allowed, but no `\b...` (`\boxed`).
_BOX_WORD = rf"([^\\\s]|\\[^b\s]){{1,{WORD_CHARS}}}"
_SPACE = r"\s{1,4}"  # between words


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
        inner = f"{_QA_WORD}( {_QA_WORD}){{0,{SPAN_WORDS - 1}}}"
    return escape(TAG_OPEN) + inner + escape(TAG_CLOSE)


def reply_pattern(task: Task, example: Example, speaker: str) -> str:
    """The whole reply of an answering turn: the answer span with free words where the prompts put them.

    Args:
        task: the example's task.
        example: the question.
        speaker: the agent whose reply it is (the prompts ask every message to begin with its name).
    """
    span = answer_span_pattern(task, example)
    if task.answer_style == "boxed":
        return f"({_BOX_WORD}{_SPACE}){{0,{WORDS_BEFORE}}}({_BOX_WORD})?{span}"
    return f"({escape(speaker)}: ?)?{span}({_SPACE}{_TAG_WORD}){{0,{WORDS_AFTER}}}"
