"""Task scores: how right a parsed answer is, in [0, 1] (the reward's task score), the flexible answer of a reply
outside the answer format, and stored rows re-parsed after a parser change (docs/method.md#scoring).

One scorer per score type, `SCORERS[score_type]`; `mode="original"` (recipe `compat: original`) is the
original's scoring: subword F1 with the model tokenizer, exact match for "choice" and "number". A missing
prediction scores 0; several gold aliases (TriviaQA) take the maximum; nothing raises on model output.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from optima.tasks import Example, Task, get_task
from optima.tasks.answers import (
    PARSER_VERSION,
    PARSER_VERSION_KEY,
    AnswerTracker,
    is_placeholder,
    normalize_final_answer,
    parse_tag,
    without_percent,
)
from optima.tasks.math_equiv import MathVerifier, numeric_value

Tokenize = Callable[[str], list[str]]
MODES = ("default", "original")
# Raise it with any change that scores some answer otherwise (stage keys and result fingerprints record it).
SCORER_VERSION = 1

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
# A label written as "B", "(B)", "B.", "B)" or "[B]", optionally after "option"/"answer".
_BARE_LABEL = re.compile(r"(?:(?:option|answer)\s*:?\s*)?[(\[]?\s*([a-z0-9])\s*[)\].:]?")
# The label the prompts ask for and the questions render: "B) text".
_PROMPT_LABEL = re.compile(r"([A-Za-z0-9])\)\s+(.+)", re.DOTALL)
# A label followed by text: "(B) text", "B) text", "B. text", "B: text" (a space after the mark: "1.5 m" is no label).
_LABELLED_TEXT = re.compile(r"(?:(?:option|answer)\s*:?\s*)?(?:\(([a-z0-9])\)\s*|([a-z0-9])[).:]\s+)(.+)", re.DOTALL)


@dataclass(frozen=True)
class ScoreContext:
    """What a scorer may need beyond the two strings: the mode ("default" or "original"), the model tokenizer's
    `tokenize` (original F1), a multiple-choice question's options, a shared `MathVerifier` (else one per call)."""

    mode: str = "default"
    tokenize: Tokenize | None = None
    options: tuple[tuple[str, str], ...] = ()
    verifier: MathVerifier | None = None


