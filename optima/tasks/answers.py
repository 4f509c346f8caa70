"""Reading an answer from an utterance: the last `<A>..</A>`, the last `\\boxed{}` (Minerva-normalised), the
placeholder rule, and the stop rule (docs/method.md#scoring).

The parsers run on every utterance (the stop rule, the reward, evaluation): any string, even 100k characters of
garbage, gives a string or None in linear time and never raises.
"""

from __future__ import annotations

import re

TAG_OPEN = "<A>"
TAG_CLOSE = "</A>"
BOXED_OPEN = "\\boxed{"
# Raise it with any change that parses some text otherwise: rows record the version that parsed them, and readers
# re-parse rows of another version from their text (`optima.tasks.scoring.reparsed`).
PARSER_VERSION = 2  # 2: one placeholder rule over the skeleton ([your answer], X) option text, born={year})
PARSER_VERSION_KEY = "parser_version"  # the field of a row that says which version parsed it

# prompt set -> the placeholders its prompts show in the answer slot (the first is the one the format lines use).
ANSWER_PLACEHOLDERS: dict[str, tuple[str, ...]] = {
    "qa": ("{your answer}",),
    "choice": ("{letter}) {option text}", "{letter}", "{option text}"),
    "gsm8k": ("{number}",),
    "math": ("{your answer}",),
}

