"""The servers of a run: the policy replicas (one model at a time) and the loss server beside them.

``serve`` serves one model for a block: vLLM replicas, or the recipe's ``endpoints`` made to hold it.
``ServerHolder`` keeps a run's servers across stages; the loss server (``loss_placement: beside``) starts with the
first policy and lives until the run ends, so every conversation is scored as soon as it finishes. A kept server may
die while the trainer runs (the OOM killer picks the biggest process): before any reuse it must answer ``/health``,
and one that does not, or whose reload fails, is replaced by a fresh start. A reload that serves other weights than
the checkpoint's probe stops the run (``WeightsMismatch``): a bug to see, not to hide.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from optima.environments import PythonEnv
from optima.hardware.memory import (
    GIB,
    PREFLIGHT_FILE,
    TRAINER_MARGIN_BYTES,
    available_memory_bytes,
    preflight_peak_bytes,
)
from optima.hardware.placement import Placement, ServerLayout, loss_server_wanted
from optima.paths import RunPaths, StagePaths
from optima.serving.reload import ReloadFailed, put_to_sleep, wake_with_weights
from optima.serving.vllm_server import (
    ReplicaLayout,
    ServerSpec,
    VLLMServer,
    answers_health,
    build_serve_command,
    build_serve_env,
    find_free_port,
    serve,
    wait_until_all_ready,
)

if TYPE_CHECKING:
    from optima.config import LoopRecipe

logger = logging.getLogger(__name__)
ENDPOINTS_LAYOUT = ServerLayout((Placement(),), None)  # external endpoints: nothing placed here
# Before reuse: an idle server answers /health at once and a dead one refuses at once; this only bounds a hung one.
REUSE_HEALTH_TIMEOUT_S = 10.0


class LossServer:
    """The loss model's server: ``start`` starts it without waiting, ``urls`` waits until it answers (started now if
    it is not up, again if it died: logged), ``stop`` stops it."""

    def __init__(self, recipe: LoopRecipe, vllm_env: PythonEnv, model: str, placement: Placement, log_path: Path):
        self.recipe, self.vllm_env, self.model, self.placement, self.log = recipe, vllm_env, model, placement, log_path
        self.server: VLLMServer | None = None

    @property
    def running(self) -> bool:
        return self.server is not None and self.server.is_running()

    def start(self) -> None:
        if self.server is not None and not self.server.is_running():
            self._replace_dead("exited")
        if self.server is None:
            recipe, port = self.recipe, find_free_port(self.recipe.host, self.recipe.port)
            argv = build_serve_command(recipe, self.model, port, self.vllm_env, self.placement)
            cache = RunPaths.from_recipe(recipe).vllm_cache
            env = build_serve_env(recipe, self.vllm_env, self.placement, cache, self.model)
            logger.info("loss server | %s | port %d | log %s", self.model, port, self.log)
            self.server = VLLMServer(
                ServerSpec(0, tuple(argv), env, recipe.host, port, self.log, "loss server")
            ).__enter__()

    def urls(self) -> list[str]:
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
        logger.warning("loss server %s %s; starting a fresh one (log %s)", self.server.spec.api_url, what, self.log)
        self.stop()

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()


class ServerHolder:
    """The policy replicas (one model at a time) and, when the recipe wants one, the loss server beside them.

    Nothing starts at construction. Args:
        recipe: Serving and reward fields.
        vllm_env: The vLLM environment (None: only external endpoints).
        loss_model: The fixed loss model.
        log_dir: Where the loss server's log goes (the run's ``logs/``).
        layout: The hardware allocation's placements (``HardwareAllocation.layout``); None only with ``endpoints``.
        demand: KV bytes the run's conversations in flight need of a policy server of a model (None: unknown).
        available_memory: Reads the memory available now (tests give their own).
    """

    def __init__(
        self,
        recipe: LoopRecipe,
        vllm_env: PythonEnv | None,
        loss_model: str | None = None,
        log_dir: Path | None = None,
        *,
        layout: ServerLayout | None,
        demand: Callable[[str], int | None] | None = None,
        available_memory: Callable[[], int] = available_memory_bytes,
    ):
        if layout is None and not recipe.endpoints:
            raise ValueError("ServerHolder needs the hardware allocation's layout (None only with external endpoints)")
        self.recipe, self.vllm_env, self.loss_model = recipe, vllm_env, loss_model
        self.log_dir = log_dir or Path(recipe.output_dir) / "logs"
        self.layout: ServerLayout = layout or ENDPOINTS_LAYOUT
        self.demand, self.available_memory = demand, available_memory
        self.model: str | None = None
        self.urls: list[str] = []
        self.asleep = False  # kept replicas, given back for training, wait for the next checkpoint's weights
        self._stack: contextlib.ExitStack | None = None
        self.node_servers: list[VLLMServer] = []  # the other nodes' replicas now up (their launchers here)
        self.loss: LossServer | None = None  # never with external endpoints (loss_server_wanted)
        if vllm_env is not None and loss_model is not None and loss_server_wanted(recipe):
            self.loss = LossServer(recipe, vllm_env, loss_model, self.layout.loss, self.log_dir / "loss_server.log")

    @property
    def kept(self) -> bool:
        """Whether the policy replicas carry over from checkpoint to checkpoint (``sleep_mode``; never external)."""
        return not self.recipe.endpoints and self.layout.policy[0].carry_over

    @property
    def idles_on_cpu(self) -> bool:
        """Whether a policy server is up that training would leave idle on the CPU, holding its memory."""
        return self._stack is not None and not self.asleep and self.kept and self.layout.policy[0].on_cpu

    def serve(self, model: str, stage_paths: StagePaths) -> list[str]:
        """Have ``model`` served and return its URLs: reused, loaded in place (kept replicas after training), or
        started now. External endpoints are checked again before every stage (someone may have reloaded them)."""
        model = str(model)
        if self._stack is not None and not self.recipe.endpoints:
            silent = [url for url in self.urls if not answers_health(url, REUSE_HEALTH_TIMEOUT_S)]
            if silent:
                logger.warning(
                    "serve | policy replica(s) %s of %s do not answer /health (died, e.g. killed for memory during "
                    "training; see the replica logs); starting fresh ones",
                    ", ".join(silent),
                    self.model,
                )
            elif self.asleep:
                try:
                    return self.load_in_place(model)
                except ReloadFailed as exc:
                    logger.warning("serve | loading %s in place failed (%s); starting a fresh server", model, exc)
            elif self.model == model:
                return self.urls
        return self._start_fresh(model, stage_paths)

    def serve_in_turn(self, model: str, stage_paths: StagePaths) -> list[str]:
        """As ``serve``, for models served one after another: kept replicas take ``model``'s weights in place."""
        if self._stack is not None and not self.asleep and self.model != str(model):
            self.release_for_training()  # kept replicas wait for the next weights (GPU: asleep), others stop
        return self.serve(model, stage_paths)

    def load_in_place(self, model: str) -> list[str]:
        """Give the kept replicas ``model``'s weights (no restart), prefix cache reset, weights probe checked.

        Raises:
            ReloadFailed: a request failed (``serve`` then starts a fresh server).
            WeightsMismatch: the replicas do not answer the weights probe recorded with ``model``.
        """
        if self._stack is None or not self.kept:
            raise RuntimeError(f"load_in_place({model}): no kept policy replicas to load it into")
        self.asleep = True  # until the new weights are in: a failure half-way leaves nothing worth reusing
        wake_with_weights(self.urls, str(model), self.recipe, gpu=not self.layout.policy[0].on_cpu)
        self.model, self.asleep = str(model), False
        return self.urls

    def _start_fresh(self, model: str, stage_paths: StagePaths) -> list[str]:
        """Stop any policy replicas, then start ``model``'s (and the loss server, when it is not up)."""
        self.stop_policy()
        policy, loss = self.layout.policy, self.loss
        starting: tuple[int, ...] = ()  # the port of a loss server starting now: it may not listen yet
        if loss is not None:
            running = loss.running
            loss.start()  # loads while the policy loads
            starting = () if running else (loss.server.spec.port,)
            if not self.layout.loss.on_cpu and self.layout.loss.gpus == policy[0].gpus[:1]:
                loss.urls()  # vLLM sizes its KV cache from the GPU memory free at start-up: one at a time
        stack = contextlib.ExitStack()
        with contextlib.ExitStack() as failing:  # on an error before the end, everything started here stops
            failing.enter_context(stack)
            nodes = self._start_node_servers(model, stage_paths, stack, len(policy), starting)
            busy = starting + tuple(server.spec.port for server in nodes)
            layout = ReplicaLayout(policy, busy, bool(starting), self._demand(model))
            urls = stack.enter_context(serve(self.recipe, model, self.vllm_env, stage_paths, layout=layout))
            wait_until_all_ready(nodes, self.recipe.server_startup_timeout_s)
            failing.pop_all()
        self.urls = urls + [server.spec.api_url for server in nodes]
        self._stack, self.model, self.node_servers = stack, model, nodes
        return self.urls

    def _start_node_servers(
        self, model: str, stage_paths: StagePaths, stack: contextlib.ExitStack, first: int, busy: tuple[int, ...]
    ) -> list[VLLMServer]:
        """Start the other nodes' policy replicas (their logs from ``vllm_<first>.log``), stopped with ``stack``."""
        if not self.layout.nodes:
            return []
        from optima.serving.node_servers import node_server_specs, start_node_servers

        specs = node_server_specs(self.recipe, model, self.vllm_env, stage_paths, self.layout.nodes, busy, first)
        servers = start_node_servers(specs)
        for server in servers:
            stack.callback(server.stop)
        return servers

    def _demand(self, model: str) -> int | None:
        """KV bytes the conversations need of ``model``'s server, when its KV cache is sized here (CPU, automatic)."""
        automatic = self.layout.policy[0].on_cpu and self.recipe.cpu_kvcache_space_gb is None
        return self.demand(model) if automatic and self.demand is not None else None

    def loss_urls(self) -> list[str] | None:
        """The loss server's URLs, waiting until it answers; None without a loss server."""
        return self.loss.urls() if self.loss is not None else None

    @contextlib.contextmanager
    def search_loss_server(self) -> Iterator[Callable[[], list[str]]]:
        """A loss server for one tree search (``loss_placement: after`` on a GPU: ``layout.loss``, not resident),
        loading while the policy samples and stopped when the block ends, before anything trains. Yields a function
        that waits until it answers and returns its URLs; where the search scores is ``optima.run.loss_route``'s."""
        log = self.log_dir / "search_loss_server.log"
        server = LossServer(self.recipe, self.vllm_env, self.loss_model, self.layout.loss, log)
        try:
            server.start()
            logger.info("serve | loss server for the tree search: %s (stopped when the search ends)", self.loss_model)
            yield server.urls
        finally:
            server.stop()

    def release_for_training(self, trainer: bool = False) -> None:
        """Give the policy's cores and memory back for training: kept replicas sleep (GPU) or idle (CPU), others stop.

        The loss server stays up. A sleep request that fails stops the replicas instead, as does, on a CPU, a trainer
        (``trainer``: one runs next; False: not weighed, e.g. an in-process scorer) whose measured peak the memory
        available now cannot hold beside the idle policy (``_trainer_fits``).
        """
        if self._stack is None or self.asleep:
            return
        on_cpu = self.layout.policy[0].on_cpu
        weigh = self.kept and on_cpu and trainer  # an idle CPU policy keeps its memory
        if self.kept and (not weigh or self._trainer_fits()):
            try:
                put_to_sleep(self.urls, self.recipe, gpu=not on_cpu)
                self.asleep = True
                return
            except ReloadFailed as exc:
                logger.warning("serve | the policy could not be put to sleep (%s); stopping it instead", exc)
        self.stop_policy()

    def _trainer_fits(self) -> bool:
        """Whether the trainer's peak that the preflight measured, with ``TRAINER_MARGIN_BYTES``, fits in the memory
        available now beside the idle policy (logged either way). Not measured (no preflight ran): it stays."""
        peak = preflight_peak_bytes(self.recipe.output_dir)
        if peak is None:
            logger.info("serve | no preflight measurement (%s): the policy stays up through training", PREFLIGHT_FILE)
            return True
        available = self.available_memory()
        figures = (peak / GIB, TRAINER_MARGIN_BYTES / GIB, available / GIB)
        if peak + TRAINER_MARGIN_BYTES <= available:
            logger.info(
                "serve | the policy stays up through training: the trainer's measured peak %.1f GiB + %.1f GiB margin "
                "fits in the %.1f GiB available",
                *figures,
            )
            return True
        logger.warning(
            "serve | the trainer's measured peak %.1f GiB + %.1f GiB margin does not fit in the %.1f GiB available "
            "beside the idle policy server: stopping the policy for this training (the next stage starts a fresh one; "
            "cpu_kvcache_space_gb sets a smaller cache)",
            *figures,
        )
        return False

    def stop_policy(self) -> None:
        """Stop the policy replicas (no-op when none is up)."""
        stack, self._stack, self.model, self.asleep, self.node_servers = self._stack, None, None, False, []
        if stack is not None:
            stack.close()

    def stop_all(self) -> None:
        """Stop every server of the run (the end of the run, or any exception)."""
        try:
            self.stop_policy()
        finally:
            if self.loss is not None:
                self.loss.stop()

    def __enter__(self) -> ServerHolder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop_all()
