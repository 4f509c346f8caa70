"""Memory estimates of the GPU allocation: model weights, KV caches, vLLM's own share, the trainer's peak (pure).

Sizes come from the model's ``config.json`` (a local folder) or, for a hub name without a local config, from
``KNOWN_MODELS`` (the models the shipped recipes use). A Llama-style decoder has

    params = vocab x hidden (embeddings) [+ vocab x hidden (lm_head, unless tied)]
             + layers x (2 x hidden^2 + 2 x hidden x kv_heads x head_dim      # q, o and k, v projections
                         + 3 x hidden x intermediate + 2 x hidden)            # gated MLP, two norms

(Llama-3-8B: 8.03e9). Every estimate is in bytes; ``optima.hardware.allocation`` turns them into per-GPU claims (a vLLM
server's, from its arguments: ``optima.hardware.vllm_memory``).

The trainer's peak per GPU (``trainer_peak_bytes``), for P parameters, N training processes, w bytes per weight
(the trainer YAML's ``dtype``: 2 for bf16, 4 for fp32):

* states: one process ``4 w P`` (weights, gradients and AdamW's two moments, all in the weights' dtype); DDP
  ``5 w P`` (and its gradient buckets: DDP's reducer copies every gradient into flat buckets, ``w P`` in all);
  FSDP2 ``16 P / N + w (2 P_layer + vocab x hidden)`` under mixed precision (accelerate 1.15 upcasts every trainable
  parameter to fp32 before ``fully_shard``, ``fsdp2_prepare_model``: fp32 shard, gradients and moments; the units
  gathered for compute and prefetch in the weights' dtype), ``4 w P / N + ...`` without it;
  ZeRO-3 ``16 P / N + w min(P, 1e9)`` (bf16 weights and gradients, fp32 master weights and moments, sharded; plus
  DeepSpeed's live parameters, ``stage3_max_live_parameters``); LoRA: the frozen base ``w P`` (``/ N`` when
  sharded) plus ``16 P_lora`` for the adapter;
* DPO's reference model: ``w P`` (``/ N`` when sharded); none with LoRA (the base without the adapter) or with
  ``precompute_ref_log_probs``;
* activations, per process with batch b (x2 for DPO: chosen and rejected), sequence s (``max_length``): the
  logits in fp32 with their log-softmax and gradient ``3 x b s vocab x 4``; with activation checkpointing one saved
  input per layer ``b s hidden layers w`` plus one layer recomputed ``2 b s (4 hidden + 2 intermediate) w``;
  without it ``b s layers (10 hidden + 2 intermediate) w``;
* plus ``TRAINER_OVERHEAD``: CUDA context, NCCL buffers and allocator fragmentation (10% on top of 2 GiB); a CPU
  process (strategy ``cpu``) has no CUDA context nor NCCL, but its heap keeps what it freed (the allocator
  settings of ``optima.training.launch_config.CPU_ALLOCATOR_ENV``): 10% on top of ``CPU_TRAINER_OVERHEAD``.

Every figure is an estimate for planning (an upper bound where the frameworks leave a choice), not a measurement:
docs/gpu.md says what was verified where.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from optima.config.rules import vllm_dtype_arg
from optima.hardware.capacity import (
    DTYPE_BYTES,
    GIB,
    conversation_kv_tokens,
    kv_shape,
    load_model_config,
    loss_kv_tokens,
)

if TYPE_CHECKING:
    from optima.config import LoopRecipe, Recipe

_LLAMA3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
_SMOLLM2_135M = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "vocab_size": 49152,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
# Models of the shipped recipes, by hub name (matched without the organisation, case-insensitively).
KNOWN_MODELS: dict[str, dict] = {
    "Meta-Llama-3-8B-Instruct": _LLAMA3_8B,
    "Meta-Llama-3-8B": _LLAMA3_8B,
    "Llama-3.1-8B-Instruct": _LLAMA3_8B | {"max_position_embeddings": 131072},
    "SmolLM2-135M-Instruct": _SMOLLM2_135M,
}
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads")
# "auto" (vLLM's and transformers' default) keeps a checkpoint's own dtype: half precision for the shipped models.
AUTO_DTYPE_BYTES = 2
# Tokens of an agent's first request (system prompt, question, private context) when nothing is measured yet.
PROMPT_TOKENS = 1024
# What a sleeping vLLM server (sleep level 2: weights and KV cache released) still holds on each of its GPUs.
SLEEPING_SERVER = 2 * GIB
TRAINER_OVERHEAD, TRAINER_OVERHEAD_SHARE = 2 * GIB, 0.10
# A CPU trainer's fixed cost beyond its tensors: the Python stack (~0.35 GB), the heap the allocator keeps and
# fragmentation. Checked against the peak resident memory (ru_maxrss) of SmolLM2-135M SFT (fp32, batch 4, one
# epoch, CPU_ALLOCATOR_ENV) on the demo's rows: 6.93 GiB at rows of up to 416 tokens, 7.08 GiB at 415 (estimate
# 7.0 GiB; with 1 GiB it was 6.0, under the measurement).
CPU_TRAINER_OVERHEAD = 2 * GIB
ZERO3_LIVE_PARAMETERS = 10**9  # DeepSpeed's stage3_max_live_parameters default
OPTIMIZER_BYTES = 16  # ZeRO's K + 4: bf16 weight and gradient, fp32 master weight and two Adam moments


@dataclass(frozen=True)
class ModelSize:
    """The numbers the estimates need, from a config.

    Args:
        name: The model as the recipe names it.
        config: Its ``config.json`` (or the ``KNOWN_MODELS`` entry).
        source: Where the numbers come from (``config.json of <folder>`` or ``built-in table``).
    """

    name: str
    config: Mapping
    source: str

    def _get(self, key: str) -> int:
        return int(self.config[key])

    @property
    def hidden(self) -> int:
        return self._get("hidden_size")

    @property
    def layers(self) -> int:
        return self._get("num_hidden_layers")

    @property
    def vocab(self) -> int:
        return self._get("vocab_size")

    @property
    def intermediate(self) -> int:
        return self._get("intermediate_size")

    @property
    def layer_params(self) -> int:
        h, shape = self.hidden, kv_shape(self.config, 1)  # KV heads and head size as the KV-cache sizing reads them
        return 2 * h * h + 2 * h * shape.kv_heads * shape.head_dim + 3 * h * self.intermediate + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Parameter count (formula in the module docstring)."""
        heads = 1 if self.config.get("tie_word_embeddings") else 2
        return heads * self.embedding_params + self.layers * self.layer_params + self.hidden

    @property
    def max_len(self) -> int:
        return int(self.config.get("max_position_embeddings") or 4096)

    def weight_bytes(self, dtype_bytes: int) -> int:
        return self.params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return kv_shape(self.config, dtype_bytes).bytes_per_token


