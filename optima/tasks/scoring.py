"""Task scores: how right a parsed final answer is, in [0, 1] (the R_task term of the reward; docs/method.md#scoring).

One scorer per score type, chosen through `SCORERS[score_type]` (no branching on task names):

| type | tasks | `mode="default"` | `mode="original"` (`compat: original`, docs/method.md D15, D16, D28) |
| --- | --- | --- | --- |
| "f1" | hotpot_qa, mwh_qa, trival_qa, cbt | SQuAD word F1 | subword F1 with the model tokenizer (see below) |
| "choice" | arc, mmlu | option label ("B", "(B)", "B) text") or text | exact match (below) |
| "number" | gsm8k | numeric ("1,000" == "1000" == "1000.0", "70%" == "70") | exact match (below) |
| "math" | math | fast string/number path, then symbolic | same as default |

Original F1 strips "m=" as a character set (D15) and applies no SQuAD normalisation (D16); the `mode="original"`
exact match (`original_exact_match`) is `gold.strip().lower() == prediction.strip().strip("\\").lower()` and
nothing more (no trailing period forgiven). For "choice" it compares the option text after the label that the prompt
asks for: "B) text" is compared as "text" against the original's gold option text (D28).
For several gold aliases (TriviaQA) the maximum is taken. A missing prediction (None or "") scores 0. No scorer
raises on model output, whatever it contains. The same-answer-twice stop rule lives in `answers.py` and is
re-exported here (`AnswerTracker`, `should_stop`).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from optima.tasks import Example, Task, get_task
from optima.tasks.answers import (  # noqa: F401  (re-exported: one import site for parsers and scorers)
    ANSWER_PARSERS,
    AnswerTracker,
    normalize_final_answer,
    parse_boxed,
    parse_math_answer,
    parse_tag,
    should_stop,
    without_percent,
)
from optima.tasks.math_equiv import MathVerifier, numeric_value

Tokenize = Callable[[str], list[str]]
MODES = ("default", "original")
# The version of the scorers: raise it with any change that scores some answer otherwise (result fingerprints and
# the keys of the stages that score record it).
SCORER_VERSION = 1

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
# A label written as "B", "(B)", "B.", "B)" or "[B]", optionally after "option"/"answer".
_BARE_LABEL = re.compile(r"(?:(?:option|answer)\s*:?\s*)?[(\[]?\s*([a-z0-9])\s*[)\].:]?")
# A label followed by text: "(B) text", "B) text", "B. text", "B: text".
# The unbracketed form needs a space after the mark, so "1.5 m" is not read as label "1".
# The label the prompts ask for and the questions render: "B) text" (the label, then the text).
_PROMPT_LABEL = re.compile(r"([A-Za-z0-9])\)\s+(.+)", re.DOTALL)
_LABELLED_TEXT = re.compile(r"(?:(?:option|answer)\s*:?\s*)?(?:\(([a-z0-9])\)\s*|([a-z0-9])[).:]\s+)(.+)", re.DOTALL)


@dataclass(frozen=True)
class ScoreContext:
    """What a scorer may need beyond the two strings.

    Parameters:
        mode (`str`): "default" or "original".
        tokenize (`Callable[[str], list[str]] | None`): the model tokenizer's `tokenize`, for original F1.
        options (`tuple[tuple[str, str], ...]`): (label, text) options of a multiple-choice question.
        verifier (`MathVerifier | None`): a shared symbolic checker for "math" (one is made per call if None).
    """

    mode: str = "default"
    tokenize: Tokenize | None = None
    options: tuple[tuple[str, str], ...] = ()
    verifier: MathVerifier | None = None


def normalize_squad(text: str) -> str:
    """SQuAD answer normalisation: lower-case, drop punctuation and articles, collapse whitespace.

    Args:
        text: an answer.
    """
    text = "".join(char for char in text.lower() if char not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1_from_tokens(prediction_tokens: Sequence[str], gold_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 between two token lists (0 when they share nothing).

    Args:
        prediction_tokens: tokens of the prediction.
        gold_tokens: tokens of the gold answer.
    """
    common = sum((Counter(prediction_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_f1(prediction: str, gold: str) -> float:
    """Standard SQuAD word F1 (our default QA score).

    Args:
        prediction: the predicted answer.
        gold: the gold answer.
    """
    prediction_tokens, gold_tokens = normalize_squad(prediction).split(), normalize_squad(gold).split()
    if not prediction_tokens or not gold_tokens:
        return float(prediction_tokens == gold_tokens)
    return f1_from_tokens(prediction_tokens, gold_tokens)


def _original_f1_text(text: str) -> str:
    # Deliberately character-set strips (``compat: original``, docs/method.md D15): they also eat leading/trailing
    # "m", "=" and " " characters. Only used in compat mode, to reproduce the paper's reward.
    return text.lower().strip().strip("m=").strip("m = ")  # noqa: B005


def subword_f1(prediction: str, gold: str, tokenize: Tokenize) -> float:
    """The reward F1 of ``compat: original``: bag-of-subwords F1 with the model tokenizer, no SQuAD normalisation.

    Args:
        prediction: the predicted answer.
        gold: the gold answer.
        tokenize: the model tokenizer's `tokenize` (e.g. `AutoTokenizer.from_pretrained(...).tokenize`).
    """
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
    """Return the label of the option a prediction names (by text first, then by label), or None.

    Args:
        prediction: e.g. "B", "(B)", "B) copper", "copper" (case- and space-insensitive).
        options: the question's (label, text) options.
    """
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
    """The text after a leading option label written as the prompt asks ("B) text" -> "text"), else the prediction.

    Only a label of one of the question's options counts, followed by ")" and a space, as the questions render
    their options (``render_choice_question``) and the prompts ask for them (``<A>{letter}) {option text}</A>``).

    Args:
        prediction: the parsed final answer.
        options: the question's (label, text) options.
    """
    match = _PROMPT_LABEL.match(prediction.strip())
    labels = {label.casefold() for label, _ in options}
    return match.group(2) if match and match.group(1).casefold() in labels else prediction


def score_choice(prediction: str, gold: str, context: ScoreContext) -> float:
    """Score type "choice": 1 if the prediction names the gold option (label or text), else 0.

    ``mode="original"``: the original's exact match on the option text after the label (the prompt asks for
    "letter) text" and the original's gold is the option text).
    """
    if context.mode == "original":
        return original_exact_match(option_text_after_label(prediction, context.options), gold)
    if not context.options:
        return float(_normalize_option(prediction) == _normalize_option(gold))
    gold_label = resolve_choice(gold, context.options)
    return float(gold_label is not None and resolve_choice(prediction, context.options) == gold_label)


def original_exact_match(prediction: str, gold: str) -> float:
    """The exact match of `compat: original`: `gold.strip().lower() == prediction.strip().strip("\\\\").lower()`.

    Nothing else is forgiven: no trailing period, no label (``score_choice`` removes the prompt's "letter) " label
    before calling it).

    Args:
        prediction: the parsed final answer.
        gold: the gold answer.
    """
    return float(gold.strip().lower() == prediction.strip().strip("\\").lower())


def score_number(prediction: str, gold: str, context: ScoreContext) -> float:
    """Score type "number": numeric equality after `normalize_final_answer` (a trailing `%` ignored); string equality
    as a fallback."""
    if context.mode == "original":
        return original_exact_match(prediction, gold)
    pred_value = numeric_value(without_percent(normalize_final_answer(prediction)))
    gold_value = numeric_value(without_percent(normalize_final_answer(gold)))
    if pred_value is not None and gold_value is not None:
        return float(pred_value == gold_value)
    return float(prediction.strip() == gold.strip())


def score_math(prediction: str, gold: str, context: ScoreContext) -> float:
    """Score type "math": equivalence by `MathVerifier` (fast path first; a one-off verifier if none is given)."""
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
    """Score a prediction with the scorer of `score_type`, taking the maximum over gold aliases.

    Args:
        score_type: a key of `SCORERS`.
        prediction: the parsed final answer (None or "" scores 0).
        gold: the gold answer, or a sequence of aliases.
        context: mode, tokenizer, options and verifier.
    """
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
    """Score a parsed final answer against the gold answer with the task's score type.

    Args:
        task: a `Task` or a task name (aliases accepted).
        prediction: the parsed final answer (None or "" scores 0).
        gold: the gold answer or its aliases.
        context: the mode ("default" or "original", see the module table), the tokenizer's `tokenize` (F1 with
            `mode="original"`), a multiple-choice question's options (without them, text must match) and a shared
            `MathVerifier` for "math" (a one-off verifier is started per call when None).
    """
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
    """Score a parsed final answer against an `Example` (uses its score type, gold answer and options).

    Args:
        example: the `Example` the conversation was about.
        prediction: the parsed final answer.
        mode: "default" or "original".
        tokenize: the model tokenizer's `tokenize`, needed for F1 with `mode="original"`.
        verifier: a shared `MathVerifier` for "math".
    """
    context = ScoreContext(mode=mode, tokenize=tokenize, options=example.options, verifier=verifier)
    return score_by_type(example.score_type, prediction, example.answer, context)
