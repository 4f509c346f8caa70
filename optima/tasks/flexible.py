"""Flexible answers: what a reply names as its answer outside the answer format (docs/method.md#metrics).

lm-eval-harness reports `strict-match` (the answer in the prompt's format) beside `flexible-extract` (the answer
found anywhere in the reply); Optima does the same. The strict answer stays the reward's and the paper's (the
`<A>..</A>` tag, the last `\\boxed{}`: `optima.tasks.answers`); the flexible one, per score type, is:

* "choice" (arc, mmlu): the option named in the last sentence that names one: a label after "option", "choice",
  "answer" or "letter" ("The correct answer is option A"), else a marked label ("(B)", "B)"), else an option's
  text, else a bare label ending a clause ("... so it is C."); the label is returned;
* "number" (gsm8k) and "math": the last number ("$1,250.50" gives "1250.50");
* "f1" (the QA tasks): the tagged span, else the text after the last "answer is" / "answer:", else the last
  sentence.

Tags (`<A>`, `</A>`) and braced placeholders (`{letter}`, `{option text}`) are removed before reading: the
placeholder a model copies from the prompt names nothing. Every extractor is pure and total (any string gives a
string or None; nothing raises) and linear in the reply's length.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from optima.tasks.answers import is_placeholder, parse_tag

Options = Sequence[tuple[str, str]]

_TAGS = re.compile(r"</?A>")
_BRACED = re.compile(r"\{[^{}]*\}")
# A sentence ends at . ! ? followed by space, or at a line break.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_NUMBER = re.compile(r"-?\$?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\$?\d+(?:\.\d+)?")
_ANSWER_IS = re.compile(r"(?i:\banswer\s*(?:(?:is|was|would be|should be)\b|:|=))\s*(.+)$")
_KEYWORDS = r"(?i:\b(?:option|choice|answer|letter)s?\b(?:\s+(?:is|was|would be|should be)\b)?)"


def clean_reply(text: str | None) -> str:
    """The reply with answer tags and braced placeholders blanked out ("" for None)."""
    return _BRACED.sub(" ", _TAGS.sub(" ", text or ""))


def sentences(text: str) -> list[str]:
    """The non-empty sentences of `text`, in order (split after . ! ? and at line breaks)."""
    return [part.strip() for part in _SENTENCE_END.split(text) if part.strip()]


def _label_patterns(labels: Sequence[str]) -> list[re.Pattern]:
    """Patterns naming a label, most explicit first; each captures the label."""
    label = "(" + "|".join(re.escape(item) for item in sorted(labels, key=len, reverse=True)) + ")"
    edge = r"(?![A-Za-z0-9])"
    return [
        re.compile(rf"{_KEYWORDS}\s*[:=]?\s*[(\[]?{label}{edge}"),
        re.compile(rf"[(\[]{label}[)\]]|(?<![A-Za-z0-9(\[]){label}\)"),
    ]


def _last_match(pattern: re.Pattern, sentence: str) -> tuple[int, str] | None:
    found = None
    for match in pattern.finditer(sentence):
        found = (match.end(), next(group for group in match.groups() if group is not None))
    return found


def _named_by_text(sentence: str, options: Options) -> str | None:
    """The option whose text the sentence names last (the longer text first when two end at the same place)."""
    folded = " ".join(sentence.casefold().split())
    best: tuple[int, int, str] | None = None
    for label, text in options:
        phrase = " ".join(text.casefold().split()).rstrip(".")
        if not phrase:
            continue
        for match in re.finditer(rf"(?<!\w){re.escape(phrase)}(?!\w)", folded):
            candidate = (match.end(), len(phrase), label)
            best = candidate if best is None or candidate[:2] > best[:2] else best
    return best[2] if best else None


def named_option(sentence: str, options: Options) -> str | None:
    """The label of the option one sentence names (see the module table), or None.

    Args:
        sentence: One sentence of a cleaned reply.
        options: The question's (label, text) options.
    """
    labels = [label for label, _ in options]
    if not labels:
        return None
    for pattern in _label_patterns(labels):
        found = _last_match(pattern, sentence)
        if found:
            return found[1]
    by_text = _named_by_text(sentence, options)
    if by_text:
        return by_text
    label = "|".join(re.escape(item) for item in labels)
    bare = _last_match(re.compile(rf"(?<![A-Za-z0-9'])({label})(?=\s*(?:[.,;:!?]|$))"), sentence)
    return bare[1] if bare else None


def extract_choice(text: str | None, options: Options = ()) -> str | None:
    """The label of the option named in the last sentence of `text` that names one, or None.

    Args:
        text: One reply.
        options: The question's (label, text) options (without them nothing is named).
    """
    for sentence in reversed(sentences(clean_reply(text))):
        label = named_option(sentence, options)
        if label is not None:
            return label
    return None


def extract_number(text: str | None, options: Options = ()) -> str | None:
    """The last number of `text` (thousands commas and a dollar sign dropped), or None.

    Args:
        text: One reply.
        options: Unused (one signature for every extractor).
    """
    last = None
    for match in _NUMBER.finditer(clean_reply(text)):
        last = match.group(0)
    return None if last is None else last.replace("$", "").replace(",", "")


def extract_span(text: str | None, options: Options = ()) -> str | None:
    """A short-answer reply's answer: the tagged span, else what follows the last "answer is", else the last
    sentence; None when nothing is left (or the span is the prompt's placeholder).

    Args:
        text: One reply.
        options: Unused (one signature for every extractor).
    """
    tagged = parse_tag(text)
    if tagged and not is_placeholder(tagged, "qa"):
        return tagged
    parts = sentences(clean_reply(text))
    for sentence in reversed(parts):
        match = _ANSWER_IS.search(sentence)
        if match and match.group(1).strip(" .\"'"):
            return match.group(1).strip(" .\"'")
    last = parts[-1].strip(" .\"'") if parts else ""
    return last or None


# score type -> extractor (no branching on task names).
FLEXIBLE_EXTRACTORS: dict[str, Callable[[str | None, Options], str | None]] = {
    "choice": extract_choice,
    "number": extract_number,
    "math": extract_number,
    "f1": extract_span,
}


def flexible_answer(texts: Sequence[str], score_type: str, options: Options = ()) -> str | None:
    """The flexible answer of a conversation: that of its last reply that names one (None when none does).

    Args:
        texts: The replies, oldest first.
        score_type: The task's score type (a key of `FLEXIBLE_EXTRACTORS`).
        options: The question's options (multiple choice).
    """
    if score_type not in FLEXIBLE_EXTRACTORS:
        raise ValueError(f"unknown score type {score_type!r}; expected one of {sorted(FLEXIBLE_EXTRACTORS)}")
    extract = FLEXIBLE_EXTRACTORS[score_type]
    for text in reversed(texts):
        answer = extract(text, options)
        if answer:
            return answer
    return None
