"""Where each server and the training run: the placements, and how the servers of a recipe are placed (pure).

The policy replicas take ``tensor_parallel_size`` GPUs each of ``devices``; the loss server beside them runs on
``loss_devices``, else on the first policy GPU with a memory share taken from that replica's; on a CPU the two
servers get their own cores. The allocation (``optima.hardware``) makes them; serving starts each server where its
placement says, the training launch its processes where the training placement says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optima.config import LOOPBACK_HOSTS, RecipeError
from optima.config.rules import loss_model
from optima.hardware.memory import loss_kvcache_gb
from optima.methods import DPO, runs

if TYPE_CHECKING:
    from optima.config import LoopRecipe, Recipe


@dataclass(frozen=True)
class Placement:
    """Where one server runs.

    Args:
        gpus: Its ``CUDA_VISIBLE_DEVICES`` entries (``None``: on the CPU); tensor parallel over all of them.
        cpu_bind: ``VLLM_CPU_OMP_THREADS_BIND`` (``None``: vLLM's own binding).
        service_bind: Not applied: serving pins no API server or engine core (within the noise, docs/cpu.md).
            Nothing sets it.
        cpu_kvcache_gb: A fixed CPU KV cache, GiB (the loss server's); ``None``: the policy's, sized at start.
        gpu_memory_utilization: Its share of each GPU (``None``: the recipe's).
        carry_over: Kept from checkpoint to checkpoint (sleep mode's development routes; ``--enable-sleep-mode``).
        scoring: The loss server: on a GPU started with the limits scoring needs (``loss_server_limits``).
    """

    gpus: tuple[str, ...] | None = None
    cpu_bind: str | None = None
    service_bind: str | None = None
    cpu_kvcache_gb: int | None = None
    gpu_memory_utilization: float | None = None
    carry_over: bool = False
    scoring: bool = False

    @property
    def on_cpu(self) -> bool:
        return self.gpus is None


@dataclass(frozen=True)
class NodeServers:
    """The policy replicas of node ``rank`` (1, 2, ...) of a multi-node run; ``host`` ``""``: a Slurm node."""

    rank: int
    host: str
    policy: tuple[Placement, ...]


@dataclass(frozen=True)
class ServerLayout:
    """The policy replicas and the loss server (``None``: none beside them); ``loss_resident``: it serves the whole
    run (``beside``), else each tree search only (``after``); ``nodes``: the other nodes' replicas."""

    policy: tuple[Placement, ...]
    loss: Placement | None
    loss_resident: bool = True
    nodes: tuple[NodeServers, ...] = ()


@dataclass(frozen=True)
class NodeRanks:
    """One node of the training: its host, machine rank and GPUs (``()`` on a CPU)."""

    host: str
    machine_rank: int
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrainingPlacement:
    """The training processes: ``nodes`` (rank 0 first), the same ``processes_per_node`` on each, started by
    ``launcher`` (``local``, or ``srun``: one step over the Slurm allocation, ``optima.training.launch_config``),
    with ``main_port`` for the rendezvous of several nodes; ``gpus_per_node``: each node's GPUs (the step asks all)."""

    nodes: tuple[NodeRanks, ...]
    processes_per_node: int
    launcher: str = "local"
    main_port: int = 29500
    gpus_per_node: int = 0

    @property
    def num_processes(self) -> int:
        return self.processes_per_node * len(self.nodes)

    @property
    def multi_node(self) -> bool:
        return len(self.nodes) > 1

    def local_env(self) -> dict[str, str]:
        """The GPUs of a one-node training (nothing on a CPU)."""
        gpus = self.nodes[0].gpus if len(self.nodes) == 1 else ()
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {}


def loss_server_wanted(recipe: Recipe) -> bool:
    """Whether a vLLM server of the loss model serves the whole run beside the policy (never for an evaluation)."""
    served = getattr(recipe, "cal_ppl", False) and recipe.loss_backend == "vllm"
    return bool(served and recipe.loss_placement == "beside" and not recipe.endpoints)


def search_loss_server_wanted(recipe: Recipe) -> bool:
    """Whether a loss server starts for each tree search (``loss_placement: after`` in iDPO, iSFT-DPO; on a GPU)."""
    served = getattr(recipe, "cal_ppl", False) and recipe.loss_backend == "vllm"
    searches = runs(getattr(recipe, "method", ""), DPO)
    return bool(served and searches and recipe.loss_placement == "after" and not recipe.endpoints)


def carry_over_on(recipe: Recipe) -> bool:
    """Keep the policy server across checkpoints: ``sleep_mode``, on by default (GPU and CPU); never endpoints."""
    return not recipe.endpoints and (True if recipe.sleep_mode is None else recipe.sleep_mode)


def bind_problem(recipe: Recipe, host: str, carry_over: bool) -> str | None:
    """Why a policy server reachable from node 0 may not bind to ``host`` (None: it may): without an API key, or
    with sleep mode's reload routes (no key guards them) outside ``private_hosts``."""
    if host in LOOPBACK_HOSTS:
        return None
    if not recipe.api_key:
        return f"its servers bind to {host}, reachable from node 0: set api_key"
    if carry_over and host not in recipe.private_hosts:
        return (
            f"its servers bind to {host} with sleep_mode, whose reload routes the API key does not guard: list "
            "the nodes' names in private_hosts (private interfaces), or set sleep_mode: false"
        )
    return None


def place_replicas(recipe: Recipe, gpus: Sequence[str], cpus: Sequence[int], cpu_replicas: int = 1):
    """One placement per replica: ``tensor_parallel_size`` GPUs each of ``devices`` (ordinals of ``gpus``; null: all),
    or on a CPU one (``cpu_replicas`` > 1: each its own slice of ``cpus``)."""
    if gpus:
        ordinals = recipe.devices if recipe.devices is not None else range(len(gpus))
        bad = [d for d in ordinals if d >= len(gpus)]
        if bad:
            visible = f"GPU {bad[0]} of {list(ordinals)} is not visible (visible: {list(gpus)})"
            raise RecipeError("devices", f"{visible}; name the GPUs as a list, e.g. [0, 1]")
        selected, tp = [gpus[d] for d in ordinals], recipe.tensor_parallel_size
        if not selected or len(selected) % tp:
            raise RecipeError(
                "devices", f"{len(selected)} GPUs cannot be split into replicas of tensor_parallel_size={tp}"
            )
        return [Placement(gpus=tuple(selected[i : i + tp])) for i in range(0, len(selected), tp)]
    if cpu_replicas == 1:
        return [Placement()]
    cpus = sorted(cpus)  # contiguous slices; with fewer cores than replicas, shared round-robin
    per = max(len(cpus) // cpu_replicas, 1)
    return [Placement(cpu_bind=",".join(map(str, cpus[(i * per) % len(cpus) :][:per]))) for i in range(cpu_replicas)]


def place_servers(
    recipe: Recipe, gpus: Sequence[str], cpus: Sequence[int], loss_share: float | None = None
) -> ServerLayout:
    """The policy replicas and the loss server of a recipe on ``gpus`` (empty: a CPU) and ``cpus``.

    GPU: the loss server on ``loss_devices``, else on the first policy GPU with ``loss_gpu_memory_utilization`` (or
    ``loss_share``, the allocation's rule) taken from that replica's share. CPU: the loss server on the last quarter
    of the cores (at least one; ``bench/RESULTS.md`` measured the choice), with a KV cache of one scoring batch.
    """
    beside, carry = loss_server_wanted(recipe), carry_over_on(recipe)
    if not gpus:
        if not beside:
            return ServerLayout((Placement(carry_over=carry),), None)
        cpus, loss_kv = sorted(cpus), loss_kvcache_gb(recipe, loss_model(recipe))
        if len(cpus) < 2:  # one core: both servers share it
            return ServerLayout((Placement(carry_over=carry),), Placement(cpu_kvcache_gb=loss_kv))
        cut = len(cpus) - max(1, len(cpus) // 4)
        policy = Placement(cpu_bind=",".join(map(str, cpus[:cut])), carry_over=carry)
        return ServerLayout((policy,), Placement(cpu_bind=",".join(map(str, cpus[cut:])), cpu_kvcache_gb=loss_kv))
    policy = [dataclasses.replace(p, carry_over=carry) for p in place_replicas(recipe, gpus, cpus)]
    if not beside and not search_loss_server_wanted(recipe):
        return ServerLayout(tuple(policy), None)
    if recipe.loss_devices is not None:
        bad = [d for d in recipe.loss_devices if d >= len(gpus)]
        if bad:
            raise RecipeError("loss_devices", f"GPU {bad[0]} is not visible (visible: {list(gpus)})")
        loss = Placement(gpus=tuple(gpus[d] for d in recipe.loss_devices), scoring=True)
        return ServerLayout(tuple(policy), loss, beside)
    share = recipe.loss_gpu_memory_utilization or loss_share
    if share is None:
        raise ValueError("loss_gpu_memory_utilization is null: the hardware allocation computes the share")
    left = round(recipe.gpu_memory_utilization - share, 4)
    if left <= 0:
        whole = f"gpu_memory_utilization={recipe.gpu_memory_utilization}"
        raise RecipeError(
            "loss_gpu_memory_utilization",
            f"{share} leaves nothing of {whole} for the policy on the GPU they share; lower it or name loss_devices",
        )
    policy[0] = dataclasses.replace(policy[0], gpu_memory_utilization=left)
    loss = Placement(gpus=policy[0].gpus[:1], gpu_memory_utilization=share, scoring=True)
    return ServerLayout(tuple(policy), loss, beside)


def describe_placement(placement: Placement, recipe: Recipe) -> str:
    """``GPUs 0 (memory share 0.8, sleeps during training)`` / ``CPU cores 0, ..., KV cache ...``."""
    if not placement.on_cpu:
        share = placement.gpu_memory_utilization or recipe.gpu_memory_utilization
        sleeps = ", sleeps during training" if placement.carry_over else ""
        return f"GPUs {','.join(placement.gpus)} (memory share {share}{sleeps})"
    where = f"CPU cores {placement.cpu_bind}" if placement.cpu_bind else "CPU (vLLM's automatic binding)"
    where += ", kept across iterations (weights reloaded)" if placement.carry_over else ""
    if placement.cpu_kvcache_gb is not None:  # the loss server: what scoring needs
        return where + f", KV cache {placement.cpu_kvcache_gb} GiB (one scoring batch)"
    if recipe.cpu_kvcache_space_gb is not None:
        return where + f", KV cache {recipe.cpu_kvcache_space_gb} GiB (cpu_kvcache_space_gb)"
    return (
        where
        + f", KV cache sized at start: what {recipe.thread_count} conversations need, within the memory available"
    )


def describe_layout(recipe: LoopRecipe, loss_model: str, layout: ServerLayout | None) -> dict[str, str]:
    """The servers of a run as ``--dry-run`` shows them, one line each (``layout`` None: external endpoints)."""
    if recipe.endpoints or layout is None:
        return {"policy": "external endpoints " + ", ".join(recipe.endpoints)} if recipe.endpoints else {}
    lines = {f"policy replica {i}": describe_placement(p, recipe) for i, p in enumerate(layout.policy)}
    for node in layout.nodes:
        for i, placement in enumerate(node.policy):
            where = node.host or "its Slurm node"
            text = f"{describe_placement(placement, recipe)} on {where}, started through {recipe.train_launcher}"
            lines[f"node {node.rank} policy replica {i}"] = text
    if layout.loss is not None and layout.loss_resident:
        lines["loss server"] = f"{loss_model} on {describe_placement(layout.loss, recipe)}, started once per run"
    elif getattr(recipe, "cal_ppl", False):
        scored = ", scored after generation" if getattr(recipe, "method", None) != DPO else ""  # iDPO: none
        lines["loss model"] = f"{loss_model}, {recipe.loss_backend} backend{scored}"
        if runs(getattr(recipe, "method", ""), DPO):
            lines["tree search LM loss"] = search_loss_text(recipe, loss_model, layout)
    return lines


def search_loss_text(recipe: LoopRecipe, loss_model: str, layout: ServerLayout) -> str:
    """How the tree search scores its rollouts' LM loss when no loss server serves the whole run (``after``)."""
    if recipe.loss_backend != "vllm":
        return "transformers in the driver process (loss_backend: hf)"
    text = f"the policy server itself while it serves {loss_model}; else "
    if layout.loss is not None:
        where = describe_placement(layout.loss, recipe)
        return text + f"a loss server on {where}, started with each search and stopped after it"
    return text + "transformers in the driver process (CPU: the policy server keeps the cores)"