# Minerva's normalisation (Lewkowycz et al. 2022, App. D), in its order; the article and unit words match only
# where they do not continue a longer word, so `\\left` keeps its "ft" and "mean" keeps its "an ".
_ARTICLES = ("an ", "a ")
_SUBSTITUTIONS = (
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Unit and filler expressions that Minerva deletes, in Minerva's order.
_REMOVED_EXPRESSIONS = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "ft",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
# Words only match when not preceded by a letter or backslash (so `\left`, `mean`, `issue` survive).
_WORD_GUARD = r"(?<![A-Za-z\\])"
_REMOVED_PATTERNS = tuple(
    re.compile(_WORD_GUARD + re.escape(expr)) if expr[0].isalpha() else re.compile(re.escape(expr))
    for expr in _REMOVED_EXPRESSIONS
)
_ARTICLE_PATTERNS = tuple(re.compile(_WORD_GUARD + re.escape(article)) for article in _ARTICLES)
# Wrappers whose content is kept; `[^{}]*` keeps the scan linear on adversarial input.
_UNWRAP = re.compile(r"\\(?:text|textbf|overline|boxed)\{([^{}]*)\}")
# Shorthand arguments: one command (`\\pi`) or one character; `{` opens a braced one.
_FRAC_SHORTHAND = re.compile(r"frac(\\[A-Za-z]+|[^{}\\])(\\[A-Za-z]+|.)", re.DOTALL)
_SQRT_SHORTHAND = re.compile(r"sqrt(\\[A-Za-z]+|[^{}\[\\])", re.DOTALL)
# A comma-grouped number ("1,000", "12,345,678"): the only commas dropped from a number.
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def parse_tag(text: str | None) -> str | None:
    """The text between the last `</A>` and the nearest `<A>` before it, stripped ("" for `<A></A>`), or None.

    Newlines inside are allowed; the tag is case-sensitive, as the protocol writes it.
    """
    if not text:
        return None
    end = text.rfind(TAG_CLOSE)
    if end < 0:
        return None
    start = text.rfind(TAG_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(TAG_OPEN) : end].strip()


def find_matching_brace(text: str, open_index: int) -> int | None:
    """The index of the `}` that closes the `{` at `open_index`, or None when unbalanced."""
    depth = 0
    for index in range(open_index, len(text)):
        char = text[index]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return index
    return None


def parse_boxed(text: str | None) -> str | None:
    """The raw content of the last `\\boxed{...}`, matched brace by brace; None when absent or unbalanced."""
    if not text:
        return None
    start = text.rfind(BOXED_OPEN)
    if start < 0:
        return None
    open_index = start + len(BOXED_OPEN) - 1
    close_index = find_matching_brace(text, open_index)
    if close_index is None:
        return None
    return text[open_index + 1 : close_index]


def _keep_between_dollars(text: str) -> str:
    """Only the text between the first two `$` (Minerva's `$...$` rule), if there are two."""
    first = text.find("$")
    if first < 0:
        return text
    second = text.find("$", first + 1)
    if second < 0:
        return text
    return "$" + text[first + 1 : second] + "$"


def normalize_final_answer(answer: str) -> str:
    """Minerva's normalisation, so that equal answers become equal strings: the text after the last `=`, no
    articles, spaces or unit words, the inside of `$...$` and of `\\text{}`-like wrappers, shorthand braced, no `$`,
    no thousands commas."""
    final = answer.split("=")[-1]
    for pattern in _ARTICLE_PATTERNS:
        final = pattern.sub("", final)
    for before, after in _SUBSTITUTIONS:
        final = final.replace(before, after)
    for pattern in _REMOVED_PATTERNS:
        final = pattern.sub("", final)
    final = _keep_between_dollars(final)
    final = _UNWRAP.sub(r"\1", final)
    final = expand_shorthand(final)
    final = final.replace("$", "")
    return drop_thousands_commas(final)


def without_percent(text: str) -> str:
    """`"70%"` -> `"70"` (and `"70\\%"`): a percentage answers a question whose gold states the number alone."""
    return text.replace("\\%", "").replace("%", "")


def drop_thousands_commas(text: str) -> str:
    """`"1,000"` -> `"1000"`; any other comma stays (Minerva's "1,2" -> "12" made a list a number)."""
    return text.replace(",", "") if _THOUSANDS.fullmatch(text) else text


def expand_shorthand(text: str) -> str:
    """Brace shorthand arguments (`\\frac12`, `\\frac9{19}`, `\\sqrt\\pi`): one character or one command each,
    a braced denominator kept, `\\sqrt[n]{x}` left as written (Minerva's rewrite broke both)."""
    return _SQRT_SHORTHAND.sub(r"sqrt{\1}", _FRAC_SHORTHAND.sub(_brace_frac, text))


def _brace_frac(match: re.Match) -> str:
    numerator, denominator = match.groups()
    # An opening brace starts a denominator that is braced already: keep it (its content follows unchanged).
    return f"frac{{{numerator}}}" + ("{" if denominator == "{" else f"{{{denominator}}}")


def parse_math_answer(text: str | None) -> str | None:
    """The normalised content of the last `\\boxed{}` (a MATH answer), or None."""
    boxed = parse_boxed(text)
    if boxed is None:
        return None
    return normalize_final_answer(boxed)


# answer_style -> parser; tasks pick their parser here (no if/elif on task names).
ANSWER_PARSERS = {"tag": parse_tag, "boxed": parse_math_answer}


def _placeholder_key(text: str) -> str:
    # Case, spaces and braces aside: "{Your Answer}", "your answer" and the maths normaliser's "{youranswer}" agree.
    return "".join(char for char in text.casefold() if char not in "{} \t\n").rstrip(".")


_PLACEHOLDER_KEYS = {name: {_placeholder_key(p) for p in texts} for name, texts in ANSWER_PLACEHOLDERS.items()}
SLOT = "\u00a7"  # what a slot phrase becomes in an answer's skeleton
# A slot phrase in brackets of any kind: `{year}`, `{{answer}}`, `[your answer]`, `<your answer>`, `{you're chosen}`
# (words only, two letters at least, so `\\frac{1}{2}`, `[1]` and `x < y` are no slots).
_BRACKETED_SLOT = re.compile(r"[{\[<]+\s*[a-z][a-z' _-]*[a-z]\s*[}\]>]+")


def _plain_slots(placeholders: tuple[str, ...]) -> re.Pattern:
    """The words of a prompt set's placeholders written plainly: `option text`, `your answer` (also `youranswer`)."""
    words = {word for text in placeholders for word in re.findall(r"\{([^{}]+)\}", text)}
    spelled = (r"\s*".join(map(re.escape, word.split())) for word in sorted(words, key=len, reverse=True))
    return re.compile("|".join(rf"(?<![a-z]){word}(?![a-z])" for word in spelled))


_PLAIN_SLOTS = {name: _plain_slots(texts) for name, texts in ANSWER_PLACEHOLDERS.items()}
# A value slot: a slot right after `=` or `:` (the format pool's `born={year}`, `"pick": "{letter}"`).
_VALUE_SLOT = re.compile(rf"[=:]\s*[\"']?{SLOT}")
# A choice label beside slots (`X) option text`): the label names no option when the text is a slot.
_LABEL = re.compile(r"(?<![a-z0-9])[a-z0-9](?![a-z0-9])")


def answer_skeleton(answer: str, prompt_set: str) -> str:
    """`answer` casefolded, spaces collapsed, each slot phrase (bracketed words, or the prompt set's slot words)
    replaced by `SLOT`: `X) option text` gives `x) SLOT`."""
    skeleton = _BRACKETED_SLOT.sub(SLOT, " ".join(answer.casefold().split()))
    plain = _PLAIN_SLOTS.get(prompt_set)
    return plain.sub(SLOT, skeleton) if plain is not None else skeleton


def is_placeholder(answer: str | None, prompt_set: str) -> bool:
    """Whether `answer` copies a prompt's answer slot: its skeleton holds a slot and only punctuation besides (for
    multiple choice, one label: `X) option text`), or a slot where a value goes (`born={year}`). A slot beside words
    is an answer (`{letter}) adding heat`); see docs/method.md#roles-and-prompts."""
    if not answer:
        return False
    if _placeholder_key(answer) in _PLACEHOLDER_KEYS.get(prompt_set, ()):
        return True
    skeleton = answer_skeleton(answer, prompt_set)
    if SLOT not in skeleton:
        return False
    rest = skeleton.replace(SLOT, " ")
    if prompt_set == "choice":
        rest = _LABEL.sub(" ", rest, count=1)
    return not any(char.isalnum() for char in rest) or bool(_VALUE_SLOT.search(skeleton))


def render_answer(answer: str, answer_style: str) -> str:
    """`answer` as an agent must state it: `<A>answer</A>` ("tag") or `\\boxed{answer}` ("boxed")."""
    if answer_style == "tag":
        return f"{TAG_OPEN}{answer}{TAG_CLOSE}"
    if answer_style == "boxed":
        return f"{BOXED_OPEN}{answer}}}"
    raise ValueError(f"unknown answer_style {answer_style!r}; expected one of {sorted(ANSWER_PARSERS)}")


def should_stop(previous_answer: str | None, new_answer: str | None) -> bool:
    """The stop rule (docs/method.md#turn-loop): the newest stated answer equals the one stated before it."""
    return new_answer not in (None, "") and new_answer == previous_answer


class AnswerTracker:
    """The stated answers of one conversation under the stop rule; utterances without one are skipped over (in a
    debate, Alice `<A>X</A>`, Bob's critique, Alice `<A>X</A>` stops). `final_answer`: the last one ("" if none)."""

    def __init__(self) -> None:
        self.final_answer = ""

    def update(self, new_answer: str | None) -> bool:
        """Record the newest utterance's answer (None or "": none); True when the conversation stops."""
        if new_answer in (None, ""):
            return False
        stop = should_stop(self.final_answer, new_answer)
        self.final_answer = new_answer
        return stop
