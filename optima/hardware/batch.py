"""The global batch of each trainer: the released recipe's, kept whatever the number of training processes (pure).

A trainer's global batch is ``per_device_train_batch_size x gradient_accumulation_steps x processes`` (processes
in all nodes). The released recipes were run with the accelerate config's processes (``num_processes x
num_machines``: 8 GPUs for the shipped Llama configs), so their global batch is the trainer YAML's two values x 8:
SFT 1 x 2 x 8 = 16, DPO 1 x 8 x 8 = 64 (arc), at learning rates tuned for them. The allocation trains on other counts
(7 GPUs beside the loss server, 14 on two nodes), so it keeps the released batch:

* ``gradient_accumulation_steps = released / (per_device x processes)`` when that divides;
* else the largest process count per node (at most the free GPUs) for which it divides for every trainer of the
  recipe: 4 of 7 free GPUs for 16 and 64 (a note says why, and how to train on all: ``loss_placement: after``
  frees GPU 0, or ``gradient_accumulation_steps`` in ``trainer_overrides``);
* else a refusal naming the batch, the per-device size and the nodes.

``gradient_accumulation_steps`` set in ``trainer_overrides`` is the user's choice: nothing is adjusted, and the
allocation prints the global batch it gives beside the released one. CPU training (the demo recipes) is reported, never
adjusted: its recipes are this project's own, not released ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from optima.config.rules import trainer_overrides_for
from optima.methods import DPO, SFT

if TYPE_CHECKING:
    from optima.config import LoopRecipe

ACCUMULATION = "gradient_accumulation_steps"
PER_DEVICE = "per_device_train_batch_size"


@dataclass(frozen=True)
class TrainerBatch:
    """One trainer's batch: its YAML's values (with ``trainer_overrides``) and the released global batch.

    Args:
        kind: ``sft`` or ``dpo``.
        per_device: ``per_device_train_batch_size``.
        accumulation: ``gradient_accumulation_steps`` (the YAML's, or the user's override).
        released: The released global batch (the base YAML's two values x the accelerate config's processes).
        user_accumulation: ``gradient_accumulation_steps`` came from ``trainer_overrides``.
    """

    kind: str
    per_device: int
    accumulation: int
    released: int
    user_accumulation: bool

    def fits(self, processes: int) -> bool:
        """Whether ``processes`` keep the released batch (always, when the user set the accumulation)."""
        return self.user_accumulation or self.released % (self.per_device * processes) == 0

    def accumulation_for(self, processes: int) -> int:
        return self.accumulation if self.user_accumulation else self.released // (self.per_device * processes)

    def describe(self, processes: int, nodes: int) -> str:
        """``sft global batch 16 = 1 per device x 4 accumulation x 4 processes (4 per node x 1 node); released
        16``."""
        steps = self.accumulation_for(processes)
        value = self.per_device * steps * processes
        text = (
            f"{self.kind} global batch {value} = {self.per_device} per device x {steps} accumulation x {processes} "
            f"processes ({processes // nodes} per node x {nodes} node(s)); released {self.released}"
        )
        if value != self.released:
            text += " (gradient_accumulation_steps set in trainer_overrides)" if self.user_accumulation else ""
        return text


def trainer_batches(recipe: LoopRecipe, yamls: list[dict], released_processes: int) -> list[TrainerBatch]:
    """The batch of each trainer YAML of the recipe (``optima.hardware.allocation.trainer_yamls``)."""
    batches = []
    for yaml in yamls:
        kind = DPO if yaml.get("_dpo") else SFT
        user = trainer_overrides_for(recipe, kind)
        base_b, base_a = int(yaml.get(PER_DEVICE, 8)), int(yaml.get(ACCUMULATION, 1))
        batches.append(
            TrainerBatch(
                kind,
                int(user.get(PER_DEVICE, base_b)),
                int(user.get(ACCUMULATION, base_a)),
                base_b * base_a * released_processes,
                ACCUMULATION in user,
            )
        )
    return batches


def processes_per_node(batches: list[TrainerBatch], free_per_node: int, nodes: int) -> int:
    """The most processes per node (at most ``free_per_node``) that keep every trainer's released batch; 0: none."""
    return next((p for p in range(free_per_node, 0, -1) if all(b.fits(p * nodes) for b in batches)), 0)


def accumulation_overrides(batches: list[TrainerBatch], processes: int) -> dict[str, int]:
    """``kind -> gradient_accumulation_steps`` the allocation sets (only where it differs from the trainer's YAML)."""
    return {
        b.kind: b.accumulation_for(processes)
        for b in batches
        if not b.user_accumulation and b.accumulation_for(processes) != b.accumulation
    }


def keep_global_batch(batches: list[TrainerBatch], free_per_node: int, nodes: int, allocation) -> int:
    """The processes per node that keep the released batches (``allocation.accumulation`` set, a note when fewer than
    ``free_per_node`` train); 0 with a problem when none can."""
    per_node = processes_per_node(batches, free_per_node, nodes)
    if per_node == 0:
        wanted = ", ".join(f"{b.kind} {b.released} ({b.per_device} per device)" for b in batches)
        allocation.problems.append(
            f"training: the released global batch ({wanted}) cannot be split evenly over {nodes} node(s) with "
            f"at most {free_per_node} process(es) each: change the nodes or GPUs, or set "
            f"{ACCUMULATION} (and {PER_DEVICE}) in trainer_overrides to choose another global batch"
        )
        return 0
    if per_node < free_per_node:
        allocation.idle_for_batch = free_per_node - per_node
        allocation.notes.append(
            f"{per_node} of the {free_per_node} free GPUs per node train, so that the released global batch "
            f"({', '.join(str(b.released) for b in batches)}) is kept: it is not a multiple of "
            f"{free_per_node * nodes} processes. To train on more, free a GPU (loss_placement: after, or "
            f"loss_devices) or set {ACCUMULATION} in trainer_overrides (another global batch)"
        )
    allocation.accumulation = accumulation_overrides(batches, per_node * nodes)
    return per_node
