"""Serving the current model: vLLM replicas (CPU or GPU) or external endpoints, and their chat clients.

With ``optima.training.launch`` and the setup code, the only place that starts processes (``processes``: how
they are stopped).

    with serve(recipe, model_path, vllm_env, stage_paths) as endpoints:     # ["http://127.0.0.1:8000/v1", ...]
        generate_conversations(recipe, examples, endpoints, stage_paths.generations, generation)

Names are imported on first use, so that ``optima.serving.client`` (what the conversation code needs) does not
pull in the process code.
"""

from __future__ import annotations

from optima import lazy_exports

_EXPORTS = {
    "CacheCounters": "kv_monitor",
    "ChatReply": "client",
    "ConstraintRejected": "client",
    "NoReplicaLeft": "client",
    "ReplicaPool": "client",
    "RequestFailed": "client",
    "Sampling": "client",
    "ServerHolder": "holder",
    "fetch_metrics": "kv_monitor",
    "group_members": "processes",
    "run_to_end": "processes",
    "serve": "replicas",
    "sigterm_as_exit": "processes",
    "ServerStartupError": "vllm_server",
    "VLLMServer": "vllm_server",
    "build_serve_command": "vllm_server",
    "start_replicas": "vllm_server",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
