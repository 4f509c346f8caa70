"""``serve(...)``: the OpenAI endpoints of the current model, launched as vLLM replicas or given by the recipe.

GPUs, ports and replica counts come from the recipe (docs/method.md D1):

* GPU machine: one replica per ``tensor_parallel_size`` GPUs of ``devices`` (default: every visible GPU), each
  with its own ``CUDA_VISIBLE_DEVICES``;
* CPU machine: one replica with vLLM's automatic thread binding (one core stays free for its scheduler),
  or, when asked for several (tests), the allowed cores split between them;
* ports: the first free port from ``port`` upward, one after the other, logged with each replica;
* ``endpoints`` in the recipe: nothing is launched; each URL must hold the model asked for, or is made to hold it
  (``optima.serving.endpoints``), and is returned.

Callers get base URLs (``http://127.0.0.1:8000/v1``) and nothing else: whether the engine runs on CPU or GPU
is decided and hidden here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from optima.config.rules import loss_model
from optima.environments import PythonEnv
from optima.hardware.machine import visible_gpus
from optima.hardware.memory import MemoryShare, loss_kvcache_gb
from optima.hardware.placement import Placement, place_replicas
from optima.paths import RunPaths, StagePaths
from optima.serving.endpoints import normalize_base_url, sync_endpoints
from optima.serving.processes import sigterm_as_exit
from optima.serving.vllm_server import ServerSpec, build_serve_command, build_serve_env, find_free_port, start_replicas

if TYPE_CHECKING:
    from optima.config import Recipe

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaLayout:
    """Where the replicas of one model start, and what starts beside them now.

    Args:
        placements: One per replica.
        busy_ports: Ports of servers starting beside them that may not listen yet (kept free).
        loss_starting: The loss server starts beside them now (its KV cache comes out of the memory they share).
        demand: KV bytes the run's conversations in flight need of them (caps an automatic CPU KV cache; None:
            unknown, the cap is the memory).
    """

    placements: Sequence[Placement]
    busy_ports: Sequence[int] = ()
    loss_starting: bool = False
    demand: int | None = None


def memory_share(recipe: Recipe, layout: ReplicaLayout) -> MemoryShare:
    """Who the CPU policy replicas starting now share the memory with (``optima.hardware.memory.cpu_kvcache_gb``):
    the loss server starting with them (one already running holds its memory: not counted) and what their
    conversations need."""
    loss_kv = loss_kvcache_gb(recipe, loss_model(recipe)) if layout.loss_starting else 0
    return MemoryShare(len(layout.placements), loss_kv, layout.demand)


def build_replica_specs(
    recipe: Recipe,
    model_path: str,
    vllm_env: PythonEnv,
    stage_paths: StagePaths,
    placements: Sequence[Placement],
    exclude_ports: Sequence[int] = (),
    share: MemoryShare | None = None,
) -> list[ServerSpec]:
    """Command line, environment, port and log file of each replica (ports are probed, nothing starts).

    ``exclude_ports`` are taken by servers that are starting and may not listen yet (the loss server); ``share``:
    who the replicas share the memory with (``memory_share``; None: the replicas alone).
    """
    cache_root = RunPaths(Path(recipe.output_dir)).vllm_cache  # evaluation recipes have no checkpoint root
    if share is None:
        share = memory_share(recipe, ReplicaLayout(placements, exclude_ports))
    specs, taken = [], list(exclude_ports)
    for replica, placement in enumerate(placements):
        port = find_free_port(recipe.host, recipe.port if len(taken) == len(exclude_ports) else taken[-1] + 1, taken)
        taken.append(port)
        argv = build_serve_command(recipe, model_path, port, vllm_env, placement)
        env = build_serve_env(recipe, vllm_env, placement, cache_root, model_path, share)
        log = stage_paths.server_log(replica)
        specs.append(ServerSpec(replica, tuple(argv), env, recipe.host, port, log))
    return specs


@contextlib.contextmanager
def serve(
    recipe: Recipe,
    model_path: str | Path,
    vllm_env: PythonEnv | None,
    stage_paths: StagePaths,
    cpu_replicas: int = 1,
    layout: ReplicaLayout | None = None,
) -> Iterator[list[str]]:
    """Serve ``model_path`` for the duration of the block; yield the OpenAI base URLs of its replicas.

    Servers are stopped on exit, on any exception, on Ctrl-C and on SIGTERM (turned into ``SystemExit``).

    Args:
        recipe: A recipe (serving fields, ``seed``, ``output_dir`` for the vLLM cache).
        model_path: Model folder (or hub id) to serve.
        vllm_env: Python environment with vLLM (unused when the recipe lists ``endpoints``).
        stage_paths: Stage folder; replica logs go to its ``logs/vllm_<i>.log``.
        cpu_replicas: Replicas on a machine without GPU (default 1).
        layout: Placements of the replicas, the ports and memory of servers starting beside them
            (``ReplicaLayout``, from ``optima.hardware.placement``); default: ``place_replicas``, alone.
    """
    with sigterm_as_exit():
        if recipe.endpoints:
            urls = sync_endpoints([normalize_base_url(u) for u in recipe.endpoints], recipe, str(model_path))
            logger.info("serve | %s | %d external endpoints: %s", model_path, len(urls), ", ".join(urls))
            yield urls
            return
        if vllm_env is None:
            raise ValueError("serve() needs a vLLM environment when the recipe lists no endpoints")
        if layout is None:
            cpus = sorted(os.sched_getaffinity(0))
            layout = ReplicaLayout(place_replicas(recipe, visible_gpus(), cpus, cpu_replicas))
        placements = layout.placements
        share = memory_share(recipe, layout)
        specs = build_replica_specs(
            recipe, str(model_path), vllm_env, stage_paths, placements, layout.busy_ports, share
        )
        where = "GPU"
        if placements[0].on_cpu:  # the KV budget: the recipe's, or sized to the memory available now
            where = f"CPU (KV cache {specs[0].env['VLLM_CPU_KVCACHE_SPACE']} GiB each)"
        logger.info(
            "serve | %s | %d %s replicas on ports %s",
            model_path,
            len(specs),
            where,
            ", ".join(str(s.port) for s in specs),
        )
        with start_replicas(specs, recipe.server_startup_timeout_s) as servers:
            yield [server.spec.api_url for server in servers]
