"""The training part of the hardware allocation: which GPUs of which nodes train, how many processes, at what peak.

Training runs on the GPUs that no resident server holds (the loss server stays up for the whole run; a sleeping
policy replica only keeps its CUDA context), the same number on every node (torchrun's rule), and ``num_processes``
is what the allocation says (the shipped accelerate configs' 8 never applies). The nodes are the recipe's
``train_hosts`` (or ``train_hostfile``), started by ``train_launcher``; with ``train_launcher: srun`` and no hosts,
the nodes of the Slurm allocation (as many as the hardware has). Hardware with more nodes than the recipe names
trains on node 0 only (a note says so).

On a CPU the trainer shares the machine's memory with a policy server kept through training:
``cpu_trainer_peak_bytes`` estimates the trainer's peak for rows of a given length (at start, before any row
exists, for the estimate the policy's KV cache leaves room for), and ``rows_trainer_peak`` for a train stage's real
rows (its longest row, tokenised in the driver), which the server holder compares with the memory available before
training.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optima.config import LOOPBACK_HOSTS
from optima.hardware import memory
from optima.hardware.accelerate import read_accelerate_config, resolve_accelerate_config, strategy_of
from optima.hardware.batch import keep_global_batch, trainer_batches
from optima.hardware.claims import Claim, phase_total
from optima.hardware.memory import ModelSize, TrainerShape, gib
from optima.hardware.placement import NodeRanks, TrainingPlacement
from optima.hardware.spec import Hardware
from optima.methods import DPO, METHODS, TRAINER_YAML_FIELDS

if TYPE_CHECKING:
    from optima.config import LoopRecipe, Recipe


def read_hosts(recipe: LoopRecipe) -> list[str]:
    """``train_hosts``, or the first word of each line of ``train_hostfile`` (``host slots=8`` as DeepSpeed/MPI)."""
    if recipe.train_hostfile:
        lines = Path(recipe.train_hostfile).read_text().splitlines() if Path(recipe.train_hostfile).is_file() else []
        return [ln.split()[0] for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return list(recipe.train_hosts)


def _read_yaml(path: str | None) -> dict:
    import yaml

    if not path or not Path(path).is_file():
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    return data if isinstance(data, dict) else {}


def trainer_yamls(recipe: Recipe) -> list[dict]:
    """The base trainer YAMLs of the recipe's training stages (none for an evaluation recipe)."""
    trainers = METHODS[recipe.method].trainers if recipe.method in METHODS else ()
    return [_read_yaml(getattr(recipe, TRAINER_YAML_FIELDS[t])) | {"_dpo": t == DPO} for t in trainers]


def policy_size(recipe: Recipe, yamls: list[dict]) -> ModelSize | None:
    """The served model's size: the initial model, else (a checkpoint not written yet) the trainer's base model."""
    base = [y.get("model_name_or_path") for y in yamls]
    evaluated = [recipe.model_root_path] if hasattr(recipe, "model_root_path") else []  # evaluation recipes
    return memory.model_size(recipe.initial_model_path, *evaluated, *base, recipe.tokenizer_first_path)


def trainer_shape(strategy: str, processes: int, yaml: dict, mixed_precision: bool = False) -> TrainerShape:
    """The estimate's inputs from a trainer YAML (and the accelerate config's ``mixed_precision``)."""
    dtype = memory.dtype_bytes(str(yaml.get("dtype") or yaml.get("torch_dtype") or "float32"), 4)
    checkpointing = bool(yaml.get("activation_checkpointing", yaml.get("gradient_checkpointing", True)))
    return TrainerShape(
        strategy,
        processes,
        dtype,
        int(yaml.get("per_device_train_batch_size", 8)),
        int(yaml.get("max_length") or 1024),
        checkpointing,
        dpo=bool(yaml.get("_dpo")),
        lora_rank=int(yaml.get("lora_r", 16)) if yaml.get("use_peft") else 0,
        precomputed_reference=bool(yaml.get("precompute_ref_log_probs")),
        mixed_precision=mixed_precision,
    )


