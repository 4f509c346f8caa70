"""Where each assistant turn of a rendered chat lies, under any chat template (docs/method.md#loss-masks, D17).

The trainer's loss masks and the LM loss both need it, so it sits below both. The content of assistant message k
starts where a sentinel put in its place appears, and ends after the end-of-turn token that follows; this needs
only that rendering a prefix of the conversation gives a prefix of the text, which is checked, never assumed.
"""

from __future__ import annotations

from typing import Any


class MaskError(ValueError):
    """The chat template does not render conversation prefixes as text prefixes."""


SENTINEL = "\u2063optima-turn-start\u2063"  # text no real message contains


def _render(tokenizer: Any, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False)


def trained_char_spans(tokenizer: Any, messages: list[dict], end_of_turn: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (content and `end_of_turn`).

    Raises:
        MaskError: the template does not render a prefix of the messages as a prefix of the text.
    """
    full = _render(tokenizer, messages)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        probe = _render(tokenizer, [*messages[:k], {"role": "assistant", "content": SENTINEL}])
        head = probe[: probe.find(SENTINEL)]
        upto = _render(tokenizer, messages[: k + 1])
        if SENTINEL not in probe or not (full.startswith(upto) and upto.startswith(head)):
            raise MaskError(f"the chat template does not render message {k} as a continuation of the ones before")
        end = upto.find(end_of_turn, len(head))
        spans.append((len(head), end + len(end_of_turn) if end >= 0 else len(upto)))
    return full, spans
