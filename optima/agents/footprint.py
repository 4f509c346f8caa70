"""How many KV-cache tokens a conversation of this run may hold: its agents' rendered prompts plus the turn budget.

An information-exchange prompt carries the agent's half of the context (HotpotQA: ~5 paragraphs), so the same
``max_tokens``/``max_turns`` cost very different amounts of cache on ARC and on HotpotQA. Both agents' first
requests are rendered as the generator sends them, for a sample of the questions, with the served tokenizer; the
90th percentile of the longer one is the prompt of ``optima.hardware.memory.conversation_kv_tokens``. It sizes the
policy's CPU KV cache (``policy_demand``) and bounds the conversations in flight (``conversation_footprint``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from optima.agents.prompts import AGENT_NAMES, build_agent_messages
from optima.config.rules import tokenizer_path
from optima.hardware.memory import DTYPE_BYTES, conversation_kv_tokens, kv_bytes_per_token, load_model_config
from optima.tasks import Example, get_task

if TYPE_CHECKING:
    from optima.config import Recipe

logger = logging.getLogger(__name__)

SAMPLED_QUESTIONS = 64
CHARS_PER_TOKEN = 3  # a deliberately low ratio (more tokens) when no tokenizer can be loaded


def prompt_tokens(recipe: Recipe, examples: Sequence[Example], served_path: str | None = None) -> int:
    """90th percentile over a sample of ``examples`` of the longer of the two agents' first rendered requests,
    counted with Alice's tokenizer (the recipe's, else the served model's)."""
    if not examples:
        return 0
    from transformers import AutoTokenizer

    path, tokenizer = tokenizer_path(recipe, model=served_path), None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path) if path else None
    except (OSError, ValueError) as exc:  # a hub id offline, a folder without tokenizer files
        logger.warning("cannot load the tokenizer of %s (%s); estimating prompt tokens from characters", path, exc)
    counts = []
    for example in examples[:: max(1, len(examples) // SAMPLED_QUESTIONS)]:
        task = get_task(example.task)
        views = [build_agent_messages(example, name, [], None, task) for name in AGENT_NAMES]
        counts.append(max(_count(tokenizer, messages) for messages in views))
    return nearest_rank_quantile(counts, 0.9)


def _count(tokenizer, messages: list[dict]) -> int:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return sum(len(m["content"]) for m in messages) // CHARS_PER_TOKEN + 8 * len(messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def conversation_footprint(recipe: Recipe, examples: Sequence[Example], model_path: str | None = None) -> int:
    """KV tokens of one conversation at its longest (both views, every turn at ``max_tokens``), within the served
    context (``max_model_len``, else the model's); ``model_path``: the served model (default the initial one)."""
    model_path = model_path or recipe.initial_model_path
    config = load_model_config(model_path) if model_path else None
    max_len = recipe.max_model_len or (config or {}).get("max_position_embeddings")
    prompt = prompt_tokens(recipe, examples, model_path)
    return conversation_kv_tokens(prompt, recipe.max_tokens, recipe.max_turns, max_len)


def policy_demand(recipe: Recipe, examples: Sequence[Example], model_path: str) -> int | None:
    """KV bytes that ``thread_count`` conversations at their longest need on a CPU policy server of ``model_path``
    (fp32); None without the model's layer and head counts (no cap)."""
    per_token = kv_bytes_per_token(load_model_config(model_path), DTYPE_BYTES["float32"])
    if per_token is None:
        return None
    return recipe.thread_count * conversation_footprint(recipe, examples, model_path) * per_token


def nearest_rank_quantile(values: Iterable[int], q: float) -> int:
    """The `q` quantile by nearest rank: the value at rank `ceil(q * n)`, always one of the values (0 for none)."""
    ordered = sorted(values)
    if not ordered:
        return 0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
