"""The policy servers of the other nodes of a multi-node run, started through the training's own launcher.

With several training nodes (``train_hosts``, ``train_hostfile`` or ``train_launcher: srun``) every node samples:
the hardware allocation gives each node after the first the policy replicas node 0 has (``ServerLayout.nodes``, without
the loss server's share), and ``ServerHolder`` starts them with node 0's and pools every URL in the run's replica
pool. Each one's ``vllm serve`` command goes to its node the way the trainer does (``NodeLauncher``, built from the
training placement by ``optima.training.nodes.NodeCommands``: ``ssh -tt HOST 'cd REPO && env ... vllm serve ...'``,
or one srun step on that node), so the local process that stands for it is the ssh (or srun) process: stopping it
(its process group) hangs up the remote command, as for a training node.

Under ssh a remote server binds to its node's loopback and is reached through an ssh tunnel (``-L``) at the same
port here, so its reload routes (sleep mode) never face the network; under srun it binds to the node's name (then
``api_key`` is needed, and with sleep mode the names in ``private_hosts``). Its port is the first one free here
from ``port`` upward (node 0's replicas then skip it; a port taken on the node fails at start with the log).
Its environment is what the launcher forwards plus the replica's own settings (GPUs, vLLM's variables, the
development routes of sleep mode); its log is the launcher's output, ``logs/vllm_<n>.log`` after node 0's. Sleep,
wake and reload are HTTP requests, so a remote replica sleeps for training and loads each checkpoint like a local
one: the checkpoint path must be readable on every node (the shared file system a multi-node training writes its
checkpoints to). The API key, when set, travels in the command line (visible in that node's process list; the
log shows it redacted).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from optima.config import RecipeError
from optima.environments import REPO_ROOT, PythonEnv
from optima.hardware.placement import bind_problem
from optima.paths import RunPaths, StagePaths
from optima.serving.processes import PARENT_ENV
from optima.serving.vllm_server import ServerSpec, VLLMServer, build_serve_command, find_free_port, serve_env_extra

if TYPE_CHECKING:
    from optima.config import Recipe
    from optima.hardware.placement import NodeServers

logger = logging.getLogger(__name__)


class NodeLauncher(Protocol):
    """Starts a command on another node of the training (``optima.training.nodes.NodeCommands``)."""

    def command(self, rank: int, argv: Sequence[str], env: Mapping[str, str], port: int) -> list[str]:
        """The local command that runs ``argv`` with ``env`` on node ``rank``, serving ``port``."""

    def host(self, rank: int) -> str:
        """The address node ``rank``'s servers bind to and are reached at (ssh: loopback, tunnelled)."""


def node_server_specs(
    recipe: Recipe,
    model: str,
    vllm_env: PythonEnv,
    stage_paths: StagePaths,
    nodes: Sequence[NodeServers],
    launcher: NodeLauncher,
    taken: Sequence[int],
    first: int,
) -> list[ServerSpec]:
    """Command, environment, port and log of every replica of the other nodes (nothing starts).

    Args:
        recipe: Serving fields.
        model: The policy model (a path every node can read).
        vllm_env: The vLLM environment (the same path on every node).
        stage_paths: The stage folder (logs).
        nodes: The other nodes' replicas (``ServerLayout.nodes``).
        launcher: Builds each node's command.
        taken: Ports of servers starting here that may not listen yet (node 0's then skip these ones).
        first: The first replica index (after node 0's): their logs are ``vllm_<first>.log`` on.

    Raises:
        RecipeError: a node's address may not be bound (``bind_problem``).
    """
    cache = RunPaths(Path(recipe.output_dir)).vllm_cache
    model = os.path.abspath(model) if os.path.exists(model) else model  # the node's command runs in the repository
    specs, taken, index = [], list(taken), first
    for node in nodes:
        host = launcher.host(node.rank)
        for placement in node.policy:
            problem = bind_problem(recipe, host, placement.carry_over)
            if problem:
                raise RecipeError("train_hosts", f"node {node.rank} ({host}): {problem}")
            port = find_free_port(recipe.host, recipe.port, taken)
            taken.append(port)
            argv = build_serve_command(recipe, model, port, vllm_env, placement)
            argv[argv.index("--host") + 1] = host
            env = serve_env_extra(recipe, placement, cache, model)
            env.pop(PARENT_ENV)  # the driver's pid means nothing on another node (its ssh hang-up stops it)
            env["PYTHONPATH"] = str(REPO_ROOT)  # the launcher module (the repository's path on every node)
            command = launcher.command(node.rank, argv, env, port)
            local = {k: v for k, v in env.items() if k == "VLLM_API_KEY"}  # redacted from the log's command line
            log = stage_paths.server_log(index)
            specs.append(ServerSpec(index, tuple(command), dict(os.environ) | local, host, port, log))
            index += 1
    return specs


def start_node_servers(specs: Sequence[ServerSpec]) -> list[VLLMServer]:
    """Start every node server (not waiting: they load while node 0's do); the caller stops them."""
    servers = []
    try:
        for spec in specs:
            servers.append(VLLMServer(spec).__enter__())
            logger.info("serve | node server %s on %s (log %s)", spec.replica, spec.api_url, spec.log_path)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
