"""Serving the current model: vLLM replicas (CPU or GPU) or external endpoints, and their chat clients.

The only package besides ``optima.training.launch`` that starts processes (STYLE: subprocess isolation).

    with serve(recipe, model_path, vllm_env, stage_paths) as endpoints:     # ["http://127.0.0.1:8000/v1", ...]
        generate_conversations(recipe, examples, endpoints, stage_paths.generations, plan)
"""

from optima.serving.client import ChatReply, NoReplicaLeft, ReplicaPool, RequestFailed, Sampling
from optima.serving.replicas import serve
from optima.serving.signals import sigterm_as_exit
from optima.serving.vllm_server import ServerStartupError, VLLMServer, build_serve_command, start_replicas

__all__ = [
    "ChatReply",
    "NoReplicaLeft",
    "ReplicaPool",
    "RequestFailed",
    "Sampling",
    "ServerStartupError",
    "VLLMServer",
    "build_serve_command",
    "serve",
    "sigterm_as_exit",
    "start_replicas",
]
