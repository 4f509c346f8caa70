"""The served KV cache during a generation stage: its size, the in-flight bound it allows, its prefix-cache hit rate.

``KVMonitor`` reads every replica's ``/metrics`` (Prometheus text, see ``optima.hardware.cache_metrics``) when a stage
starts and when it ends. The first read gives the KV capacity (vLLM's ``cache_config_info``) and the counters'
starting values, since a server may serve several stages; the second gives the stage's own prefix-cache hits,
lookups and preemptions. Endpoints without ``/metrics`` (not vLLM) leave the bound at ``thread_count`` and the
statistics empty.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from optima.hardware.cache_metrics import CacheCounters, kv_capacity_tokens, parse_prometheus
from optima.hardware.capacity import fit_in_flight

logger = logging.getLogger(__name__)

METRICS_TIMEOUT_S = 10.0


def fetch_metrics(base_url: str, api_key: str | None = None) -> list[tuple[str, dict, float]] | None:
    """The parsed ``/metrics`` of the server behind an OpenAI base URL; None when it has none or does not answer."""
    import requests

    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = requests.get(f"{root}/metrics", headers=headers, timeout=METRICS_TIMEOUT_S)
    except (requests.ConnectionError, requests.Timeout) as exc:
        logger.debug("no /metrics at %s: %s", root, exc)
        return None
    if response.status_code != 200:
        return None
    return parse_prometheus(response.text)


def fetch_served_model(base_url: str, api_key: str | None = None) -> str | None:
    """The model folder (or hub id) a vLLM server was started with (``root`` in ``/v1/models``); None if unknown."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = requests.get(f"{base_url.rstrip('/')}/models", headers=headers, timeout=METRICS_TIMEOUT_S)
    except (requests.ConnectionError, requests.Timeout):
        return None
    if response.status_code != 200:
        return None
    models = response.json().get("data") or [{}]
    return models[0].get("root")


class KVMonitor:
    """KV capacity and prefix-cache counters of a set of replicas over one stage.

    Args:
        endpoints: OpenAI base URLs of the replicas.
        api_key: Their API key, if any.
    """

    def __init__(self, endpoints: Sequence[str], api_key: str | None = None):
        self.endpoints, self.api_key = list(endpoints), api_key
        scraped = [fetch_metrics(url, api_key) for url in self.endpoints]
        capacities = [kv_capacity_tokens(s) if s is not None else None for s in scraped]
        # The bound needs every replica's size (conversations are spread over all of them).
        self.kv_tokens = sum(capacities) if capacities and all(c is not None for c in capacities) else None
        self.before = self._counters(scraped)
        self.in_flight: int | None = None
        self.per_conversation: int | None = None
        # The served model names the tokenizer and context length of the footprint (an eval recipe may have no
        # initial model); only needed when the KV size is known.
        self.model = fetch_served_model(self.endpoints[0], api_key) if self.kv_tokens is not None else None

    def _counters(self, scraped) -> CacheCounters | None:
        if any(s is None for s in scraped):
            return None
        return sum((CacheCounters.from_samples(s) for s in scraped), CacheCounters())

    def bound(self, thread_count: int, per_conversation: int) -> int:
        """Conversations in flight: ``thread_count`` capped by what the replicas' KV caches hold."""
        self.per_conversation = per_conversation
        self.in_flight = fit_in_flight(thread_count, self.kv_tokens, per_conversation)
        if self.in_flight < thread_count:
            logger.info(
                "KV cache %s tokens on %d replica(s) holds %d conversations of up to %d tokens: "
                "%d in flight instead of thread_count=%d",
                self.kv_tokens,
                len(self.endpoints),
                self.in_flight,
                per_conversation,
                self.in_flight,
                thread_count,
            )
        return self.in_flight

    def report(self) -> dict:
        """The stage's KV figures (for metrics.json), logged in one line."""
        after = self._counters([fetch_metrics(url, self.api_key) for url in self.endpoints])
        stage = after - self.before if after is not None and self.before is not None else None
        hit_rate = stage.hit_rate if stage is not None else None
        figures = {
            "kv_cache_tokens": self.kv_tokens,
            "conversation_kv_tokens": self.per_conversation,
            "in_flight": self.in_flight,
            "prefix_cache_queries": int(stage.queries) if stage is not None else None,
            "prefix_cache_hits": int(stage.hits) if stage is not None else None,
            "prefix_cache_hit_rate": round(hit_rate, 4) if hit_rate is not None else None,
            "preemptions": int(stage.preemptions) if stage is not None else None,
        }
        logger.info(
            "KV cache %s tokens | up to %s tokens per conversation | %s in flight | prefix-cache hit rate %s | "
            "%s preemptions",
            figures["kv_cache_tokens"],
            figures["conversation_kv_tokens"],
            figures["in_flight"],
            f"{hit_rate:.1%}" if hit_rate is not None else "n/a",
            figures["preemptions"],
        )
        return figures
