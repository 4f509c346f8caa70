"""The servers of one run: the policy replicas (the model of the current stage) and the loss server beside them.

``ServerHolder`` keeps at most one policy model served across stages and, with ``loss_placement: beside``, one
vLLM server of the fixed loss model that starts with the first policy and lives until the run ends, so that every
conversation (and every tree-search rollout) is scored on it as soon as it finishes, while the policy keeps
generating. Placement: ``optima.hardware.placement``, given at construction. Its verbs say what happens to the
processes:

* ``serve(model, stage_paths)``: have ``model`` served and return its URLs: the running replicas when they serve it
  already, the kept replicas given its weights in place after training (``load_in_place``), else replicas started
  now (any others stopped first);
* ``serve_in_turn(model, stage_paths)``: as ``serve``, for models served one after another (the held-out
  evaluation): kept replicas serving another model are given ``model``'s weights in place;
* ``load_in_place(model)``: load a checkpoint into the kept replicas (``optima.serving.sleep_mode``), prefix cache
  reset and weights probe checked (``optima.serving.reload_check``);
* ``release_for_training(trainer)``: give the policy's resources back for training (or an in-process scorer): with
  ``sleep_mode`` (on by default, CPU and GPU) it sleeps (GPU) or idles (CPU) and keeps its process, else it stops.
  On a CPU an idle policy keeps its memory: when the trainer's peak that the preflight measured does not fit in
  the memory available now (``available_memory``, with a margin), the policy is stopped for that training
  instead, and the next stage starts a fresh one;
* ``loss_urls()``: the loss server's URLs, waiting until it answers (started now if it is not up, again if it died);
  ``search_loss_server()``: a block during which a loss server runs for the tree search;
* ``stop_policy()``: stop the policy replicas; ``stop_all()``: every server (the end of the run, or any error).

Nothing starts at construction: ``loss`` (the loss server, when the recipe wants one: ``LossServer``, in
``optima.serving.loss_server``) is made there, not started.

The loss server stays up through training: idle, a vLLM server takes no CPU time worth counting
(``bench/RESULTS.md`` has the measurement), and a restart would cost a start-up per iteration.

A kept server may die while the trainer runs (the kernel's OOM killer picks the biggest process): that must not end
the run. Before any reuse each server must answer ``/health``; one that does not, or whose reload request fails, is
logged, stopped (its whole process group) and replaced by a fresh start. A reload that answers but serves other
weights than the checkpoint's probe still stops the run (``WeightsMismatch``): that is a bug to see, not to hide.
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
from optima.paths import StagePaths
from optima.serving.loss_server import LossServer
from optima.serving.replicas import ReplicaLayout
from optima.serving.replicas import serve as serve_replicas
from optima.serving.vllm_server import VLLMServer, answers_health, wait_until_all_ready

if TYPE_CHECKING:
    from optima.config import LoopRecipe
    from optima.serving.node_servers import NodeLauncher

logger = logging.getLogger(__name__)
ENDPOINTS_LAYOUT = ServerLayout((Placement(),), None)  # external endpoints: nothing placed here
# Before reuse: an idle server answers /health at once and a dead one refuses at once; this only bounds a hung one.
REUSE_HEALTH_TIMEOUT_S = 10.0


class ServerHolder:
    """The policy replicas (one model at a time) and, when the recipe wants one, the loss server beside them.

    Args:
        recipe: Serving and reward fields.
        vllm_env: The vLLM environment (``None``: only external endpoints).
        loss_model: The fixed loss model.
        log_dir: Where the loss server's log goes (the run's ``logs/``).

        layout: Where the servers run: the hardware allocation's placements (``HardwareAllocation.layout``, made
            and checked before anything starts); None only for a recipe with external ``endpoints``, where nothing is
            placed.
        demand: KV bytes the run's conversations in flight need of a policy server of a model
            (``optima.agents.footprint.policy_demand``); None: unknown.
        available_memory: Reads the memory available now (default ``MemAvailable``; tests give their own).
        node_launcher: Starts the other nodes' servers (``layout.nodes``); None on one node.
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
        node_launcher: NodeLauncher | None = None,
    ):
        if layout is None and not recipe.endpoints:
            raise ValueError("ServerHolder needs the hardware allocation's layout (None only with external endpoints)")
        self.recipe, self.vllm_env = recipe, vllm_env
        self.loss_model, self.log_dir = loss_model, log_dir
        self.layout: ServerLayout = layout or ENDPOINTS_LAYOUT
        self.demand, self.available_memory, self.node_launcher = demand, available_memory, node_launcher
        self.model: str | None = None
        self.urls: list[str] = []
        self.asleep = False  # kept replicas, given back for training, wait for the next checkpoint's weights
        self._stack: contextlib.ExitStack | None = None
        self.node_servers: list[VLLMServer] = []  # the other nodes' replicas now up (their launchers here)
        # The run's loss server, made here and started with the first policy; None: the loss is scored another way.
        self.loss: LossServer | None = None
        if vllm_env is not None and loss_model is not None and loss_server_wanted(recipe):
            log = (log_dir or Path(recipe.output_dir) / "logs") / "loss_server.log"
            self.loss = LossServer(recipe, vllm_env, loss_model, self.layout, log)

    @property
    def kept(self) -> bool:
        """Whether the policy replicas carry over from checkpoint to checkpoint (``sleep_mode``; never external)."""
        return not self.recipe.endpoints and self.layout.policy[0].carry_over

    @property
    def idles_on_cpu(self) -> bool:
        """Whether a policy server is up that training would leave idle on the CPU, holding its memory."""
        return self._stack is not None and not self.asleep and self.kept and self.layout.policy[0].on_cpu

    def serve(self, model: str, stage_paths: StagePaths) -> list[str]:
        """Have ``model`` served and return its OpenAI base URLs: reused, loaded in place (kept replicas after
        training), or started now (any other policy replicas stopped first).

        Our own replicas must answer ``/health`` before any reuse: dead ones are replaced by a fresh start, as are
        kept ones whose reload request fails. External endpoints are checked again before every stage
        (``optima.serving.endpoints``): someone else may have restarted or reloaded them since.
        """
        from optima.serving.sleep_mode import ReloadFailed

        model = str(model)
        if self._stack is not None and not self.recipe.endpoints:
            if not self._policy_answers():
                self.stop_policy()
            elif self.asleep:
                try:
                    return self.load_in_place(model)
                except ReloadFailed as exc:
                    logger.warning("serve | loading %s in place failed (%s); starting a fresh server", model, exc)
                    self.stop_policy()
            elif self.model == model:
                return self.urls
        return self._start_fresh(model, stage_paths)

    def serve_in_turn(self, model: str, stage_paths: StagePaths) -> list[str]:
        """URLs serving ``model`` when several models are served one after another (the held-out evaluation):
        kept replicas that serve another model take its weights in place, as after training (no restart); others
        are stopped and ``model``'s started."""
        if self._stack is not None and not self.asleep and self.model != str(model):
            self.release_for_training()  # kept replicas wait for the next weights (GPU: asleep), others stop
        return self.serve(model, stage_paths)

    def load_in_place(self, model: str) -> list[str]:
        """Give the kept replicas ``model``'s weights in place (no restart): wake (GPU), reload, reset prefix cache.

        Raises:
            ReloadFailed: a request failed (``serve`` then starts a fresh server).
            WeightsMismatch: the replicas do not answer the weights probe recorded with ``model``.
        """
        from optima.serving.sleep_mode import wake_with_weights

        if self._stack is None or not self.kept:
            raise RuntimeError(f"load_in_place({model}): no kept policy replicas to load it into")
        self.asleep = True  # until the new weights are in: a failure half-way leaves nothing worth reusing
        wake_with_weights(self.urls, str(model), self.recipe, gpu=not self.layout.policy[0].on_cpu)
        self.model, self.asleep = str(model), False
        return self.urls

    def _policy_answers(self) -> bool:
        """Whether every policy replica answers ``/health`` (logged when one does not)."""
        silent = [url for url in self.urls if not answers_health(url, REUSE_HEALTH_TIMEOUT_S)]
        if silent:
            logger.warning(
                "serve | policy replica(s) %s of %s do not answer /health (died, e.g. killed for memory during "
                "training; see the replica logs); starting fresh ones",
                ", ".join(silent),
                self.model,
            )
        return not silent

    def _start_fresh(self, model: str, stage_paths: StagePaths) -> list[str]:
        """Stop any policy replicas, then start ``model``'s (and the loss server, when it is not up yet)."""
        self.stop_policy()
        policy = self.layout.policy
        loss = self.loss if not self.recipe.endpoints else None
        # A loss server that starts now may not listen yet (its port is kept free) and holds no memory yet (the
        # policy's KV budget leaves room for it); one that runs already is neither.
        starting: tuple[int, ...] = ()
        if loss is not None:
            running = loss.running
            loss.start()  # loads while the policy loads (CPU); a shared GPU waits below
            starting = () if running else loss.ports
            if not self.layout.loss.on_cpu and self.layout.loss.gpus == policy[0].gpus[:1]:
                loss.serve()  # vLLM sizes its KV cache from the GPU memory free at start-up: one at a time
        stack = contextlib.ExitStack()
        with contextlib.ExitStack() as failing:  # on an error before the end, everything started here stops
            failing.enter_context(stack)
            # The other nodes' replicas load while node 0's do (node 0's then skip their ports).
            nodes = self._start_node_servers(model, stage_paths, stack, len(policy), starting)
            busy = starting + tuple(server.spec.port for server in nodes)
            # The planned placements always: they carry the sleep-mode flag that opens vLLM's reload routes.
            layout = ReplicaLayout(policy, busy, bool(starting), self._demand(model))
            urls = stack.enter_context(serve_replicas(self.recipe, model, self.vllm_env, stage_paths, layout=layout))
            wait_until_all_ready(nodes, self.recipe.server_startup_timeout_s)
            failing.pop_all()
        self.urls = urls + [server.spec.api_url for server in nodes]
        self._stack, self.model, self.node_servers = stack, model, nodes
        return self.urls

    def _start_node_servers(
        self, model: str, stage_paths: StagePaths, stack: contextlib.ExitStack, first: int, busy: tuple[int, ...]
    ) -> list[VLLMServer]:
        """Start the policy replicas of the other nodes (``layout.nodes``), stopped with ``stack``; none on one node.

        Args:
            model: The policy model.
            stage_paths: Logs go to ``vllm_<first>.log`` on.
            stack: Closes them with node 0's replicas.
            first: Node 0's replica count (the first log index of the other nodes).
            busy: Ports of servers starting here that may not listen yet.
        """
        if not self.layout.nodes:
            return []
        if self.node_launcher is None:
            raise RuntimeError("the layout places servers on other nodes, but the run set no node launcher")
        from optima.serving.node_servers import node_server_specs, start_node_servers

        # Their ports first (probed here); node 0's replicas then skip them.
        specs = node_server_specs(
            self.recipe, model, self.vllm_env, stage_paths, self.layout.nodes, self.node_launcher, busy, first
        )
        servers = start_node_servers(specs)
        for server in servers:
            stack.callback(server.stop)
        return servers

    def _demand(self, model: str) -> int | None:
        """KV bytes the conversations need of ``model``'s server, when its KV cache is sized here (CPU, automatic)."""
        automatic = self.layout.policy[0].on_cpu and self.recipe.cpu_kvcache_space_gb is None
        return self.demand(model) if automatic and self.demand is not None else None

    def loss_urls(self) -> list[str] | None:
        """The loss server's URLs, waiting until it answers (started now if not up, again if it died); None without
        a loss server."""
        return self.loss.serve() if self.loss is not None else None

    @contextlib.contextmanager
    def search_loss_server(self) -> Iterator[Callable[[], list[str]]]:
        """A loss server for one tree search (``loss_placement: after`` on a GPU: ``layout.loss``, not resident),
        loading while the policy samples and stopped when the block ends, before anything trains. Yields a function
        that waits until it answers and returns its URLs; where the search scores is ``optima.run.loss_route``'s."""
        log = (self.log_dir or Path(self.recipe.output_dir) / "logs") / "search_loss_server.log"
        server = LossServer(self.recipe, self.vllm_env, self.loss_model, self.layout, log)
        try:
            server.start()
            logger.info("serve | loss server for the tree search: %s (stopped when the search ends)", self.loss_model)
            yield server.serve
        finally:
            server.stop()

    def release_for_training(self, trainer: bool = False) -> None:
        """Give the policy's cores and memory back for training: kept replicas sleep (GPU) or idle (CPU), others stop.

        The loss server stays up. A sleep request that fails stops the replicas instead (the next stage starts
        fresh ones), as does, on a CPU, a trainer whose measured peak the memory available now cannot hold beside
        the idle policy (``_trainer_fits``).

        Args:
            trainer: A trainer runs next (False: not weighed, e.g. an in-process scorer).
        """
        from optima.serving.sleep_mode import ReloadFailed, put_to_sleep

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
        stack, self._stack, self.model, self.asleep = self._stack, None, None, False
        self.node_servers = []
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
