"""How many KV-cache tokens a conversation of this stage may need: its agents' rendered prompts plus the turn budget.

The prompt of an information-exchange task carries the agent's half of the context (HotpotQA: ~5 paragraphs), so
the same ``max_tokens``/``max_turns`` cost very different amounts of cache on ARC and on HotpotQA. The estimate
renders both agents' first request, exactly as the generator sends it, for a sample of the stage's questions with
the served tokenizer and its chat template, and takes the 90th percentile; ``optima.hardware.capacity`` turns it
into a worst-case footprint and an in-flight bound. Before a policy server starts, ``policy_demand`` measures the
same on the run's questions: the KV cache its conversations in flight can use (the cap of its CPU cache) and a
first estimate of a training row (the trainer's memory reserve beside a kept policy).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from optima.agents.prompts import AGENT_NAMES, build_agent_messages
from optima.config.rules import tokenizer_path
from optima.hardware.capacity import PolicyDemand, conversation_kv_tokens, cpu_kv_bytes_per_token, load_model_config
from optima.quantiles import nearest_rank_quantile
from optima.tasks import Example, get_task

if TYPE_CHECKING:
    from optima.config import Recipe

logger = logging.getLogger(__name__)

SAMPLED_QUESTIONS = 64
CHARS_PER_TOKEN = 3  # a deliberately low ratio (more tokens) when no tokenizer can be loaded


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:  # a hub id offline, a folder without tokenizer files
        logger.warning("cannot load the tokenizer of %s (%s); estimating prompt tokens from characters", path, exc)
        return None


def prompt_tokens(recipe: Recipe, examples: Sequence[Example], served_path: str | None = None) -> int:
    """90th percentile over (a sample of) ``examples`` of the longer of the two agents' first rendered requests.

    Args:
        recipe: Its ``tokenizer_first_path`` / ``initial_model_path`` name the tokenizer.
        examples: The stage's questions.
        served_path: The served model (its tokenizer, unless the recipe names Alice's).
    """
    if not examples:
        return 0
    step = max(1, len(examples) // SAMPLED_QUESTIONS)
    path = tokenizer_path(recipe, model=served_path)
    tokenizer = _load_tokenizer(path) if path else None
    counts = []
    for example in examples[::step]:
        task = get_task(example.task)
        views = [build_agent_messages(example, name, [], None, task) for name in AGENT_NAMES]
        counts.append(max(_count(tokenizer, messages) for messages in views))
    return nearest_rank_quantile(counts, 0.9)


def _count(tokenizer, messages: list[dict]) -> int:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return sum(len(m["content"]) for m in messages) // CHARS_PER_TOKEN + 8 * len(messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def footprint_of(recipe: Recipe, prompt: int, model_path: str | None) -> int:
    """``conversation_kv_tokens`` of agents' prompts of ``prompt`` tokens under the recipe's turn budget, within the
    served context length (``max_model_len``, else the model's ``max_position_embeddings``)."""
    max_model_len = recipe.max_model_len
    if max_model_len is None and model_path:
        config = load_model_config(model_path) or {}
        max_model_len = (config.get("text_config") or config).get("max_position_embeddings")
    return conversation_kv_tokens(prompt, recipe.max_tokens, recipe.max_turns, max_model_len)


def conversation_footprint(recipe: Recipe, examples: Sequence[Example], model_path: str | None = None) -> int:
    """Worst-case KV tokens of one conversation of this stage (both agents' views, every turn at ``max_tokens``).

    Args:
        recipe: ``max_tokens``, ``max_turns``, ``max_model_len`` (else the model's ``max_position_embeddings``).
        examples: The stage's questions.
        model_path: The served model (tokenizer and context length; default ``initial_model_path``).
    """
    model_path = model_path or recipe.initial_model_path
    return footprint_of(recipe, prompt_tokens(recipe, examples, model_path), model_path)


def policy_demand(recipe: Recipe, examples: Sequence[Example], model_path: str) -> PolicyDemand:
    """What the run's conversations ask of a policy server of ``model_path``, measured on the run's questions.

    ``need_bytes``: ``thread_count`` conversations at the bound of ``conversation_footprint`` (the one the generator
    keeps them under), in fp32 (the CPU's KV dtype); None without the model's layer and head counts.
    ``row_tokens``: a training row before any exists: an agent's prompt (the same 90th percentile) plus one
    utterance of ``max_tokens``.

    Args:
        recipe: Its ``thread_count`` and conversation fields.
        examples: The questions the run's stages draw from (a sample is rendered).
        model_path: The served model.
    """
    prompt = prompt_tokens(recipe, examples, model_path)
    per_conversation = footprint_of(recipe, prompt, model_path)
    per_token = cpu_kv_bytes_per_token(model_path)
    need = recipe.thread_count * per_conversation * per_token if per_token else None
    return PolicyDemand(need, prompt + recipe.max_tokens)
