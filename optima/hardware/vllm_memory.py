"""What a vLLM server on a GPU takes within its memory share, from vLLM's own arguments (pure).

vLLM 0.32 (``vllm/v1/worker/gpu_worker.py: determine_available_memory``) starts a server in this order: it loads
the weights, runs a profile forward pass of ``max_num_batched_tokens`` tokens spread over ``min(tokens,
max_num_seqs)`` requests followed by one sampler pass over their logits (``gpu_model_runner.py: profile_run``,
``_dummy_sampler_run``), measures the CUDA graphs it will capture (``profile_cudagraph_memory``, on by default:
``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1``), and gives the KV cache what is left of ``gpu_memory_utilization x
total``; it refuses to start when that cache cannot hold one request of ``max_model_len`` tokens
(``v1/core/kv_cache_utils.py: check_enough_kv_cache_memory``). Unset, ``max_num_batched_tokens`` and
``max_num_seqs`` of an API server are 8192 and 1024 on a GPU of at least 70 GiB, else 2048 and 256
(``engine/arg_utils.py``; an A100-80GB gets the smaller pair: planned with the larger, the safe side), and
``max_model_len`` is the model's context. The parts of a server's need per GPU (``server_need``):

* weights: parameters x bytes / tensor parallel size;
* KV cache: the larger of what the run needs (a conversation, a scoring batch) and vLLM's floor, one request of
  ``max_model_len`` (plus one block), / tp;
* runtime: CUDA context, cuBLAS workspaces (vLLM's "non-torch memory", 0.2-0.4 GiB in its logs), plus NCCL's
  buffers with tp > 1;
* profile activations: ``max_num_batched_tokens x (6 hidden + 3 intermediate) x bytes / tp`` (the residual,
  normed and attention streams and the gated MLP of one layer at once);
* sampler: ``min(max_num_batched_tokens, max_num_seqs) x vocab x 28`` bytes (bf16 logits, their fp32 copy, the
  top-k/top-p sort's fp32 values and int64 indices, the probabilities and their cumulative sum, a mask), whole on
  every tensor parallel rank;
* CUDA graphs (none with ``--enforce-eager``): a fixed 0.5 GiB (vLLM logs 0.1-1.4 GiB for 1-8B models) plus the
  activations of the largest captured batch, ``min(2 x max_num_seqs, 512, max_num_batched_tokens)`` tokens;
* prompt log-probabilities (the loss server only): after start-up, each scored request's chunk of at most
  ``min(max_num_batched_tokens, max_model_len)`` tokens gets full-vocabulary logits and their fp32 log-softmax
  (``_get_prompt_logprobs_dict``): ``tokens x vocab x (bytes + 8)``, which vLLM's profile does not see.

The loss server gets the limits scoring needs (``optima.config.rules.loss_server_limits``), not the policy's: it
scores fixed batches of single utterances. Every figure is an estimate for planning, not a measurement:
docs/gpu.md says what was checked where.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optima.config.rules import loss_server_limits
from optima.hardware.memory import GIB, ModelSize, gib

if TYPE_CHECKING:
    from optima.config import LoopRecipe

# vLLM 0.32's API-server defaults (engine/arg_utils.py), by GPU memory.
LARGE_GPU_GIB = 70
LARGE_GPU_DEFAULTS = (8192, 1024)  # max_num_batched_tokens, max_num_seqs
SMALL_GPU_DEFAULTS = (2048, 256)
MAX_CAPTURE_TOKENS = 512  # vLLM's default largest CUDA graph (max_num_seqs x 2, at most 512)
KV_BLOCK_TOKENS = 16  # vLLM's default block size: the one block its check holds back
RUNTIME = GIB // 2
TP_RUNTIME = GIB // 2  # NCCL buffers and custom all-reduce with tensor parallel > 1
CUDA_GRAPH_BASE = GIB // 2
SAMPLER_BYTES_PER_LOGIT = 28
LOGPROB_BYTES_PER_LOGIT = 8  # fp32 log-softmax and its working copy, on top of the logits themselves


@dataclass(frozen=True)
class VllmArgs:
    """vLLM's arguments that size its memory.

    Args:
        max_model_len: ``--max-model-len`` (unset: the model's context).
        max_num_seqs: ``--max-num-seqs``.
        max_num_batched_tokens: ``--max-num-batched-tokens``.
        cuda_graphs: False with ``--enforce-eager``.
        prompt_logprobs: The server returns prompt log-probabilities (the loss server).
    """

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    cuda_graphs: bool = True
    prompt_logprobs: bool = False


def _flag(args: list[str], name: str) -> int | None:
    """The value of ``--name N`` or ``--name=N`` in a vLLM argv (the last one wins, as argparse reads it)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return int(value) if value is not None and value.isdigit() else None


def policy_args(max_model_len: int | None, size: ModelSize, gpu_gib: float, extra: list[str]) -> VllmArgs:
    """A policy replica's arguments: ``vllm_extra_args`` where they set them, else vLLM's defaults for the GPU."""
    batched, seqs = LARGE_GPU_DEFAULTS if gpu_gib >= LARGE_GPU_GIB else SMALL_GPU_DEFAULTS
    return VllmArgs(
        _flag(extra, "--max-model-len") or max_model_len or size.max_len,
        _flag(extra, "--max-num-seqs") or seqs,
        _flag(extra, "--max-num-batched-tokens") or batched,
        cuda_graphs="--enforce-eager" not in extra,
    )


def loss_args(recipe: LoopRecipe, size: ModelSize) -> VllmArgs:
    """The loss server's arguments: what ``build_serve_command`` passes it (``loss_server_limits``)."""
    model_len, seqs, batched = loss_server_limits(recipe, size.max_len)
    return VllmArgs(model_len, seqs, batched, "--enforce-eager" not in recipe.vllm_extra_args, prompt_logprobs=True)


@dataclass(frozen=True)
class ServerNeed:
    """A server's need on each of its GPUs, part by part (bytes).

    Args:
        parts: ``(name, bytes)`` in the order ``describe`` shows them; ``weights`` and ``KV`` first.
        args: The vLLM arguments it was sized from.
    """

    parts: tuple[tuple[str, int], ...]
    args: VllmArgs

    @property
    def total(self) -> int:
        return sum(size for _, size in self.parts)

    def part(self, name: str) -> int:
        return dict(self.parts)[name]

    def describe(self) -> str:
        """``weights 15.0 + KV 2.0 + runtime 0.5 + ... GiB``, then the arguments they come from."""
        parts = " + ".join(f"{name} {gib(size)}" for name, size in self.parts if size)
        a = self.args
        return (
            f"{parts} GiB (max_model_len {a.max_model_len}, max_num_seqs {a.max_num_seqs}, max_num_batched_tokens "
            f"{a.max_num_batched_tokens}{'' if a.cuda_graphs else ', eager'})"
        )


def activation_bytes_per_token(size: ModelSize, dtype_bytes: int) -> int:
    """One token's activations in one layer at once (residual, normed and attention streams, the gated MLP)."""
    return (6 * size.hidden + 3 * size.intermediate) * dtype_bytes


def server_need(size: ModelSize, run_kv_bytes: int, tp: int, dtype_bytes: int, args: VllmArgs) -> ServerNeed:
    """What one GPU of a server holds within its share (see the module docstring for each part)."""
    kv_per_token = size.kv_bytes_per_token(dtype_bytes)
    kv = max(run_kv_bytes, (args.max_model_len + KV_BLOCK_TOKENS) * kv_per_token)
    per_token = activation_bytes_per_token(size, dtype_bytes)
    batched = args.max_num_batched_tokens
    sampled = min(batched, args.max_num_seqs)
    graphs = 0
    if args.cuda_graphs:
        captured = min(2 * args.max_num_seqs, MAX_CAPTURE_TOKENS, batched)
        graphs = CUDA_GRAPH_BASE + math.ceil(captured * per_token / tp)
    logprobs = min(batched, args.max_model_len) * size.vocab * (dtype_bytes + LOGPROB_BYTES_PER_LOGIT)
    parts = (
        ("weights", math.ceil(size.weight_bytes(dtype_bytes) / tp)),
        ("KV", math.ceil(kv / tp)),
        ("runtime", RUNTIME + (TP_RUNTIME if tp > 1 else 0)),
        ("profile activations", math.ceil(batched * per_token / tp)),
        ("sampler", sampled * size.vocab * SAMPLER_BYTES_PER_LOGIT),
        ("CUDA graphs", graphs),
        ("prompt logprobs", logprobs if args.prompt_logprobs else 0),
    )
    return ServerNeed(parts, args)
