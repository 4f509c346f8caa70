"""Per-agent loss masks built from message roles at tokenisation time (docs/method.md#loss-masks, D17).

Each SFT row is one agent's view of a conversation: system prompt, the task as the first user turn, the agent's
own utterances as ``assistant`` turns and the partner's as ``user`` turns. Only the agent's own utterances are
trained, each with its end-of-turn token; the system prompt, the task, the partner's turns and the chat
template's role headers are masked with -100.

The trained spans come from the rendered text itself, with any chat template (``optima.lm_loss``).
"""

from __future__ import annotations

from typing import Any

from optima.lm_loss import trained_char_spans

IGNORE_INDEX = -100


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