def cpu_trainer_peak_bytes(recipe: LoopRecipe, row_tokens: int | None = None, yamls: list[dict] | None = None) -> int:
    """The trainer's estimated peak on a CPU: what a policy server kept through training must leave free.

    One process per ``num_processes``; ``trainer_peak_bytes`` of its largest stage; 0 for an evaluation recipe or a
    model of unknown size.

    Args:
        recipe: The run's recipe (its trainer YAMLs, its model).
        row_tokens: The longest row, capped at each YAML's ``max_length`` (None: ``max_length``, the worst case).
        yamls: The trainer YAMLs (default: the recipe's base YAMLs, ``trainer_yamls``).
    """
    yamls = trainer_yamls(recipe) if yamls is None else yamls
    size = policy_size(recipe, yamls) if yamls else None
    if size is None:
        return 0
    processes = recipe.num_processes or 1
    shapes = [trainer_shape("cpu", processes, y) for y in yamls]
    if row_tokens is not None:
        shapes = [replace(s, seq=max(1, min(s.seq, row_tokens))) for s in shapes]
    return max(memory.trainer_peak_bytes(size, s) for s in shapes)


# Kept free beyond the trainer's estimated peak when it trains beside a kept policy: the driver and the idle servers
# may still grow a little meanwhile (the estimate itself is an upper bound, memory.CPU_TRAINER_OVERHEAD).
TRAINER_MARGIN_BYTES = memory.GIB
LONGEST_ROWS = 32  # rows tokenised to find the longest: the longest in characters


@dataclass(frozen=True)
class TrainerPeak:
    """The trainer's estimated peak on a train stage's real rows (``rows_trainer_peak``).

    Args:
        peak_bytes: ``trainer_peak_bytes`` at the longest row.
        row_tokens: Tokens of the longest row (at most the trainer's ``max_length``).
    """

    peak_bytes: int
    row_tokens: int

    def fits(self, available_bytes: int) -> bool:
        """Whether the trainer fits in ``available_bytes`` with ``TRAINER_MARGIN_BYTES`` to spare."""
        return self.peak_bytes + TRAINER_MARGIN_BYTES <= available_bytes


def row_messages(row: dict[str, Any]) -> list[dict]:
    """The chat a saved training row trains on: an SFT row's ``messages``; a DPO row's ``prompt`` and the longer of
    its two completions."""
    if "messages" in row:
        return list(row["messages"])
    longer = max(row["chosen"], row["rejected"], key=lambda turns: sum(len(m["content"]) for m in turns))
    return [*row["prompt"], *longer]


def longest_row_tokens(dataset: Path, tokenizer, limit: int) -> int:
    """Tokens of the longest row of a saved training set (its ``train`` split) rendered with the chat template, at
    most ``limit`` (the trainer's ``max_length``); 0 for an empty set.

    Only the ``LONGEST_ROWS`` rows longest in characters are tokenised: a few dozen rows take a fraction of a second.
    """
    from datasets import load_from_disk

    splits = load_from_disk(str(dataset))
    chats = [row_messages(row) for row in splits["train"]] if "train" in splits else []
    chats.sort(key=lambda chat: sum(len(m["content"]) for m in chat), reverse=True)
    texts = [tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats[:LONGEST_ROWS]]
    counts = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    return min(limit, max(counts, default=0))


def rows_trainer_peak(recipe: LoopRecipe, config: dict, dpo: bool, dataset: Path, tokenizer) -> TrainerPeak:
    """The trainer's estimated peak on a train stage's real rows (``cpu_trainer_peak_bytes`` at its longest row).

    Args:
        recipe: The run's recipe.
        config: The stage's rendered trainer YAML (batch size, ``max_length``, dtype, its model).
        dpo: A DPO stage (chosen and rejected in one batch, a reference model).
        dataset: The stage's saved training set.
        tokenizer: The run's tokenizer (its chat template renders the rows as the trainer does).
    """
    tokens = longest_row_tokens(dataset, tokenizer, int(config.get("max_length") or 1024))
    return TrainerPeak(cpu_trainer_peak_bytes(recipe, tokens, [config | {"_dpo": dpo}]), tokens)


