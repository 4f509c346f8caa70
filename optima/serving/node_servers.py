"""The other nodes of a Slurm run: one ``srun`` step per process there (policy servers here, the trainer's in
``optima.training.launch_config``).

With ``train_launcher: srun`` every node of the allocation samples: the hardware allocation gives each node after the
first node 0's policy replicas (``ServerLayout.nodes``, without the loss server's share), and ``ServerHolder`` starts
them with node 0's and pools every URL in the run's replica pool. Each one is ``srun --nodes 1 --relative R ...``:
the local srun process stands for it, and stopping it (its process group) ends the remote server. Slurm carries the
driver's environment to the step (secrets included: nothing but the GPU ids is on a command line); each server
binds to its node's name (``scontrol show hostnames``), so ``api_key`` is needed, and with sleep mode the names in
``private_hosts``. Sleep, wake and reload are HTTP requests: a remote replica sleeps for training and loads each
checkpoint like a local one (the checkpoint folder must be on a file system every node reads).
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from optima.config import LoopRecipe, RecipeError
from optima.environments import REPO_ROOT, PythonEnv
from optima.hardware.placement import NodeServers, bind_problem
from optima.paths import RunPaths, StagePaths
from optima.serving.processes import PARENT_ENV
from optima.serving.vllm_server import ServerSpec, VLLMServer, build_serve_command, find_free_port, serve_env_extra

logger = logging.getLogger(__name__)


def srun_step(nodes: int, gpus: Sequence[str] = (), relative: int | None = None, node_gpus: int = 0) -> list[str]:
    """The command prefix of one srun step: ``nodes`` nodes (from node ``relative``), one task per node with every
    CPU and GPU of the node (``SLURM_GPUS_ON_NODE``, else ``node_gpus``), shared with the run's other steps
    (``--overlap``: a sleeping server keeps its step while the trainer's runs), ended when one task fails; ``gpus``
    are the ones the command sees (set after Slurm's own ``CUDA_VISIBLE_DEVICES``)."""
    cpus = os.environ.get("SLURM_CPUS_ON_NODE") or str(os.cpu_count() or 1)
    step = ["srun", "--nodes", str(nodes), "--ntasks", str(nodes), "--ntasks-per-node", "1", "--cpus-per-task", cpus]
    step += ["--relative", str(relative)] if relative is not None else []
    if gpus:
        count = os.environ.get("SLURM_GPUS_ON_NODE") or str(node_gpus or max(int(g) for g in gpus) + 1)
        step += ["--gpus-per-node", count]
    step += ["--overlap", "--kill-on-bad-exit=1"]
    return step + (["env", f"CUDA_VISIBLE_DEVICES={','.join(gpus)}"] if gpus else [])


def slurm_hosts() -> list[str]:
    """The allocation's nodes in order (``scontrol show hostnames $SLURM_JOB_NODELIST``)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    result = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return result.stdout.split()


def node_server_specs(
    recipe: LoopRecipe,
    model: str,
    vllm_env: PythonEnv,
    stage_paths: StagePaths,
    nodes: Sequence[NodeServers],
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
        taken: Ports of servers starting here that may not listen yet (node 0's then skip these ones).
        first: The first replica index (after node 0's): their logs are ``vllm_<first>.log`` on.

    Raises:
        RecipeError: a node's name may not be bound (``bind_problem``).
    """
    cache, hosts = RunPaths(Path(recipe.output_dir)).vllm_cache, slurm_hosts()
    model = os.path.abspath(model) if os.path.exists(model) else model  # the step runs in the repository
    specs, taken, index = [], list(taken), first
    for node in nodes:
        host = hosts[node.rank]
        for placement in node.policy:
            problem = bind_problem(recipe, host, placement.carry_over)
            if problem:
                raise RecipeError("train_launcher", f"node {node.rank} ({host}): {problem}")
            port = find_free_port(recipe.host, recipe.port, taken)
            taken.append(port)
            argv = build_serve_command(recipe, model, port, vllm_env, placement)
            argv[argv.index("--host") + 1] = host
            env = serve_env_extra(recipe, placement, cache, model)
            env.pop(PARENT_ENV)  # the driver's pid means nothing on another node (srun's end stops the server)
            gpus = env.pop("CUDA_VISIBLE_DEVICES", "")
            command = [*srun_step(1, gpus.split(",") if gpus else (), node.rank), *argv]
            env = dict(os.environ) | env | {"PYTHONPATH": str(REPO_ROOT)}  # srun hands it all to the step
            specs.append(ServerSpec(index, tuple(command), env, host, port, stage_paths.server_log(index)))
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
