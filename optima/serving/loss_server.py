"""The loss model's vLLM server: one process, started without waiting, waited for when its URL is wanted.

``optima.serving.holder.ServerHolder`` makes one for the run (``loss_placement: beside``: it starts with the first
policy and lives until the run ends), or one for a tree search only. On a CPU its KV cache is what scoring needs
(the placement's). A server found dead (killed for memory during training, say) is logged and replaced by a fresh
start the next time it is wanted.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from optima.environments import PythonEnv
from optima.hardware.placement import ServerLayout
from optima.paths import RunPaths
from optima.serving.vllm_server import (
    ServerSpec,
    VLLMServer,
    build_serve_command,
    build_serve_env,
    find_free_port,
    wait_until_all_ready,
)

if TYPE_CHECKING:
    from optima.config import LoopRecipe

logger = logging.getLogger(__name__)


class LossServer:
    """The loss model's vLLM server: started by ``start`` (no wait) or ``serve`` (waits for it), stopped by ``stop``.

    Args:
        recipe: Serving fields.
        vllm_env: The vLLM environment.
        model: The loss model (folder or hub id).
        layout: Where it runs (``layout.loss``).
        log_path: Its log file.
    """

    def __init__(self, recipe: LoopRecipe, vllm_env: PythonEnv, model: str, layout: ServerLayout, log_path: Path):
        self.recipe, self.vllm_env, self.model, self.layout, self.log_path = recipe, vllm_env, model, layout, log_path
        self.server: VLLMServer | None = None

    @property
    def ports(self) -> tuple[int, ...]:
        return (self.server.spec.port,) if self.server is not None else ()

    @property
    def running(self) -> bool:
        """Whether its process runs (started, and not exited since)."""
        return self.server is not None and self.server.is_running()

    def start(self, busy_ports: tuple[int, ...] = ()) -> None:
        """Start the process unless it runs already (the caller may start the policy meanwhile).

        Args:
            busy_ports: Ports of servers starting beside it that may not listen yet.
        """
        if self.server is not None and not self.server.is_running():
            self._replace_dead("exited")
        if self.server is not None:
            return
        recipe, placement = self.recipe, self.layout.loss
        port = find_free_port(recipe.host, recipe.port, busy_ports)
        argv = build_serve_command(recipe, self.model, port, self.vllm_env, placement)
        cache = RunPaths.from_recipe(recipe).vllm_cache
        # On a CPU its KV cache is the placement's: what scoring needs (the policy gets the rest).
        env = build_serve_env(recipe, self.vllm_env, placement, cache, self.model)
        logger.info("loss server | %s | port %d | log %s", self.model, port, self.log_path)
        server = VLLMServer(ServerSpec(0, tuple(argv), env, recipe.host, port, self.log_path))
        server.__enter__()
        self.server = server

    def serve(self) -> list[str]:
        """Its OpenAI base URL, waiting until it answers ``/health`` (started now if needed, again if it died)."""
        if self.server is not None and self.server.ready and not self.server.is_healthy():
            self._replace_dead("does not answer /health")
        self.start()
        try:
            wait_until_all_ready([self.server], self.recipe.server_startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return [self.server.spec.api_url]

    def _replace_dead(self, what: str) -> None:
        """Log a server that died (killed for memory, say) and clear it away; the next ``start`` starts afresh."""
        url = self.server.spec.api_url
        logger.warning("loss server %s %s; starting a fresh one (log %s)", url, what, self.log_path)
        self.stop()

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()
