"""The hardware allocation: where every process of a run runs, decided and checked before anything starts.

``allocate_hardware(recipe, hardware)`` places the policy replicas and the loss server (``placement``: GPUs and
memory shares, or CPU cores), the training processes (GPUs of each node, ``num_processes``) and keeps the released
global batch. What needs no memory model is refused here, in one message: GPUs that do not exist, replicas that do
not divide them, sleep mode's development routes on a public address, no GPU free for training, a batch that no
process count keeps. What only an engine knows, the engine checks (``memory``): each vLLM server its share at
start-up, the preflight the trainer's step. The machine: ``machine``. docs/gpu.md and docs/cpu.md describe it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from optima.config import LOOPBACK_HOSTS, RecipeError
from optima.config.rules import loss_model, trainer_overrides_for
from optima.hardware.machine import (
    Hardware,
    detect_hardware,
    read_accelerate_config,
    read_yaml,
    resolve_accelerate_config,
    strategy_of,
)
from optima.hardware.memory import ModelSize, loss_share, model_size, states_estimate
from optima.hardware.placement import (
    NodeRanks,
    NodeServers,
    Placement,
    ServerLayout,
    TrainingPlacement,
    bind_problem,
    carry_over_on,
    loss_server_wanted,
    place_servers,
    search_loss_server_wanted,
)
from optima.methods import DPO, METHODS, SFT, TRAINER_YAML_FIELDS

if TYPE_CHECKING:
    from optima.config import LoopRecipe, Recipe

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass
class HardwareAllocation:
    """Where a run's processes run on ``hardware``: the servers (``layout``; None: external endpoints), the
    training (None: an evaluation), the ``gradient_accumulation_steps`` per trainer that keep the released global
    batch (``accumulation``, where they differ from the YAML's), what ``render`` shows, and why it cannot run."""

    hardware: Hardware
    layout: ServerLayout | None = None
    training: TrainingPlacement | None = None
    accumulation: dict[str, int] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    estimate: tuple | None = None  # ``states_estimate``'s arguments: computed by ``render`` only (it imports torch)

    def check(self) -> None:
        """Raise every problem, numbered, as one ``RecipeError`` (nothing has started yet)."""
        if len(self.problems) == 1:
            raise RecipeError("hardware allocation", self.problems[0])
        if self.problems:
            listed = " ".join(f"({i}) {problem}" for i, problem in enumerate(self.problems, 1))
            raise RecipeError("hardware allocation", f"{len(self.problems)} problems: {listed}")

    def render(self) -> list[str]:
        """What ``--dry-run`` prints of it, ending with what it leaves to the engines."""
        lines = [*self.lines, *([states_estimate(*self.estimate)] if self.estimate else [])]
        engines = ["vLLM checks each server's memory at start-up (it refuses in seconds, with its reason)"]
        if self.training is not None:
            engines.append(
                "the preflight (the trainer's one step at the longest sequence, before the first "
                "generation) checks the trainer's"
            )
        out = [f"  hardware: {self.hardware.describe()}", *(f"      {line}" for line in lines)]
        out += [f"      note: {note}" for note in self.notes] + ["      left to the engines: " + "; ".join(engines)]
        return out + ([f"      REFUSED: {problem}" for problem in self.problems] or ["      plan: feasible"])


def allocate_this_machine(recipe: Recipe, hardware: Hardware | None = None, *, training: bool = True):
    """``allocate_hardware`` on ``hardware`` (``--hardware``), else the detected machine, and this process's cores."""
    cpus = sorted(os.sched_getaffinity(0))
    return allocate_hardware(recipe, hardware or detect_hardware(), cpus, training=training)


def allocate_hardware(
    recipe: Recipe, hardware: Hardware, cpus: list[int] | None = None, *, training: bool = True
) -> HardwareAllocation:
    """The allocation of ``recipe`` on ``hardware`` (pure but for reading model folders and trainer YAMLs);
    ``training=False``: the servers alone (gpu-check's server checks train nothing)."""
    allocation = HardwareAllocation(hardware)
    if hardware.has_gpu and hardware.gpu_gib <= 0:
        allocation.problems.append(
            f"{hardware.gpus_per_node} GPU(s) visible ({','.join(hardware.gpu_ids)}) but their memory is unknown "
            f"({hardware.source}: nvidia-smi gave no memory.total): name the machine with --hardware, e.g. "
            f"--hardware {hardware.gpus_per_node}x80GB for 80 GB cards"
        )
        return allocation
    yamls = trainer_yamls(recipe)
    if yamls and not recipe.endpoints and carry_over_on(recipe):  # evaluation serves each model once
        host = recipe.host
        if host not in LOOPBACK_HOSTS and (host not in recipe.private_hosts or host in WILDCARD_HOSTS):
            allocation.problems.append(
                f"host {host!r}: sleep_mode opens vLLM's reload routes (VLLM_SERVER_DEV_MODE), which its API key "
                "does not guard; bind to 127.0.0.1 or to a private interface listed in private_hosts (never a "
                "wildcard), or set sleep_mode: false"
            )
    evaluated = [recipe.model_root_path] if hasattr(recipe, "model_root_path") else []  # evaluation recipes
    base = [y.get("model_name_or_path") for y in yamls]
    size = model_size(recipe.initial_model_path, *evaluated, *base, recipe.tokenizer_first_path)
    allocation.lines += [f"policy model: {size.describe()}"] if size is not None else []
    if recipe.endpoints:
        allocation.lines.append(f"servers: external endpoints {', '.join(recipe.endpoints)} (nothing launched here)")
    else:
        allocate_servers(recipe, hardware, allocation, cpus or [0])
    if yamls and training:
        hosts = [""] * hardware.nodes if recipe.train_launcher == "srun" else []  # "": a Slurm node
        if len(hosts) < 2 and hardware.nodes > 1:
            allocation.notes.append(
                f"the hardware has {hardware.nodes} nodes but the recipe trains on one (train_launcher: srun inside "
                "a Slurm allocation trains on all): training and serving use node 0 only"
            )
        allocate_node_servers(recipe, hardware, allocation, hosts)
        allocate_training(recipe, hardware, size, yamls, allocation, hosts or ["localhost"])
    return allocation


def trainer_yamls(recipe: Recipe) -> list[dict]:
    """The base trainer YAMLs of the recipe's training stages, each with ``_dpo`` (none for an evaluation)."""
    trainers = METHODS[recipe.method].trainers if recipe.method in METHODS else ()
    return [read_yaml(getattr(recipe, TRAINER_YAML_FIELDS[t])) | {"_dpo": t == DPO} for t in trainers]


def allocate_servers(recipe: Recipe, hardware: Hardware, allocation: HardwareAllocation, cpus: list[int]) -> None:
    """Place the servers on node 0: the loss server's share by ``optima.memory.loss_share`` when the recipe leaves it
    null and shares the policy's first GPU."""
    gpus = list(hardware.gpu_ids) if hardware.has_gpu else []
    beside = loss_server_wanted(recipe) or bool(gpus and search_loss_server_wanted(recipe))
    share, loss_size = None, model_size(loss_model(recipe), recipe.tokenizer_first_path) if beside else None
    if beside and gpus and recipe.loss_devices is None and recipe.loss_gpu_memory_utilization is None:
        if loss_size is None:
            allocation.problems.append(
                f"loss server: the size of {loss_model(recipe)} is unknown (no local weights, not a known hub "
                "name): set loss_gpu_memory_utilization, or loss_devices"
            )
            return
        share = loss_share(recipe, loss_size, hardware.gpu_gib)
        if share >= recipe.gpu_memory_utilization:
            allocation.problems.append(
                f"loss server: its weights and one scoring batch of KV cache take a share of {share} of each "
                f"{hardware.gpu_gib:g} GiB GPU, which leaves nothing of gpu_memory_utilization="
                f"{recipe.gpu_memory_utilization} for the policy on the GPU they share: name loss_devices (GPUs "
                "outside devices), or use GPUs with more memory"
            )
            return
    try:
        layout = place_servers(recipe, gpus, cpus, loss_share=share)
    except RecipeError as exc:
        allocation.problems.append(str(exc))
        return
    if not hasattr(recipe, "accelerate_config"):  # evaluation: replicas started per model, never kept asleep
        layout = dataclasses.replace(
            layout, policy=tuple(dataclasses.replace(p, carry_over=False) for p in layout.policy)
        )
    allocation.layout = layout
    if not gpus:
        allocation.lines.append(f"servers: on the CPU (one policy server{' and the loss server' * beside})")
        return
    overlap = sorted(set(layout.loss.gpus) & {g for p in layout.policy for g in p.gpus}) if layout.loss else []
    if overlap and recipe.loss_devices is not None:
        allocation.problems.append(
            f"loss_devices {recipe.loss_devices} overlap the policy's GPUs on GPU {overlap[0]}: name GPUs outside "
            "devices, or leave loss_devices null to share the first policy GPU by memory share"
        )
    servers = [(f"policy replica {i}", p) for i, p in enumerate(layout.policy)]
    if layout.loss is not None:
        allocation.lines.append(f"loss model: {loss_size.describe()}" if loss_size else "loss model: size unknown")
        servers.append(("loss server" if layout.loss_resident else "search loss server", layout.loss))
    resident, search = "stays up through training", "started with each tree search, stopped after it"
    after = {"loss server": resident, "search loss server": search}
    for name, placement in servers:
        value = placement.gpu_memory_utilization or recipe.gpu_memory_utilization
        then = after.get(name, "sleeps during training" if placement.carry_over else "stops for training")
        rule = " (its weights + one scoring batch of KV cache)" if name in after and share else ""
        allocation.lines.append(
            f"{name}: GPUs {','.join(placement.gpus)} (tensor parallel {len(placement.gpus)}), "
            f"--gpu-memory-utilization {value} = {value * hardware.gpu_gib:.1f} GiB{rule}, {then}"
        )


def allocate_node_servers(recipe: Recipe, hardware: Hardware, allocation: HardwareAllocation, hosts: list[str]):
    """Every training node after the first serves the policy too (``optima.serving.node_servers``): node 0's
    replicas without the loss server's share, pooled with node 0's."""
    if len(hosts) < 2 or allocation.layout is None or recipe.endpoints:
        return
    policy = tuple(Placement(gpus=p.gpus, carry_over=p.carry_over) for p in allocation.layout.policy)
    nodes = tuple(NodeServers(rank, host, policy) for rank, host in enumerate(hosts) if rank)
    allocation.layout = dataclasses.replace(allocation.layout, nodes=nodes)
    if recipe.train_launcher == "srun":  # bound to each node's name (ssh tunnels to the node's loopback)
        problem = bind_problem(recipe, "each Slurm node's name", policy[0].carry_over and not recipe.private_hosts)
        allocation.problems += [f"the servers of nodes 1-{len(nodes)}: {problem}"] if problem else []
    where = "GPUs " + "; ".join(",".join(p.gpus) for p in policy) if hardware.has_gpu else "one CPU policy server"
    allocation.lines += [f"node {n.rank} ({n.host or 'Slurm'}): {where}, pooled with node 0" for n in nodes]


def allocate_training(
    recipe: LoopRecipe, hardware: Hardware, size: ModelSize | None, yamls: list[dict], allocation, hosts
):
    """Place the training processes: on the GPUs no resident server holds, as many per node as keep the released
    global batch (``keep_global_batch``; issue #40 trains on every GPU), the same on every node."""
    config = read_accelerate_config(resolve_accelerate_config(recipe.accelerate_config, hardware.has_gpu))
    strategy = strategy_of(config)
    batches = trainer_batches(
        recipe, yamls, int(config.get("num_processes") or 1) * int(config.get("num_machines") or 1)
    )
    launcher = "local" if len(hosts) == 1 else recipe.train_launcher
    extra = (launcher, recipe.main_process_port)
    if strategy == "cpu" or not hardware.has_gpu:
        per_node = max(1, (recipe.num_processes or 1) // len(hosts))
        allocation.training = TrainingPlacement(tuple(NodeRanks(h, r) for r, h in enumerate(hosts)), per_node, *extra)
        processes = allocation.training.num_processes
        allocation.lines.append(f"training: {strategy}, {processes} CPU process(es) on {len(hosts)} node(s)")
        allocation.lines += [describe_batch(b, processes, len(hosts)) for b in batches]  # CPU: the YAML's, reported
        return
    layout = allocation.layout
    resident = (
        set(layout.loss.gpus) if layout is not None and layout.loss is not None and layout.loss_resident else set()
    )
    free = [g for g in hardware.gpu_ids if g not in resident]  # node 0's; the other nodes train on the same ids
    per_node = len(free)
    per_node = min(per_node, max(1, recipe.num_processes // len(hosts))) if recipe.num_processes else per_node
    if strategy == "single":
        per_node = min(per_node, 1)
        if len(hosts) > 1:
            allocation.problems.append(
                f"training: accelerate_config {recipe.accelerate_config} (distributed_type NO) runs one process on "
                f"one node (accelerate's simple launcher ignores --num_processes and --num_machines), so each of the "
                f"{len(hosts)} nodes would train alone into one folder: use multi_gpu, fsdp or deepspeed_zero3 for "
                "several nodes, or train on one (train_launcher: local)"
            )
    if per_node == 0:
        allocation.problems.append(
            f"training: no GPU of node 0 is free of a server that stays up through training (GPU "
            f"{', '.join(sorted(resident))}: loss server): set loss_placement: after (the loss model is then served "
            "after generation and stopped before training), or loss_devices on a GPU outside devices with more GPUs"
        )
        return
    per_node = keep_global_batch(batches, per_node, len(hosts), allocation)
    if not per_node:
        return
    nodes = tuple(NodeRanks(h, r, tuple(free[:per_node])) for r, h in enumerate(hosts))  # one srun step: one --gpu_ids
    allocation.training = TrainingPlacement(nodes, per_node, *extra, hardware.gpus_per_node)
    where = "; ".join(f"node {n.machine_rank} ({n.host or 'Slurm'}) GPUs {','.join(n.gpus)}" for n in nodes)
    lora = " + LoRA" if any(y.get("use_peft") for y in yamls) else ""
    allocation.lines.append(
        f"training: {strategy}{lora}, {allocation.training.num_processes} process(es) ({per_node} per node, "
        f"launcher {launcher}): {where}"
    )
    allocation.lines += [describe_batch(b, allocation.training.num_processes, len(hosts)) for b in batches]
    if size is not None:
        allocation.estimate = (size, strategy, per_node, len(hosts), str(config.get("mixed_precision") or "no"))


@dataclass(frozen=True)
class TrainerBatch:
    """One trainer's batch: ``per_device`` x ``accumulation`` (the YAML's with ``trainer_overrides``), ``released``
    (the base YAML's two values x the accelerate config's processes: 8 for the shipped configs), and whether the
    user set the accumulation (then nothing is adjusted)."""

    kind: str
    per_device: int
    accumulation: int
    released: int
    user_accumulation: bool

    def fits(self, processes: int) -> bool:
        return self.user_accumulation or self.released % (self.per_device * processes) == 0

    def accumulation_for(self, processes: int) -> int:
        return self.accumulation if self.user_accumulation else self.released // (self.per_device * processes)


def trainer_batches(recipe: LoopRecipe, yamls: list[dict], released_processes: int) -> list[TrainerBatch]:
    """The batch of each trainer YAML of the recipe."""
    batches = []
    for yaml in yamls:
        kind = DPO if yaml.get("_dpo") else SFT
        user = trainer_overrides_for(recipe, kind)
        b, a = int(yaml.get("per_device_train_batch_size", 8)), int(yaml.get("gradient_accumulation_steps", 1))
        per_device = int(user.get("per_device_train_batch_size", b))
        steps = int(user.get("gradient_accumulation_steps", a))
        batches.append(
            TrainerBatch(kind, per_device, steps, b * a * released_processes, "gradient_accumulation_steps" in user)
        )
    return batches


def describe_batch(batch: TrainerBatch, processes: int, nodes: int) -> str:
    """``sft global batch 16 = 1 per device x 4 accumulation x 4 processes (4 per node x 1 node(s)); released 16``."""
    steps = batch.accumulation_for(processes)
    value = batch.per_device * steps * processes
    user = (
        " (gradient_accumulation_steps set in trainer_overrides)"
        if value != batch.released and batch.user_accumulation
        else ""
    )
    return (
        f"{batch.kind} global batch {value} = {batch.per_device} per device x {steps} accumulation x {processes} "
        f"processes ({processes // nodes} per node x {nodes} node(s)); released {batch.released}{user}"
    )


def processes_per_node(batches: list[TrainerBatch], free_per_node: int, nodes: int) -> int:
    """The most processes per node (at most ``free_per_node``) that keep every trainer's released batch; 0: none."""
    return next((p for p in range(free_per_node, 0, -1) if all(b.fits(p * nodes) for b in batches)), 0)


def keep_global_batch(batches: list[TrainerBatch], free_per_node: int, nodes: int, allocation) -> int:
    """The processes per node that keep the released batches (``allocation.accumulation`` set; a note when fewer than
    ``free_per_node`` train); 0 with a problem when none can."""
    per_node = processes_per_node(batches, free_per_node, nodes)
    if per_node == 0:
        wanted = ", ".join(f"{b.kind} {b.released} ({b.per_device} per device)" for b in batches)
        allocation.problems.append(
            f"training: the released global batch ({wanted}) cannot be split evenly over {nodes} node(s) with at "
            f"most {free_per_node} process(es) each: change the nodes or GPUs, or set gradient_accumulation_steps "
            "(and per_device_train_batch_size) in trainer_overrides to choose another global batch"
        )
        return 0
    if per_node < free_per_node:
        allocation.notes.append(
            f"{per_node} of the {free_per_node} free GPUs per node train, so that the released global batch "
            f"({', '.join(str(b.released) for b in batches)}) is kept: it is not a multiple of "
            f"{free_per_node * nodes} processes. To train on more, free a GPU (loss_placement: after, or "
            "loss_devices) or set gradient_accumulation_steps in trainer_overrides (another global batch)"
        )
    processes = per_node * nodes
    allocation.accumulation = {
        b.kind: b.accumulation_for(processes)
        for b in batches
        if not b.user_accumulation and b.accumulation_for(processes) != b.accumulation
    }
    return per_node
