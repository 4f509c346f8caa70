"""What a vLLM server's ``/metrics`` say about its KV cache: its capacity and the prefix-cache counters (pure).

* **Parsing** (``parse_prometheus``: ``prometheus_client``'s parser, line by line when the exposition is malformed).
* **KV capacity** (``kv_capacity_tokens``): the tokens the cache holds, from vLLM's ``cache_config_info`` labels
  (blocks x block size); ``optima.hardware.capacity.fit_in_flight`` sizes the conversations in flight to it.
* **Prefix-cache statistics** (``CacheCounters``): vLLM's ``/metrics`` counters ``vllm:prefix_cache_queries`` /
  ``vllm:prefix_cache_hits`` (prompt tokens looked up / found in the cache) and ``vllm:num_preemptions``, read
  before and after a stage.

``optima.serving.kv_monitor`` fetches the metrics and reads them through these functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition: (name, labels, value), read by ``prometheus_client``.

    A malformed exposition (the parser raises ``ValueError``) is read line by line instead, skipping the lines
    the parser rejects, so one bad line does not hide the counters around it.
    """
    try:
        return _samples(text)
    except ValueError:
        samples = []
        for line in text.splitlines():
            try:
                samples += _samples(line + "\n")
            except ValueError:
                continue  # not a sample line (garbage, or a line cut by a dropped connection)
        return samples


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples
    ]


def metric_total(samples: Iterable[tuple[str, dict, float]], name: str) -> float | None:
    """Sum of ``name`` over its label sets (a counter may be exposed with the ``_total`` suffix); None if absent."""
    values = [v for n, _, v in samples if n in (name, f"{name}_total")]
    return sum(values) if values else None


def kv_capacity_tokens(samples: Iterable[tuple[str, dict, float]]) -> int | None:
    """KV-cache tokens of a server from its ``vllm:cache_config_info`` labels; None if absent.

    ``kv_cache_size_tokens`` where vLLM reports it, else ``num_gpu_blocks x block_size`` (vLLM names the field
    ``num_gpu_blocks`` on CPU too: the blocks its KV cache was given).
    """
    for name, labels, _ in samples:
        if name != "vllm:cache_config_info":
            continue
        tokens = labels.get("kv_cache_size_tokens", "")
        if tokens.isdigit():
            return int(tokens)
        blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
        if blocks.isdigit() and size.isdigit():
            return int(blocks) * int(size)
    return None


@dataclass(frozen=True)
class CacheCounters:
    """Cumulative prefix-cache and preemption counters of the servers (summed over replicas).

    Args:
        queries: Prompt tokens looked up in the prefix cache.
        hits: Of those, tokens found there.
        preemptions: Requests preempted for lack of KV blocks.
    """

    queries: float = 0.0
    hits: float = 0.0
    preemptions: float = 0.0

    @classmethod
    def from_samples(cls, samples: Iterable[tuple[str, dict, float]]) -> CacheCounters:
        samples = list(samples)
        return cls(
            metric_total(samples, "vllm:prefix_cache_queries") or 0.0,
            metric_total(samples, "vllm:prefix_cache_hits") or 0.0,
            metric_total(samples, "vllm:num_preemptions") or 0.0,
        )

    def __add__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def __sub__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(*(a - b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[float, float, float]:
        return self.queries, self.hits, self.preemptions

    @property
    def hit_rate(self) -> float | None:
        """Share of looked-up prompt tokens found in the cache (None before any lookup)."""
        return self.hits / self.queries if self.queries > 0 else None