def training_hosts(recipe: LoopRecipe, hardware: Hardware) -> list[str]:
    """The hosts the recipe names for its training nodes (``""``: a Slurm node found at run time); [] for none."""
    hosts = read_hosts(recipe)
    if hosts:
        return hosts
    return [""] * hardware.nodes if recipe.train_launcher == "srun" and hardware.nodes > 1 else []


def node_hosts(recipe: LoopRecipe, hardware: Hardware, allocation) -> list[str]:
    """The hosts of the training nodes (``""``: a Slurm node found at run time); one entry per node."""
    hosts = training_hosts(recipe, hardware)
    if hosts:
        return hosts
    if hardware.nodes > 1:
        allocation.notes.append(
            f"the hardware has {hardware.nodes} nodes but the recipe names none (train_hosts, train_hostfile, or "
            "train_launcher: srun inside a Slurm allocation): training and serving use node 0 only"
        )
    return ["localhost"]


def check_loopback_hosts(hosts: list[str], allocation) -> None:
    """Several nodes named beside a loopback one (``[localhost, node2]``): node 2 would wait for the rendezvous on
    its own loopback. All on the loopback is one machine's rehearsal (allowed). Names that only resolve to a
    loopback address are found at start (``optima.training.hosts``)."""
    loopback = [h for h in hosts if h.rsplit("@", 1)[-1] in LOOPBACK_HOSTS or h.rsplit("@", 1)[-1].startswith("127.")]
    if len(hosts) > 1 and loopback and len(loopback) < len(hosts):
        allocation.problems.append(
            f"train_hosts: {loopback[0]!r} is a loopback name beside other nodes ({', '.join(hosts)}): they would "
            "wait for the rendezvous on their own loopback; name every node by a host or address the others reach"
        )