def normalize_squad(text: str) -> str:
    """SQuAD's normalisation: lower-case, no punctuation or articles, whitespace collapsed."""
    text = "".join(char for char in text.lower() if char not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1_from_tokens(prediction_tokens: Sequence[str], gold_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 (0 when they share nothing)."""
    common = sum((Counter(prediction_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_f1(prediction: str, gold: str) -> float:
    """SQuAD word F1 (our QA score); both empty is 1."""
    prediction_tokens, gold_tokens = normalize_squad(prediction).split(), normalize_squad(gold).split()
    if not prediction_tokens or not gold_tokens:
        return float(prediction_tokens == gold_tokens)
    return f1_from_tokens(prediction_tokens, gold_tokens)


def _original_f1_text(text: str) -> str:
    # The original's character-set strips (they also eat leading and trailing "m", "=" and " "): compat mode only.
    return text.lower().strip().strip("m=").strip("m = ")  # noqa: B005


def subword_f1(prediction: str, gold: str, tokenize: Tokenize) -> float:
    """The original's F1: bag of the model tokenizer's subwords (`tokenize`), no SQuAD normalisation."""
    return f1_from_tokens(tokenize(_original_f1_text(prediction)), tokenize(_original_f1_text(gold)))


def score_f1(prediction: str, gold: str, context: ScoreContext) -> float:
    """Score type "f1": SQuAD word F1, or subword F1 with `mode="original"` (needs `tokenize`)."""
    if context.mode == "original":
        if context.tokenize is None:
            raise ValueError("mode='original' F1 needs tokenize= (the model tokenizer's tokenize function)")
        return subword_f1(prediction, gold, context.tokenize)
    return squad_f1(prediction, gold)


def _normalize_option(text: str) -> str:
    return " ".join(text.casefold().split()).rstrip(".").strip()


def resolve_choice(prediction: str, options: Sequence[tuple[str, str]]) -> str | None:
    """The label of the option a prediction names ("B", "(B)", "B) copper", "copper"; text first), or None."""
    answer = _normalize_option(prediction)
    by_text = {_normalize_option(text): label for label, text in reversed(options)}
    by_label = {label.casefold(): label for label, _ in options}
    if answer in by_text:
        return by_text[answer]
    bare = _BARE_LABEL.fullmatch(answer)
    if bare and bare.group(1) in by_label:
        return by_label[bare.group(1)]
    labelled = _LABELLED_TEXT.fullmatch(answer)
    if labelled:
        label = labelled.group(1) or labelled.group(2)
        if label in by_label:
            return by_label[label]
    return None


def option_text_after_label(prediction: str, options: Sequence[tuple[str, str]]) -> str:
    """The text after a leading label of one of the options, written as the prompt asks ("B) text" -> "text")."""
    match = _PROMPT_LABEL.match(prediction.strip())
    labels = {label.casefold() for label, _ in options}
    return match.group(2) if match and match.group(1).casefold() in labels else prediction


def score_choice(prediction: str, gold: str, context: ScoreContext) -> float:
    """Score type "choice": whether the prediction names the gold option (label or text); original: exact match
    of the option text after the label (the original's gold is the option text)."""
    if context.mode == "original":
        return original_exact_match(option_text_after_label(prediction, context.options), gold)
    if not context.options:
        return float(_normalize_option(prediction) == _normalize_option(gold))
    gold_label = resolve_choice(gold, context.options)
    return float(gold_label is not None and resolve_choice(prediction, context.options) == gold_label)


def original_exact_match(prediction: str, gold: str) -> float:
    """The original's exact match, nothing else forgiven (no trailing period, no label)."""
    return float(gold.strip().lower() == prediction.strip().strip("\\").lower())


def score_number(prediction: str, gold: str, context: ScoreContext) -> float:
    """Score type "number": equal numbers after `normalize_final_answer` (`%` ignored), else equal strings."""
    if context.mode == "original":
        return original_exact_match(prediction, gold)
    pred_value = numeric_value(without_percent(normalize_final_answer(prediction)))
    gold_value = numeric_value(without_percent(normalize_final_answer(gold)))
    if pred_value is not None and gold_value is not None:
        return float(pred_value == gold_value)
    return float(prediction.strip() == gold.strip())


def score_math(prediction: str, gold: str, context: ScoreContext) -> float:
    """Score type "math": `MathVerifier.is_equivalent`."""
    if context.verifier is not None:
        return float(context.verifier.is_equivalent(prediction, gold))
    with MathVerifier(max_workers=1) as verifier:
        return float(verifier.is_equivalent(prediction, gold))


SCORERS: dict[str, Callable[[str, str, ScoreContext], float]] = {
    "f1": score_f1,
    "choice": score_choice,
    "number": score_number,
    "math": score_math,
}


def score_by_type(score_type: str, prediction: str | None, gold: str | Sequence[str], context: ScoreContext) -> float:
    """The score of a parsed answer (None or "" scores 0) by `score_type`'s scorer: the maximum over gold aliases."""
    if context.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {context.mode!r}")
    if score_type not in SCORERS:
        raise ValueError(f"unknown score type {score_type!r}; expected one of {sorted(SCORERS)}")
    if not prediction:
        return 0.0
    golds = [gold] if isinstance(gold, str) else list(gold)
    scorer = SCORERS[score_type]
    return max((scorer(prediction, alias, context) for alias in golds if alias), default=0.0)


def score_answer(
    task: Task | str, prediction: str | None, gold: str | Sequence[str], context: ScoreContext = ScoreContext()
) -> float:
    """`score_by_type` with the task's score type (a `Task` or its name)."""
    task = get_task(task) if isinstance(task, str) else task
    return score_by_type(task.score_type, prediction, gold, context)


def score_example(
    example: Example,
    prediction: str | None,
    mode: str = "default",
    tokenize: Tokenize | None = None,
    *,
    verifier: MathVerifier | None = None,
) -> float:
    """`score_by_type` against an `Example`: its score type, gold answer and options."""
    context = ScoreContext(mode=mode, tokenize=tokenize, options=example.options, verifier=verifier)
    return score_by_type(example.score_type, prediction, example.answer, context)


# Flexible answers, as lm-eval-harness's `flexible-extract` beside `strict-match`: what a reply names as its answer
# outside the answer format (docs/method.md#metrics). Reported beside the strict answer, never rewarded.
Options = Sequence[tuple[str, str]]

_TAGS = re.compile(r"</?A>")
_BRACED = re.compile(r"\{[^{}]*\}")
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
    """The label one sentence names: after "option", "answer", ... ("the answer is option A"), else marked
    ("(B)", "B)"), else by an option's text, else a bare label ending a clause ("so it is C."); None if none."""
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
    """The label named in the last sentence of `text` that names one (score type "choice")."""
    for sentence in reversed(sentences(clean_reply(text))):
        label = named_option(sentence, options)
        if label is not None:
            return label
    return None


def extract_number(text: str | None, options: Options = ()) -> str | None:
    """The last number of `text`, thousands commas and a dollar sign dropped ("number" and "math")."""
    last = None
    for match in _NUMBER.finditer(clean_reply(text)):
        last = match.group(0)
    return None if last is None else last.replace("$", "").replace(",", "")


def extract_span(text: str | None, options: Options = ()) -> str | None:
    """The tagged span (not a placeholder), else what follows the last "answer is", else the last sentence ("f1")."""
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


FLEXIBLE_EXTRACTORS: dict[str, Callable[[str | None, Options], str | None]] = {
    "choice": extract_choice,
    "number": extract_number,
    "math": extract_number,
    "f1": extract_span,
}


def flexible_answer(texts: Sequence[str], score_type: str, options: Options = ()) -> str | None:
    """The flexible answer of a conversation: that of its last reply (`texts`, oldest first) that names one."""
    if score_type not in FLEXIBLE_EXTRACTORS:
        raise ValueError(f"unknown score type {score_type!r}; expected one of {sorted(FLEXIBLE_EXTRACTORS)}")
    extract = FLEXIBLE_EXTRACTORS[score_type]
    for text in reversed(texts):
        answer = extract(text, options)
        if answer:
            return answer
    return None


def reparsed(record: dict) -> dict:
    """`record` with `final_answer` parsed again from its stored utterances when another parser version wrote it.

    The last answer any utterance states, as the turn loop reads it; the stop point stays as sampled.

    Raises:
        ValueError: a debate row (its answer is a majority: `optima.evaluation.metrics.reparsed_debate`).
    """
    if is_current(record) or "utterances" not in record:
        return record
    if "debate" in record:
        raise ValueError(f"row {record.get('task_id')!r} is a debate: re-parse it with reparsed_debate")
    task, tracker = get_task(record.get("task") or record["example"]["task"]), AnswerTracker()
    for utterance in record["utterances"]:
        tracker.update(task.parse_answer(utterance["text"]))
    return record | {"final_answer": tracker.final_answer, PARSER_VERSION_KEY: PARSER_VERSION}


def is_current(record: dict) -> bool:
    """Whether `record` was parsed by the current parser."""
    return record.get(PARSER_VERSION_KEY) == PARSER_VERSION
