"""The three training methods, once: each one's name, label, recipe class, the parts of an iteration and the trainer
each part runs (docs/method.md#isft, #idpo, #isft-dpo).

Every place that tells the methods or their trainers apart reads this table, and no other file spells a method's
name (``tests/test_methods.py``): the recipes (``method``), the validation of ``trainer_overrides``
(``optima.config.rules``), the trainer YAML of each trainer (the same module), the hardware allocation's
trainer YAMLs (``optima.hardware``), the stage table (``optima.plan``: each part runs the stages of its
trainer), the run folders (``optima.paths``), the run report's method line and ``recipe-keys`` (``optima.__main__``).

iSFT and iDPO run one part per iteration, in the iteration's own folder; iSFT-DPO runs an iSFT part and then a
DPO part from its checkpoint, each in its own subfolder (``iteration_<i>/sft``, ``iteration_<i>/dpo``). The two
trainers carry the names of the methods that run them alone: ``sft`` (TRL's ``SFTTrainer``) and ``dpo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SFT = "sft"
DPO = "dpo"
SFT_DPO = "sft_dpo"
# A trainer: what a train stage runs, and the name of its sub-mapping in ``trainer_overrides``.
TrainerKind = Literal["sft", "dpo"]
TRAINERS: tuple[TrainerKind, ...] = (SFT, DPO)
# The recipe field holding each trainer's handbook-style base YAML.
TRAINER_YAML_FIELDS = {SFT: "origin_yaml_path", DPO: "origin_dpo_yaml_path"}


@dataclass(frozen=True)
class Method:
    """One training method.

    Args:
        name: As recipes and the command line spell it (``sft_dpo``).
        label: As the paper and the reports write it (``iSFT-DPO``).
        recipe: Its recipe class in ``optima.config``.
        parts: The parts of one iteration, in order, each as ``(subfolder, trainer)``; subfolder ``None``: the
            iteration's own folder.
    """

    name: str
    label: str
    recipe: str
    parts: tuple[tuple[str | None, TrainerKind], ...]

    @property
    def trainers(self) -> tuple[TrainerKind, ...]:
        """The trainers one iteration runs, in order."""
        return tuple(trainer for _, trainer in self.parts)


METHODS = {
    method.name: method
    for method in (
        Method(SFT, "iSFT", "SFTRecipe", ((None, SFT),)),
        Method(DPO, "iDPO", "DPORecipe", ((None, DPO),)),
        Method(SFT_DPO, "iSFT-DPO", "SFTDPORecipe", ((SFT, SFT), (DPO, DPO))),
    )
}
# The folders of an iteration's parts: "" for the iteration's own folder, then every subfolder, in run order.
PART_FOLDERS = ("", *dict.fromkeys(part for method in METHODS.values() for part, _ in method.parts if part))


def runs(method: str, trainer: TrainerKind) -> bool:
    """Whether an iteration of ``method`` runs ``trainer`` (False for an evaluation recipe)."""
    return method in METHODS and trainer in METHODS[method].trainers


def method_of_trainers(trainers: set[str]) -> Method | None:
    """The method whose iterations run exactly these trainers (a finished run's report rows), None for another set."""
    return next((m for m in METHODS.values() if set(m.trainers) == trainers), None)
