"""Where each assistant turn of a rendered chat lies, with any chat template (docs/method.md#loss-masks, D17).

Matching Llama-3 token patterns (``<|start_header_id|>assistant<|end_header_id|>\\n\\nAlice:``) would silently
fail on other templates and on utterances that do not start with exactly ``Name:`` (docs/method.md, D17). The
trained spans come from the rendered text itself, with any chat template: the content of assistant message k
starts where a sentinel put in its place appears, and ends after the end-of-turn token that follows. Tokens
whose character span lies inside a trained span are trained. This needs only that rendering a prefix of the
conversation gives a prefix of the text, which holds for ChatML, Llama-3 and every template that renders messages
in order; it is checked, never assumed.
"""

from __future__ import annotations

from typing import Any


class MaskError(ValueError):
    """The chat template does not render conversation prefixes as text prefixes."""


SENTINEL = "\u2063optima-turn-start\u2063"  # text no real message contains


def _render(tokenizer: Any, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False)


def trained_char_spans(tokenizer: Any, messages: list[dict], end_of_turn: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (content + end-of-turn).

    The start of turn k is where its content begins: message k is rendered once with a sentinel as content, and
    the text before the sentinel is the turn's header (this also covers templates that insert a default system
    prompt, and a conversation that opens with an assistant turn).

    Args:
        tokenizer: A tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]``.
        end_of_turn: The text that closes an assistant turn (``<|im_end|>``, ``<|eot_id|>``).
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
