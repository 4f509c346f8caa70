"""The served KV cache during a generation stage: its size, the conversations it holds at once, its prefix-cache hits.

``KVMonitor`` reads every replica's ``/metrics`` when a stage starts and when it ends: the first read gives the KV
capacity (vLLM's ``cache_config_info``: blocks x block size) and the counters' starting values (a server may serve
several stages), the second the stage's own prefix-cache hits, lookups and preemptions. The capacity bounds the
conversations in flight (``optima.hardware.memory.fit_in_flight``): on a CPU the cache is sized for
``thread_count`` conversations but may be capped by the memory, on a GPU it is what the memory share left after
the weights. Endpoints without ``/metrics`` (not vLLM) leave the bound at ``thread_count`` and the figures empty.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import astuple, dataclass

from optima.hardware.memory import fit_in_flight

logger = logging.getLogger(__name__)

METRICS_TIMEOUT_S = 10.0
Samples = list[tuple[str, dict, float]]


def _get(url: str, api_key: str | None):
    """The 200 answer of a GET to one of the server's routes; None when it does not answer so."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = requests.get(url, headers=headers, timeout=METRICS_TIMEOUT_S)
    except (requests.ConnectionError, requests.Timeout) as exc:
        logger.debug("no answer from %s: %s", url, exc)
        return None
    return response if response.status_code == 200 else None


def parse_metrics(text: str) -> Samples | None:
    """The samples (name, labels, value) of a Prometheus exposition, by ``prometheus_client``; None if malformed."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples]
    except ValueError:
        return None


def fetch_metrics(base_url: str, api_key: str | None = None) -> Samples | None:
    """The parsed ``/metrics`` of the server behind an OpenAI base URL; None when it has none or does not answer."""
    response = _get(base_url.rstrip("/").removesuffix("/v1") + "/metrics", api_key)
    return parse_metrics(response.text) if response is not None else None


def kv_capacity_tokens(samples: Samples) -> int | None:
    """KV-cache tokens of a server from ``cache_config_info``: ``kv_cache_size_tokens`` where vLLM reports it, else
    ``num_gpu_blocks x block_size`` (named so on CPU too)."""
    for name, labels, _ in samples:
        tokens, blocks, size = (labels.get(k, "") for k in ("kv_cache_size_tokens", "num_gpu_blocks", "block_size"))
        if name == "vllm:cache_config_info" and tokens.isdigit():
            return int(tokens)
        if name == "vllm:cache_config_info" and blocks.isdigit() and size.isdigit():
            return int(blocks) * int(size)
    return None


@dataclass(frozen=True)
class CacheCounters:
    """Prompt tokens looked up in the prefix cache, of those found there, and requests preempted (cumulative)."""

    queries: float = 0.0
    hits: float = 0.0
    preemptions: float = 0.0

    @classmethod
    def from_samples(cls, samples: Samples) -> CacheCounters:
        names = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")
        return cls(*(sum(v for n, _, v in samples if n in (name, f"{name}_total")) for name in names))

    def __add__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


class KVMonitor:
    """KV capacity and prefix-cache counters of the replicas at ``endpoints`` over one stage."""

    def __init__(self, endpoints: Sequence[str], api_key: str | None = None):
        self.endpoints, self.api_key = list(endpoints), api_key
        scraped = [fetch_metrics(url, api_key) for url in self.endpoints]
        capacities = [kv_capacity_tokens(s) if s is not None else None for s in scraped]
        # The bound needs every replica's size (conversations are spread over all of them).
        self.kv_tokens = sum(capacities) if capacities and None not in capacities else None
        self.before = self._counters(scraped)
        self.in_flight: int | None = None
        self.per_conversation: int | None = None
        # The served model names the footprint's tokenizer and context length (an eval recipe may have no initial
        # model); only needed when the KV size is known.
        models = _get(self.endpoints[0].rstrip("/") + "/models", api_key) if self.kv_tokens is not None else None
        self.model = (models.json().get("data") or [{}])[0].get("root") if models is not None else None

    def _counters(self, scraped: list[Samples | None]) -> CacheCounters | None:
        if any(s is None for s in scraped):
            return None
        return sum((CacheCounters.from_samples(s) for s in scraped), CacheCounters())

    def bound(self, thread_count: int, per_conversation: int) -> int:
        """Conversations in flight: ``thread_count`` capped by what the replicas' KV caches hold."""
        self.per_conversation = per_conversation
        self.in_flight = fit_in_flight(thread_count, self.kv_tokens, per_conversation)
        if self.in_flight < thread_count:
            logger.info(
                "KV cache %s tokens on %d replica(s) holds %d conversations of up to %d tokens: %d in flight instead "
                "of thread_count=%d",
                *(self.kv_tokens, len(self.endpoints), self.in_flight, per_conversation, self.in_flight, thread_count),
            )
        return self.in_flight

    def report(self) -> dict:
        """The stage's KV figures (for metrics.json), logged in one line."""
        after = self._counters([fetch_metrics(url, self.api_key) for url in self.endpoints])
        stage = after - self.before if after is not None and self.before is not None else None
        rate = stage.hit_rate if stage is not None else None
        figures = {"kv_cache_tokens": self.kv_tokens, "conversation_kv_tokens": self.per_conversation}
        figures |= {"in_flight": self.in_flight, "prefix_cache_queries": int(stage.queries) if stage else None}
        figures |= {"prefix_cache_hits": int(stage.hits) if stage else None}
        figures |= {"prefix_cache_hit_rate": round(rate, 4) if rate is not None else None}
        figures |= {"preemptions": int(stage.preemptions) if stage else None}
        logger.info(
            "KV cache %s tokens | up to %s tokens per conversation | %s in flight | prefix-cache hit rate %s | "
            "%s preemptions",
            *(self.kv_tokens, self.per_conversation, self.in_flight, f"{rate:.1%}" if rate is not None else "n/a"),
            figures["preemptions"],
        )
        return figures
