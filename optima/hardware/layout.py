"""Where the policy replicas and the loss server run when both live at once (pure, unit-tested).

The loss model is fixed for the whole run, so its vLLM server starts once and scores each conversation while the
policy is still generating (``loss_placement: beside``). The two must not fight over the same resources:

* CPU: each server's OpenMP threads are bound to their own cores (``VLLM_CPU_OMP_THREADS_BIND``): the loss server
  gets the last quarter of the allowed cores (at least one), the policy the rest. On a 2-core machine: policy on
  core 0, loss server on core 1 (``bench/RESULTS.md`` has the measurements that made this the default: against
  "after" with vLLM's own binding, one policy replica on both cores, two single-core replicas, and the API servers
  and engine cores pinned away from the compute threads, ``Placement.service_bind``). The loss server's KV cache is
  what scoring needs (``optima.hardware.capacity.loss_kvcache_gb``); the policy's is sized from what is left when
  it starts.
* GPU: the loss server runs on ``loss_devices`` when the recipe names them (each keeps the full
  ``gpu_memory_utilization``), else on the first policy GPU with ``loss_gpu_memory_utilization`` of its memory
  (null: the share the hardware allocation computes from the loss model's weights, ``optima.hardware.allocation``),
  taken from that replica's share; the other policy replicas keep theirs. Each server's tensor parallel size is the
  number of its GPUs (``optima.serving.vllm_server.build_serve_command``).

With ``sleep_mode`` (on by default, GPU and CPU) the policy replicas are kept from checkpoint to checkpoint:
they sleep (GPU) or idle (CPU) during training and then load the new weights (``optima.serving.sleep_mode``).

``loss_placement: after`` on a GPU in a loop with a tree search (iDPO, iSFT-DPO): the search scores every rollout
while the policy keeps generating, so the loss server is placed as above but starts with each search and stops
after it (``ServerLayout.loss_resident`` false): it never holds memory while the trainer runs. On a CPU the search
scores with transformers in the driver instead (the cores are the policy's either way).

Several training nodes (``train_hosts``, or srun): every node serves the policy too (``NodeServers``: the same
replicas as node 0, without the loss server's share), started through the training's launcher
(``optima.serving.node_servers``) and pooled with node 0's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optima.config import LOOPBACK_HOSTS, RecipeError
from optima.config.rules import loss_model
from optima.hardware.capacity import loss_kvcache_gb
from optima.hardware.placement import Placement
from optima.methods import DPO, runs

if TYPE_CHECKING:
    from optima.config import LoopRecipe, Recipe


@dataclass(frozen=True)
class NodeServers:
    """The policy replicas of one more node of a multi-node run.

    Args:
        rank: Its machine rank (1, 2, ...; node 0 is the driver's).
        host: Its host as the recipe names it (``""``: a Slurm node found at start).
        policy: Its replicas (GPUs of that node, or one CPU server).
    """

    rank: int
    host: str
    policy: tuple[Placement, ...]


@dataclass(frozen=True)
class ServerLayout:
    """Placements of the policy replicas and of the loss server (``None``: no loss server beside them).

    ``loss_resident``: the loss server serves the whole run (``beside``), else only each tree search (``after``).
    ``nodes``: the policy replicas of the other nodes of a multi-node run (pooled with ``policy``).
    """

    policy: tuple[Placement, ...]
    loss: Placement | None
    loss_resident: bool = True
    nodes: tuple[NodeServers, ...] = ()


def loss_server_wanted(recipe: Recipe) -> bool:
    """Whether the run keeps a vLLM server of the loss model beside the policy (launched servers only).

    Evaluation recipes have no reward, so no loss model: never.
    """
    served = getattr(recipe, "cal_ppl", False) and recipe.loss_backend == "vllm"
    return bool(served and recipe.loss_placement == "beside" and not recipe.endpoints)


def search_loss_server_wanted(recipe: Recipe) -> bool:
    """Whether a loss server starts for each tree search (``loss_placement: after`` in iDPO and iSFT-DPO): the search
    scores each rollout as it ends, while the policy is still served (on a GPU; see the module docstring)."""
    served = getattr(recipe, "cal_ppl", False) and recipe.loss_backend == "vllm"
    searches = runs(getattr(recipe, "method", ""), DPO)  # the loops with a tree search
    return bool(served and searches and recipe.loss_placement == "after" and not recipe.endpoints)


def bind_problem(recipe: Recipe, host: str, carry_over: bool, private: Sequence[str] | None = None) -> str | None:
    """Why a policy server may not bind to ``host``, reachable from node 0 (None: it may).

    Its reload routes (sleep mode) are not guarded by the API key: only loopback or a host of ``private_hosts``
    (``private``: the names taken as private, default ``private_hosts``).
    """
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


def carry_over_on(recipe: Recipe, gpus: Sequence[str]) -> bool:
    """Keep the policy server across checkpoints: ``sleep_mode``, by default on (GPU and CPU)."""
    if recipe.endpoints:
        return False
    return True if recipe.sleep_mode is None else recipe.sleep_mode


def place_servers(
    recipe: Recipe, gpus: Sequence[str], cpus: Sequence[int], loss_share: float | None = None
) -> ServerLayout:
    """Placements of every server of an iteration recipe.

    Args:
        recipe: Serving fields, ``loss_placement``, ``loss_devices``, ``loss_gpu_memory_utilization``, ``sleep_mode``.
        gpus: Visible GPU ids (empty: CPU machine).
        cpus: CPU ids this process may run on.
        loss_share: The loss server's memory share when the recipe leaves it null (from the hardware allocation).
    """
    beside, carry = loss_server_wanted(recipe), carry_over_on(recipe, gpus)
    if gpus:
        policy = [dataclasses.replace(p, carry_over=carry) for p in place_replicas(recipe, gpus, cpus)]
        resident = beside
        if not beside and not search_loss_server_wanted(recipe):
            return ServerLayout(tuple(policy), None)
        if recipe.loss_devices is not None:
            bad = [d for d in recipe.loss_devices if d >= len(gpus)]
            if bad:
                raise RecipeError("loss_devices", f"GPU {bad[0]} is not visible (visible: {list(gpus)})")
            loss = Placement(gpus=tuple(gpus[d] for d in recipe.loss_devices), scoring=True)
            return ServerLayout(tuple(policy), loss, resident)
        share = recipe.loss_gpu_memory_utilization or loss_share
        if share is None:
            raise ValueError("loss_gpu_memory_utilization is null: the hardware allocation computes the share")
        left = round(recipe.gpu_memory_utilization - share, 4)
        if left <= 0:
            raise RecipeError(
                "loss_gpu_memory_utilization",
                f"{share} leaves nothing of gpu_memory_utilization={recipe.gpu_memory_utilization} for the policy "
                "on the GPU they share; lower it or name loss_devices",
            )
        policy[0] = dataclasses.replace(policy[0], gpu_memory_utilization=left)
        loss = Placement(gpus=policy[0].gpus[:1], gpu_memory_utilization=share, scoring=True)
        return ServerLayout(tuple(policy), loss, resident)
    if not beside:
        return ServerLayout((Placement(carry_over=carry),), None)
    return place_cpu_beside(recipe, sorted(cpus), carry)


def place_cpu_beside(recipe: LoopRecipe, cpus: list[int], carry: bool) -> ServerLayout:
    """Policy and loss server on a CPU: their own cores, and the loss server's KV cache what scoring needs.

    The loss server gets the last quarter of the cores (at least one), the policy the rest; one core is shared.
    """
    loss_kv = loss_kvcache_gb(recipe, loss_model(recipe))
    if len(cpus) < 2:  # one core: both servers share it
        return ServerLayout((Placement(carry_over=carry),), Placement(cpu_kvcache_gb=loss_kv))
    loss_cores = max(1, len(cpus) // 4)
    policy = Placement(cpu_bind=",".join(map(str, cpus[:-loss_cores])), carry_over=carry)
    return ServerLayout((policy,), Placement(cpu_bind=",".join(map(str, cpus[-loss_cores:])), cpu_kvcache_gb=loss_kv))


def place_replicas(recipe: Recipe, gpus: Sequence[str], cpus: Sequence[int], cpu_replicas: int = 1) -> list[Placement]:
    """Where each replica runs (pure).

    Args:
        recipe: Its ``devices`` (GPU ordinals among ``gpus``; null = all) and ``tensor_parallel_size``.
        gpus: Visible GPU ids (empty: CPU machine).
        cpus: CPU ids this process may run on (``os.sched_getaffinity``).
        cpu_replicas: Replicas on a CPU machine; above 1 each gets its own slice of ``cpus``.
    """
    if gpus:
        ordinals = recipe.devices if recipe.devices is not None else range(len(gpus))
        bad = [d for d in ordinals if d >= len(gpus)]
        if bad:
            raise RecipeError(
                "devices",
                f"GPU {bad[0]} of {list(ordinals)} is not visible (visible: {list(gpus)}); "
                "name the GPUs as a list, e.g. [0, 1]",
            )
        selected = [gpus[d] for d in ordinals]
        tp = recipe.tensor_parallel_size
        if not selected or len(selected) % tp:
            raise RecipeError(
                "devices", f"{len(selected)} GPUs cannot be split into replicas of tensor_parallel_size={tp}"
            )
        return [Placement(gpus=tuple(selected[i : i + tp])) for i in range(0, len(selected), tp)]
    if cpu_replicas == 1:
        return [Placement()]
    # Contiguous slices; with fewer cores than replicas, replicas share cores round-robin.
    cpus = sorted(cpus)
    per = max(len(cpus) // cpu_replicas, 1)
    slices = [cpus[(i * per) % len(cpus) :][:per] for i in range(cpu_replicas)]
    return [Placement(cpu_bind=",".join(map(str, s))) for s in slices]


def describe_placement(placement: Placement, recipe: Recipe) -> str:
    """``GPUs 0 (memory share 0.8)`` / ``CPU cores 0`` / ``CPU (vLLM's automatic binding)``."""
    if placement.on_cpu:
        where = f"CPU cores {placement.cpu_bind}" if placement.cpu_bind else "CPU (vLLM's automatic binding)"
        kept = ", kept across iterations (weights reloaded)" if placement.carry_over else ""
        return where + kept + cpu_cache_text(placement, recipe)
    share = placement.gpu_memory_utilization or recipe.gpu_memory_utilization
    sleep = ", sleeps during training" if placement.carry_over else ""
    return f"GPUs {','.join(placement.gpus)} (memory share {share}{sleep})"


def cpu_cache_text(placement: Placement, recipe: Recipe) -> str:
    """The KV cache of a CPU server as the dry-run names it (``optima.hardware.capacity``)."""
    if placement.cpu_kvcache_gb is not None:  # the loss server: what scoring needs
        return f", KV cache {placement.cpu_kvcache_gb} GiB (one scoring batch)"
    if recipe.cpu_kvcache_space_gb is not None:
        return f", KV cache {recipe.cpu_kvcache_space_gb} GiB (cpu_kvcache_space_gb)"
    return f", KV cache sized at start: what {recipe.thread_count} conversations need, within the memory available"


def describe_layout(recipe: LoopRecipe, loss_model: str, layout: ServerLayout | None) -> dict[str, str]:
    """The servers of a run as ``--dry-run`` shows them (one line per server; ``layout`` None: endpoints)."""
    if recipe.endpoints or layout is None:
        return {"policy": "external endpoints " + ", ".join(recipe.endpoints)} if recipe.endpoints else {}
    lines = {f"policy replica {i}": describe_placement(p, recipe) for i, p in enumerate(layout.policy)}
    for node in layout.nodes:
        where = node.host or "its Slurm node"
        for i, placement in enumerate(node.policy):
            lines[f"node {node.rank} policy replica {i}"] = (
                f"{describe_placement(placement, recipe)} on {where}, started through {recipe.train_launcher}"
            )
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
    policy_itself = f"the policy server itself while it serves {loss_model}; else "
    if layout.loss is not None:
        where = describe_placement(layout.loss, recipe)
        return policy_itself + f"a loss server on {where}, started with each search and stopped after it"
    return policy_itself + "transformers in the driver process (CPU: the policy server keeps the cores)"
