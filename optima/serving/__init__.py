"""Serving the model: vLLM servers (CPU or GPU) or external endpoints, and their chat clients.

With ``optima.training.launch``, the only package that starts processes. Code in ``optima`` imports from the modules
(``client``: what the conversation code needs, no process code; ``vllm_server``, ``holder``, ``reload``,
``processes``); the names below are the entry points ``bench/`` may use, imported on first use.
"""

from optima import lazy_exports

_EXPORTS = {
    "CacheCounters": "kv_monitor",
    "ServerHolder": "holder",
    "fetch_metrics": "kv_monitor",
    "group_members": "processes",
    "serve": "vllm_server",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