def known_model(name: str) -> dict | None:
    """The ``KNOWN_MODELS`` entry of a hub name (``org/name`` or ``name``), if any."""
    wanted = str(name).rstrip("/").rsplit("/", 1)[-1].lower()
    return next((config for key, config in KNOWN_MODELS.items() if key.lower() == wanted), None)


def model_size(*candidates: str | Path | None) -> ModelSize | None:
    """The size of the first candidate that has one: a local folder's ``config.json``, else a known hub name.

    Later candidates stand in for a model that does not exist yet (a checkpoint an earlier stage writes: the
    trainer YAML's base model, the tokenizer's model).
    """
    for candidate in (c for c in candidates if c):
        config = load_model_config(candidate)
        config = (config.get("text_config") or config) if config is not None else None
        if config is not None and all(key in config for key in REQUIRED_KEYS):
            return ModelSize(str(candidates[0]), config, f"config.json of {candidate}")
        table = known_model(str(candidate))
        if table is not None:
            return ModelSize(str(candidates[0]), table, f"built-in table ({Path(str(candidate)).name})")
    return None


def dtype_bytes(name: str | None, default: int) -> int:
    """Bytes per value of a dtype name (``capacity.DTYPE_BYTES``, ``auto``: 2); ``default`` for an unknown name."""
    return AUTO_DTYPE_BYTES if name == "auto" else DTYPE_BYTES.get(name, default)


def served_dtype_bytes(vllm_extra_args: list[str]) -> int:
    """Bytes per weight vLLM serves with on a GPU: ``--dtype`` of ``vllm_extra_args``, else 2 (vLLM's auto)."""
    return dtype_bytes(vllm_dtype_arg(vllm_extra_args), 2)


