"""The hardware allocation of a run: (recipe, hardware) -> where every process runs and what it holds, checked first.

One allocation places the policy replicas and the loss server (``optima.hardware.layout``, whose memory share for the
loss server is computed here from its weights when the recipe leaves ``loss_gpu_memory_utilization`` null), and the
training processes (``optima.hardware.placement.TrainingPlacement``: GPUs, ``num_processes``, machine ranks per node).
Each claim on a GPU carries an estimate (``optima.hardware.memory``), in the two phases of an iteration:

* generation: every server's memory share (vLLM takes all of it at start-up) must hold its weights, a minimum KV
  cache and vLLM's own memory, and the shares on one GPU must add up to at most 1;
* training: the trainer's peak, beside what the other processes still hold then: a sleeping policy replica its
  CUDA context, a loss server (which stays up for the whole run) its whole share. Training never runs on a GPU of a
  server that stays resident.

An impossible allocation is refused before anything starts (``check``), with one message naming the GPU, the claims on
it and a fix. ``--dry-run`` prints ``render()``. docs/gpu.md describes the allocation and its estimates.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING

from optima.config import LOOPBACK_HOSTS, RecipeError
from optima.config.rules import loss_model
from optima.hardware import memory, vllm_memory
from optima.hardware.claims import Claim, HardwareAllocation, describe_claims, phase_total
from optima.hardware.layout import (
    NodeServers,
    ServerLayout,
    bind_problem,
    carry_over_on,
    loss_server_wanted,
    place_servers,
    search_loss_server_wanted,
)
from optima.hardware.memory import GIB, ModelSize, gib
from optima.hardware.placement import Placement
from optima.hardware.spec import Hardware, detect_hardware
from optima.hardware.training import allocate_training, policy_size, trainer_yamls, training_hosts
from optima.hardware.vllm_memory import ServerNeed
from optima.methods import DPO, runs

if TYPE_CHECKING:
    from optima.config import Recipe

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
MIN_LOSS_SHARE = 0.05


def allocate_hardware(
    recipe: Recipe, hardware: Hardware, cpus: list[int] | None = None, *, training: bool = True
) -> HardwareAllocation:
    """The allocation of ``recipe`` on ``hardware`` (pure but for reading the model configs and trainer YAMLs).

    ``training=False`` allocates the servers alone (``make gpu-check``'s server checks, which train nothing: on one
    GPU, training would not fit beside a resident loss server)."""
    allocation = HardwareAllocation(hardware)
    if hardware.has_gpu and hardware.gpu_gib <= 0:
        allocation.problems.append(unknown_memory_problem(hardware))
        return allocation
    yamls = trainer_yamls(recipe)
    if yamls:  # evaluation serves each model once: no sleep mode, no reload routes
        check_dev_mode_bind(recipe, hardware, allocation)
    size = policy_size(recipe, yamls)
    if size is not None:
        allocation.lines.append(f"policy model: {_describe_size(size)}")
    if recipe.endpoints:
        allocation.lines.append(
            "servers: external endpoints " + ", ".join(recipe.endpoints) + " (nothing launched here)"
        )
    else:
        allocate_servers(recipe, hardware, size, allocation, cpus or [0])
    if yamls and training:
        allocate_node_servers(recipe, hardware, size, allocation, training_hosts(recipe, hardware))
        allocate_training(recipe, hardware, size, yamls, allocation)
        note_search_loss(recipe, hardware, allocation)
    return allocation


def note_search_loss(recipe: Recipe, hardware: Hardware, allocation: HardwareAllocation) -> None:
    """The tree search (iDPO, iSFT-DPO) without a loss server scores with transformers in the driver, on the CPU,
    whenever the policy it searches with is not the loss model (``optima.stages.common.loss_route``)."""
    searches = runs(recipe.method, DPO) and getattr(recipe, "cal_ppl", False)
    if hardware.has_gpu and searches and not loss_server_wanted(recipe):
        allocation.notes.append(
            f"the tree search scores LM losses of {loss_model(recipe)} with transformers in the driver process "
            "(fp32, on the CPU) whenever the policy is not the loss model (--dry-run's [search] stages say which): "
            "slow for an 8B model; loss_placement: beside serves it with vLLM on a GPU"
        )


def allocate_this_machine(
    recipe: Recipe, hardware: Hardware | None = None, *, training: bool = True
) -> HardwareAllocation:
    """The allocation of ``recipe`` on this machine: ``hardware`` (``--hardware``), else the detected one, and the CPU
    cores this process may run on (``os.sched_getaffinity``); ``training`` as in ``allocate_hardware``."""
    cpus = sorted(os.sched_getaffinity(0))
    return allocate_hardware(recipe, hardware or detect_hardware(), cpus, training=training)


def unknown_memory_problem(hardware: Hardware) -> str:
    """The GPUs are visible but their memory is not (no ``nvidia-smi``): nothing can be sized."""
    return (
        f"{hardware.gpus_per_node} GPU(s) visible ({','.join(hardware.gpu_ids)}) but their memory is unknown "
        f"({hardware.source}: nvidia-smi gave no memory.total): name the machine with --hardware, e.g. --hardware "
        f"{hardware.gpus_per_node}x80GB for 80 GB cards"
    )


def _describe_size(size: ModelSize) -> str:
    return f"{size.name}: {size.params / 1e9:.2f}e9 parameters ({size.source})"


def check_dev_mode_bind(recipe: Recipe, hardware: Hardware, allocation: HardwareAllocation) -> None:
    """Refuse vLLM's development routes (sleep mode's reloads: no API key guards them) on a public address."""
    if recipe.endpoints or not carry_over_on(recipe, hardware.gpu_ids if hardware.has_gpu else []):
        return
    host = recipe.host
    if host in LOOPBACK_HOSTS or (host in recipe.private_hosts and host not in WILDCARD_HOSTS):
        return
    allocation.problems.append(
        f"host {host!r}: sleep_mode opens vLLM's reload routes (VLLM_SERVER_DEV_MODE), which its API key does not "
        "guard; bind to 127.0.0.1 or to a private interface listed in private_hosts (never a wildcard), or set "
        "sleep_mode: false"
    )


def loss_share_for(need: int, gpu_gib: float) -> float:
    """The smallest memory share (2 decimals, at least 0.05) that holds ``need`` bytes on a GPU."""
    return max(MIN_LOSS_SHARE, math.ceil(need / (gpu_gib * GIB) * 100) / 100)


def allocate_servers(
    recipe: Recipe, hardware: Hardware, size: ModelSize | None, allocation: HardwareAllocation, cpus: list[int]
) -> None:
    """Place the servers on node 0 and claim their shares (generation), checking each against its need."""
    gpus = list(hardware.gpu_ids) if hardware.has_gpu else []
    # A loss server beside the policy: for the whole run, or (after, on a GPU) for each tree search.
    beside = loss_server_wanted(recipe) or bool(gpus and search_loss_server_wanted(recipe))
    dtype = memory.served_dtype_bytes(recipe.vllm_extra_args)
    loss_size = memory.model_size(loss_model(recipe), recipe.tokenizer_first_path) if beside else None
    loss_need = None
    if loss_size is not None and gpus:
        loss_kv = memory.loss_kv_min_bytes(loss_size, recipe, dtype)
        tp = len(recipe.loss_devices or [0])
        loss_need = vllm_memory.server_need(loss_size, loss_kv, tp, dtype, vllm_memory.loss_args(recipe, loss_size))
        if recipe.loss_gpu_memory_utilization is None and recipe.loss_devices is None:
            allocation.loss_share = loss_share_for(loss_need.total, hardware.gpu_gib)
    shared = beside and gpus and recipe.loss_devices is None
    if shared and recipe.loss_gpu_memory_utilization is None and allocation.loss_share is None:
        allocation.problems.append(
            f"loss server: the size of {loss_model(recipe)} is unknown (no config.json, not a known hub name): set "
            "loss_gpu_memory_utilization, or loss_devices"
        )
        return
    try:
        allocation.layout = place_servers(recipe, gpus, cpus, loss_share=allocation.loss_share)
    except RecipeError as exc:
        allocation.problems.append(str(exc))
        return
    if not hasattr(recipe, "accelerate_config"):  # evaluation: replicas started per model, never kept asleep
        policy = tuple(dataclasses.replace(p, carry_over=False) for p in allocation.layout.policy)
        allocation.layout = dataclasses.replace(allocation.layout, policy=policy)
    if not gpus:
        allocation.lines.append(
            "servers: on the CPU (one policy server" + (" and the loss server)" if beside else ")")
        )
        return
    check_overlap(recipe, allocation.layout, allocation)
    if size is None:
        allocation.notes.append(
            f"the size of {recipe.initial_model_path} is unknown: the servers' memory is not checked"
        )
    for i, placement in enumerate(allocation.layout.policy):
        claim_server(
            allocation, recipe, f"policy replica {i}", placement, policy_need(recipe, size, hardware, placement)
        )
    if allocation.layout.loss is not None:
        allocation.lines.append(
            f"loss model: {_describe_size(loss_size)}" if loss_size else "loss model: size unknown"
        )
        name = "loss server" if allocation.layout.loss_resident else "search loss server"
        claim_server(allocation, recipe, name, allocation.layout.loss, loss_need)
    check_generation_totals(allocation)


def policy_need(recipe: Recipe, size: ModelSize | None, hardware: Hardware, placement: Placement) -> ServerNeed | None:
    """What one policy replica needs on each of its GPUs (None: the model's size is unknown)."""
    if size is None:
        return None
    dtype = memory.served_dtype_bytes(recipe.vllm_extra_args)
    kv = memory.policy_kv_min_bytes(size, recipe, dtype)
    args = vllm_memory.policy_args(recipe.max_model_len, size, hardware.gpu_gib, recipe.vllm_extra_args)
    return vllm_memory.server_need(size, kv, len(placement.gpus), dtype, args)


def allocate_node_servers(
    recipe: Recipe, hardware: Hardware, size: ModelSize | None, allocation: HardwareAllocation, hosts: list[str]
) -> None:
    """Every training node after the first serves the policy too (``optima.serving.node_servers``): node 0's
    replicas without the loss server's share, each claimed on its node's GPUs (sleeping, or stopped, for training)."""
    if len(hosts) < 2 or allocation.layout is None or recipe.endpoints:
        return
    policy = tuple(Placement(gpus=p.gpus, carry_over=p.carry_over) for p in allocation.layout.policy)
    nodes = tuple(NodeServers(rank, host, policy) for rank, host in enumerate(hosts) if rank)
    allocation.layout = dataclasses.replace(allocation.layout, nodes=nodes)
    if recipe.train_launcher == "srun":  # bound to each node's name (ssh tunnels to the node's loopback)
        problem = bind_problem(recipe, "each Slurm node's name", policy[0].carry_over and not recipe.private_hosts)
        if problem:
            allocation.problems.append(f"the servers of nodes 1-{len(nodes)}: {problem}")
    for node in nodes:
        if not hardware.has_gpu:
            allocation.lines.append(
                f"node {node.rank} ({node.host or 'Slurm'}): one CPU policy server, pooled with node 0"
            )
            continue
        for i, placement in enumerate(policy):
            need = policy_need(recipe, size, hardware, placement)
            claim_server(allocation, recipe, f"node {node.rank} policy replica {i}", placement, need, node.rank)


def check_generation_totals(allocation: HardwareAllocation) -> None:
    """The servers' shares on one GPU must fit in it (vLLM takes its whole share at start-up)."""
    total = allocation.hardware.gpu_gib * GIB
    for (node, gpu), claims in sorted(allocation.claims.items()):
        held = phase_total(claims, "generation")
        if held > total:
            allocation.problems.append(
                f"GPU {gpu} of node {node}: the servers' shares add up to {gib(held)} GiB of "
                f"{allocation.hardware.gpu_gib:g} GiB ({describe_claims([c for c in claims if c.generation])}): lower "
                "gpu_memory_utilization or loss_gpu_memory_utilization, or move loss_devices"
            )


def check_overlap(recipe: Recipe, layout: ServerLayout, allocation: HardwareAllocation) -> None:
    """``loss_devices`` on GPUs of the policy replicas: both servers would take their full share of one GPU."""
    if layout.loss is None or recipe.loss_devices is None:
        return
    policy = {g for p in layout.policy for g in p.gpus}
    shared = sorted(set(layout.loss.gpus) & policy)
    if shared:
        allocation.problems.append(
            f"loss_devices {recipe.loss_devices} overlap the policy's GPUs on GPU {shared[0]}: name GPUs outside "
            "devices, or leave loss_devices null to share the first policy GPU by memory share"
        )


def claim_server(
    allocation: HardwareAllocation,
    recipe: Recipe,
    name: str,
    placement: Placement,
    need: ServerNeed | None,
    node: int = 0,
) -> None:
    """Claim a server's share on each of its GPUs (of ``node``); a share below its need is a problem (with the share
    that fits)."""
    share = placement.gpu_memory_utilization or recipe.gpu_memory_utilization
    budget = int(share * allocation.hardware.gpu_gib * GIB)
    tp = len(placement.gpus)
    resident = name == "loss server"  # it serves the whole run, training included
    sleeps = placement.carry_over
    after = "stays up through training" if resident else "sleeps during training" if sleeps else "stops for training"
    if name == "search loss server":
        after = "started with each tree search and stopped after it (never beside the trainer)"
    text = (
        f"{name}: GPUs {','.join(placement.gpus)} (tensor parallel {tp}), share {share} = {gib(budget)} GiB, {after}"
    )
    if need is not None:
        text += f"; needs ~{gib(need.total)} GiB per GPU: {need.describe()}"
    allocation.lines.append(text)
    for gpu in placement.gpus:
        allocation.claim(node, gpu, Claim(name, budget, training=resident))
        if sleeps:
            allocation.claim(
                node, gpu, Claim(f"{name} asleep", memory.SLEEPING_SERVER, generation=False, training=True)
            )
    if need is not None and need.total > budget:
        allocation.problems.append(_share_problem(name, placement, need, share, allocation.hardware.gpu_gib))


def _share_problem(name: str, placement: Placement, need: ServerNeed, share: float, gpu_gib: float) -> str:
    """``loss server: needs ~20.5 GiB per GPU (weights 15.0 + KV 2.0 + ...); 0.1 x 80 GiB = 8.0 GiB on GPU 0: set
    loss_gpu_memory_utilization >= 0.26 or loss_devices: [a GPU outside devices]``."""
    wanted = loss_share_for(need.total, gpu_gib)
    if wanted > 1:
        fix = "it does not fit on one GPU: use tensor_parallel_size > 1 (policy) or GPUs with more memory"
    elif name.endswith("loss server"):
        fix = f"set loss_gpu_memory_utilization >= {wanted:.2f} or loss_devices: [a GPU outside devices]"
    else:
        fix = (
            f"raise this replica's share to >= {wanted:.2f} (gpu_memory_utilization, minus the loss server's share "
            "on the GPU it shares), or use tensor_parallel_size > 1, or more GPU memory"
        )
    return (
        f"{name}: needs ~{gib(need.total)} GiB per GPU ({need.describe()}); {share} x {gpu_gib:g} GiB = "
        f"{round(share * gpu_gib, 1)} GiB on GPU {placement.gpus[0]}: {fix}"
    )
