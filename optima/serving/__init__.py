"""Serving the model: vLLM servers (CPU or GPU) or external endpoints, and their chat clients.

With ``optima.training.launch``, the only package that starts processes. ``client`` (what the conversation code
needs, no process code), ``vllm_server``, ``holder``, ``reload``, ``processes``.
"""
