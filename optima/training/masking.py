"""Per-agent loss masks built from message roles at tokenisation time (docs/method.md#loss-masks, D17).

Each SFT row is one agent's view of a conversation: system prompt, the task as the first user turn, the agent's
own utterances as ``assistant`` turns and the partner's as ``user`` turns. Only the agent's own utterances are
trained, each with its end-of-turn token; the system prompt, the task, the partner's turns and the chat
template's role headers are masked with -100.

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

IGNORE_INDEX = -100


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


def tokenize_with_mask(tokenizer: Any, messages: list[dict], max_length: int | None = None) -> dict[str, list[int]]:
    """``input_ids`` and ``labels`` (-100 outside the agent's own turns) of one agent's view.

    Args:
        tokenizer: A fast tokenizer (offsets are needed) with a chat template.
        messages: One agent's view.
        max_length: Keep at most this many tokens (from the start).
    """
    end_of_turn = tokenizer.eos_token
    text, spans = trained_char_spans(tokenizer, messages, end_of_turn)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    labels = [IGNORE_INDEX] * len(input_ids)
    span_index = 0
    for i, (start, end) in enumerate(offsets):
        while span_index < len(spans) and spans[span_index][1] <= start:
            span_index += 1
        if span_index < len(spans) and end > start and spans[span_index][0] <= start and end <= spans[span_index][1]:
            labels[i] = input_ids[i]
    if max_length is not None:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return {"input_ids": input_ids, "labels": labels}


def decode_trained(tokenizer: Any, row: dict[str, list[int]]) -> list[str]:
    """The trained stretches of a tokenised row, decoded (for tests and inspection)."""
    pieces, current = [], []
    for token, label in zip(row["input_ids"], row["labels"], strict=True):
        if label == IGNORE_INDEX:
            if current:
                pieces.append(tokenizer.decode(current))
                current = []
        else:
            current.append(token)
    if current:
        pieces.append(tokenizer.decode(current))
    return pieces