def policy_kv_min_bytes(size: ModelSize, recipe: Recipe, dtype_bytes: int) -> int:
    """KV cache for one conversation at its longest (``optima.hardware.capacity.conversation_kv_tokens``).

    The generation stage runs as many conversations at once as the servers' caches hold (``fit_in_flight``), so one
    is the floor below which a conversation cannot finish without preemption.
    """
    max_len = recipe.max_model_len or size.max_len
    tokens = conversation_kv_tokens(PROMPT_TOKENS, recipe.max_tokens, recipe.max_turns, max_len)
    return tokens * size.kv_bytes_per_token(dtype_bytes)


def loss_kv_min_bytes(size: ModelSize, recipe: LoopRecipe, dtype_bytes: int) -> int:
    """KV cache for one batch of LM-loss texts: ``loss_batch_size x min(max_total_tokens, max_model_len)`` tokens."""
    tokens = loss_kv_tokens(recipe.loss_batch_size, recipe.max_total_tokens, recipe.max_model_len or size.max_len)
    return tokens * size.kv_bytes_per_token(dtype_bytes)


@dataclass(frozen=True)
class TrainerShape:
    """What the trainer's peak depends on (from the accelerate config and the trainer YAML).

    Args:
        strategy: ``ddp``, ``fsdp``, ``zero3``, or ``cpu`` (training on the CPU: no CUDA context).
        processes: Training processes in all (N).
        dtype_bytes: Bytes per weight (the trainer YAML's ``dtype``).
        batch: ``per_device_train_batch_size``.
        seq: ``max_length``.
        checkpointing: Activation checkpointing on.
        dpo: A DPO trainer (chosen and rejected in one batch; a reference model unless LoRA or precomputed).
        lora_rank: LoRA rank, 0 without LoRA.
        precomputed_reference: ``precompute_ref_log_probs``.
        mixed_precision: The accelerate config's ``mixed_precision`` is not ``no`` (FSDP2 then trains fp32 master
            weights).
    """

    strategy: str
    processes: int
    dtype_bytes: int
    batch: int
    seq: int
    checkpointing: bool
    dpo: bool = False
    lora_rank: int = 0
    precomputed_reference: bool = False
    mixed_precision: bool = False


def trainer_peak_bytes(size: ModelSize, shape: TrainerShape) -> int:
    """Peak memory of one training process (formulas in the module docstring)."""
    p, n, w = size.params, max(1, shape.processes), shape.dtype_bytes
    sharded = shape.strategy in ("zero3", "fsdp")
    if shape.lora_rank:
        lora = shape.lora_rank * 2 * size.hidden * 7 * size.layers  # rank x (in + out), 7 projections
        states = w * p / (n if sharded else 1) + OPTIMIZER_BYTES * lora
    elif shape.strategy == "zero3":
        states = OPTIMIZER_BYTES * p / n + w * min(p, ZERO3_LIVE_PARAMETERS)
    elif shape.strategy == "fsdp":
        master = OPTIMIZER_BYTES if shape.mixed_precision else 4 * w  # fp32 upcast of the trainable parameters
        states = master * p / n + w * (2 * size.layer_params + size.embedding_params)
    elif shape.strategy == "ddp":
        states = 4 * w * p + w * p  # plus the gradient buckets
    else:
        states = 4 * w * p
    reference = 0.0
    if shape.dpo and not shape.lora_rank and not shape.precomputed_reference:
        reference = w * p / (n if sharded else 1)
    overhead = CPU_TRAINER_OVERHEAD if shape.strategy == "cpu" else TRAINER_OVERHEAD
    return math.ceil((states + reference + activation_bytes(size, shape)) * (1 + TRAINER_OVERHEAD_SHARE)) + overhead


def activation_bytes(size: ModelSize, shape: TrainerShape) -> int:
    """Activations of one process: the fp32 logits, and the saved or recomputed layer activations."""
    b, s, w = shape.batch * (2 if shape.dpo else 1), shape.seq, shape.dtype_bytes
    h, inter, layers = size.hidden, size.intermediate, size.layers
    logits = 3 * b * s * size.vocab * 4
    if shape.checkpointing:
        layer_acts = b * s * h * layers * w + 2 * b * s * (4 * h + 2 * inter) * w
    else:
        layer_acts = b * s * layers * (10 * h + 2 * inter) * w
    return logits + layer_acts


def gib(value: float) -> float:
    """Bytes as GiB (rounded to 0.1 for messages)."""
    return round(value / GIB, 1)