def allocate_training(
    recipe: LoopRecipe, hardware: Hardware, size: ModelSize | None, yamls: list[dict], allocation
) -> None:
    """Place the training processes and claim their peak on each GPU (see the module docstring)."""
    config = read_accelerate_config(resolve_accelerate_config(recipe.accelerate_config, hardware.has_gpu))
    strategy = strategy_of(config)
    released = int(config.get("num_processes") or 1) * int(config.get("num_machines") or 1)
    batches = trainer_batches(recipe, yamls, released)
    hosts = node_hosts(recipe, hardware, allocation)
    check_loopback_hosts(hosts, allocation)
    launcher = "local" if len(hosts) == 1 else recipe.train_launcher
    port, exe, forward = recipe.main_process_port, recipe.train_launcher_executable, recipe.train_forward_env or ()
    if strategy == "cpu" or not hardware.has_gpu:
        per_node = max(1, (recipe.num_processes or 1) // len(hosts))
        nodes = tuple(NodeRanks(h, r) for r, h in enumerate(hosts))
        allocation.training = TrainingPlacement(nodes, per_node, launcher, exe, port, tuple(forward))
        allocation.lines.append(
            f"training: {strategy}, {allocation.training.num_processes} CPU process(es) on {len(hosts)} node(s)"
        )
        # The batches are reported only (CPU training keeps the YAML's).
        allocation.lines += [b.describe(allocation.training.num_processes, len(hosts)) for b in batches]
        return
    resident = {gpu for (node, gpu), claims in allocation.claims.items() if node == 0 and _resident(claims)}
    free = [[g for g in hardware.gpu_ids if g not in resident]] + [list(hardware.gpu_ids)] * (len(hosts) - 1)
    per_node = min(len(f) for f in free)
    if recipe.num_processes is not None:
        per_node = min(per_node, max(1, recipe.num_processes // len(hosts)))
    if strategy == "single":
        per_node = min(per_node, 1)
        if len(hosts) > 1:
            allocation.problems.append(
                f"training: accelerate_config {recipe.accelerate_config} (distributed_type NO) runs one process on "
                f"one node (accelerate's simple launcher ignores --num_processes and --num_machines), so each of the "
                f"{len(hosts)} nodes would train alone into one folder: use multi_gpu, fsdp or deepspeed_zero3 for "
                "several nodes, or name one host"
            )
    if per_node:
        per_node = keep_global_batch(batches, per_node, len(hosts), allocation)
        if not per_node:
            return
    if per_node == 0:
        holders = ", ".join(sorted(resident))
        allocation.problems.append(
            f"training: no GPU of node 0 is free of a server that stays up through training (GPU {holders}: loss "
            "server): set loss_placement: after (the loss model is then served after generation and stopped "
            "before training), or loss_devices on a GPU outside devices with more GPUs"
        )
        return
    nodes = tuple(NodeRanks(h, r, tuple(free[r][:per_node])) for r, h in enumerate(hosts))
    allocation.training = TrainingPlacement(nodes, per_node, launcher, exe, port, tuple(forward))
    mixed = str(config.get("mixed_precision") or "no") != "no"
    shapes = [trainer_shape(strategy, allocation.training.num_processes, y, mixed) for y in yamls]
    peak = max(memory.trainer_peak_bytes(size, s) for s in shapes) if size else 0
    where = "; ".join(f"node {n.machine_rank} ({n.host or 'Slurm'}) GPUs {','.join(n.gpus)}" for n in nodes)
    allocation.lines.append(
        f"training: {strategy}{' + LoRA' if any(s.lora_rank for s in shapes) else ''}, "
        f"{allocation.training.num_processes} process(es) ({per_node} per node, launcher {launcher}): {where}; "
        f"peak ~{gib(peak)} GiB per GPU"
    )
    allocation.lines += [b.describe(allocation.training.num_processes, len(hosts)) for b in batches]
    claim_training(allocation, nodes, peak, strategy, any(s.lora_rank for s in shapes))


def _resident(claims) -> bool:
    return any(c.resident for c in claims)


def claim_training(allocation, nodes, peak: int, strategy: str, lora: bool = False) -> None:
    """Claim the trainer's peak on its GPUs; a GPU over its memory in the training phase is a problem."""
    total = int(allocation.hardware.gpu_gib * memory.GIB)
    over = []
    for node in nodes:
        for gpu in node.gpus:
            allocation.claim(
                node.machine_rank, gpu, Claim(f"trainer ({strategy})", peak, generation=False, training=True)
            )
            held = phase_total(allocation.claims[(node.machine_rank, gpu)], "training")
            if held > total:
                over.append((node.machine_rank, gpu, held))
    if over:  # one problem for the training (the worst GPU), however many GPUs are over
        rank, gpu, held = max(over, key=lambda item: item[2])
        allocation.problems.append(
            f"training: ~{gib(peak)} GiB per process ({strategy}, {allocation.training.num_processes} processes) "
            f"+ {gib(held - peak)} GiB of sleeping servers = {gib(held)} GiB on GPU {gpu} of node {rank}, which has "
            f"{allocation.hardware.gpu_gib:g} GiB: {training_fixes(strategy, lora, allocation.idle_for_batch)}"
        )


def training_fixes(strategy: str, lora: bool, idle_for_batch: int = 0) -> str:
    """The fixes of a trainer over its GPU's memory that apply to its strategy (none it already uses).

    ``idle_for_batch``: free GPUs per node the allocation left idle to keep the released global batch
    (``optima.hardware.batch``); a sharded trainer would fit on them with another global batch.
    """
    fixes = []
    if strategy in ("zero3", "fsdp") and idle_for_batch:
        fixes.append(
            f"free a GPU so that more processes keep the released global batch (loss_placement: after), or train "
            f"on the {idle_for_batch} idle GPU(s) per node too with gradient_accumulation_steps set in "
            "trainer_overrides (another global batch), or more nodes"
        )
    elif strategy in ("zero3", "fsdp"):
        fixes.append("train on more GPUs (or nodes): the states are sharded over the processes")
    else:
        fixes.append(f"shard the states with deepspeed_zero3 or fsdp ({strategy} keeps a full copy per process)")
    if not lora:
        fixes.append("LoRA (use_peft: true in the trainer YAML)")
    fixes.append("a smaller per_device_train_batch_size or max_length")
    return ", or ".join(fixes)
