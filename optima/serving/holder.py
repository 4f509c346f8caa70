"""The servers of one run: the policy replicas (the model of the current stage) and the loss server beside them.

``ServerHolder`` keeps at most one policy model served across stages (generation at iteration 0 and the
LM-loss scoring that follows may share it) and, with ``loss_placement: beside``, one vLLM server of the fixed
loss model that starts with the first policy and lives until the run ends, so that every conversation (and every
tree-search rollout) is scored on it as soon as it finishes, while the policy keeps generating. Placement:
``optima.serving.layout``.

Before training the policy gives its resources back (``release``): with ``sleep_mode`` it sleeps (GPU) or idles
(CPU) and later loads the new checkpoint's weights (``optima.serving.sleep_mode``), else it is stopped. The loss
server stays up: idle, a vLLM server takes no CPU time worth counting (``bench/RESULTS.md`` has the
measurement), and a restart would cost a start-up per iteration.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from optima.environments import PythonEnv
from optima.paths import RunPaths, StagePaths
from optima.serving.layout import ServerLayout, loss_server_wanted
from optima.serving.replicas import serve
from optima.serving.vllm_server import (
    Placement,
    ServerSpec,
    VLLMServer,
    build_serve_command,
    build_serve_env,
    find_free_port,
    wait_until_all_ready,
)

if TYPE_CHECKING:
    from optima.config.types import LoopRecipe

logger = logging.getLogger(__name__)
ENDPOINTS_LAYOUT = ServerLayout((Placement(),), None)  # external endpoints: nothing placed here


class LossServer:
    """The loss model's vLLM server: started once (``start`` does not wait), ready on ``urls()``, stopped by ``stop``.

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

    def start(self, busy_ports: tuple[int, ...] = ()) -> None:
        """Start the process unless it runs already (the caller may start the policy meanwhile)."""
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

    def urls(self) -> list[str]:
        """Its OpenAI base URL, once it answers ``/health`` (started now if needed)."""
        self.start()
        try:
            wait_until_all_ready([self.server], self.recipe.server_startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return [self.server.spec.api_url]

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()


class ServerHolder:
    """The policy replicas (one model at a time) and, when the recipe wants one, the loss server beside them.

    Args:
        recipe: Serving and reward fields.
        vllm_env: The vLLM environment (``None``: only external endpoints).
        loss_model: The fixed loss model.
        log_dir: Where the loss server's log goes (the run's ``logs/``).
    """

    def __init__(
        self,
        recipe: LoopRecipe,
        vllm_env: PythonEnv | None,
        loss_model: str | None = None,
        log_dir: Path | None = None,
    ):
        self.recipe, self.vllm_env = recipe, vllm_env
        self.loss_model, self.log_dir = loss_model, log_dir
        self.model: str | None = None
        self.urls: list[str] = []
        self.asleep = False
        self._stack: contextlib.ExitStack | None = None
        self._layout: ServerLayout | None = None
        self._loss: LossServer | None = None

    @property
    def layout(self) -> ServerLayout:
        """Placements of the run's servers: the hardware plan's (``optima.hardware.plan``), set by the run."""
        if self._layout is None:
            from optima.hardware.plan import plan_hardware
            from optima.hardware.spec import detect_hardware

            hardware = plan_hardware(self.recipe, detect_hardware(), sorted(os.sched_getaffinity(0)))
            hardware.check()
            self._layout = hardware.layout or ENDPOINTS_LAYOUT
        return self._layout

    @layout.setter
    def layout(self, layout: ServerLayout | None) -> None:
        self._layout = layout or ENDPOINTS_LAYOUT

    @property
    def loss(self) -> LossServer | None:
        """The loss server of the run, or None when the loss is scored another way."""
        wanted = self.vllm_env is not None and self.loss_model is not None and loss_server_wanted(self.recipe)
        if self._loss is None and wanted:
            log = (self.log_dir or Path(self.recipe.output_dir) / "logs") / "loss_server.log"
            self._loss = LossServer(self.recipe, self.vllm_env, self.loss_model, self.layout, log)
        return self._loss

    def endpoints(self, model: str, stage_paths: StagePaths) -> list[str]:
        """OpenAI base URLs serving ``model``: reused, woken with its weights, or started now.

        External endpoints are checked again before every stage (``optima.serving.endpoints``): someone else may
        have restarted or reloaded them since.
        """
        model = str(model)
        if self._stack is not None and self.model == model and not self.asleep and not self.recipe.endpoints:
            return self.urls
        if self._stack is not None and self.asleep:
            from optima.serving.sleep_mode import wake_with_weights

            wake_with_weights(self.urls, model, self.recipe, gpu=not self.layout.policy[0].on_cpu)
            self.model, self.asleep = model, False
            return self.urls
        self.stop_policy()
        loss = self.loss if not self.recipe.endpoints else None
        # A loss server that starts now may not listen yet (its port is kept free) and holds no memory yet (the
        # policy's KV budget leaves room for it); one that runs already is neither.
        starting: tuple[int, ...] = ()
        if loss is not None:
            running = bool(loss.ports)
            loss.start()  # loads while the policy loads (CPU); on a shared GPU the policy waits for it below
            starting = () if running else loss.ports
            if not self.layout.loss.on_cpu and self.layout.loss.gpus == self.layout.policy[0].gpus[:1]:
                loss.urls()  # vLLM sizes its KV cache from the GPU memory free at start-up: one at a time
        stack = contextlib.ExitStack()
        # The planned placements always: they carry the sleep-mode flag that opens vLLM's reload routes.
        layout = (self.layout.policy, starting)
        self.urls = stack.enter_context(serve(self.recipe, model, self.vllm_env, stage_paths, layout=layout))
        self._stack, self.model = stack, model
        return self.urls

    def loss_endpoints(self) -> list[str] | None:
        """The loss server's URLs (waiting until it is ready), or None without a loss server."""
        return self.loss.urls() if self.loss is not None else None

    def release(self) -> None:
        """Give the policy's cores / memory back for training: sleep (GPU sleep mode) or stop."""
        # External endpoints are not ours to put to sleep; the next stage's check reloads them if needed.
        if (
            not self.recipe.endpoints
            and self._stack is not None
            and self.layout.policy[0].carry_over
            and not self.asleep
        ):
            from optima.serving.sleep_mode import put_to_sleep

            put_to_sleep(self.urls, self.recipe, gpu=not self.layout.policy[0].on_cpu)
            self.asleep = True
            return
        self.stop_policy()

    def stop_policy(self) -> None:
        """Stop the policy replicas (no-op when none is up)."""
        stack, self._stack, self.model, self.asleep = self._stack, None, None, False
        if stack is not None:
            stack.close()

    def close(self) -> None:
        """Free the policy's resources (``release``); the loss server stays for the rest of the run."""
        self.release()

    def shutdown(self) -> None:
        """Stop every server of the run (the end of the run, or any exception)."""
        try:
            self.stop_policy()
        finally:
            if self._loss is not None:
                self._loss.stop()

    def __enter__(self) -> ServerHolder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
