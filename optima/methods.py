"""The three training methods and the stages of their iterations, once (docs/method.md#the-three-loops).

Every place that tells the methods, their trainers or their stages apart reads these tables; no other file spells a
method's name (``tests/test_methods.py``). iSFT and iDPO run one part per iteration, in the iteration's own folder;
iSFT-DPO runs an iSFT part, then a DPO part from its checkpoint, each in its own subfolder (``iteration_<i>/sft``,
``iteration_<i>/dpo``). A part runs the stages of its trainer; a recipe field names the stages its change redoes
(``field(redoes=...)``), so a tag that names no stage fails when the recipe class is defined. The stage names are
the strings earlier runs' manifests recorded, so those runs keep resuming.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

SFT = "sft"
DPO = "dpo"
SFT_DPO = "sft_dpo"
# A trainer: what a train stage runs, and the name of its sub-mapping in ``trainer_overrides``.
TrainerKind = Literal["sft", "dpo"]
TRAINERS: tuple[TrainerKind, ...] = (SFT, DPO)
# The recipe field holding each trainer's handbook-style base YAML.
TRAINER_YAML_FIELDS = {SFT: "origin_yaml_path", DPO: "origin_dpo_yaml_path"}


class Stage(str, Enum):  # noqa: UP042 - StrEnum needs 3.11 (see below)
    """A stage of iSFT (generate, score, select, train) or iDPO (probe, search, pairs, train).

    A ``str`` enum spelt as its value (``enum.StrEnum`` needs Python 3.11; ``make gpu-check`` imports this module
    with the system's python3 before it checks the version).
    """

    __str__ = str.__str__
    __format__ = str.__format__

    GENERATE = "generate"  # iSFT: sample conversations
    SCORE = "score"  # iSFT: reward them
    SELECT = "select"  # iSFT: keep the best as the training set
    PROBE = "probe"  # iDPO: sample conversations for the token budget T_max
    SEARCH = "search"  # iDPO: the tree search
    PAIRS = "pairs"  # iDPO: mine preference pairs from the trees
    TRAIN = "train"  # either: fine-tune into the checkpoint


# The stages of a part, in the order they run, by the part's trainer.
TRAINER_STAGES: dict[str, tuple[Stage, ...]] = {
    SFT: (Stage.GENERATE, Stage.SCORE, Stage.SELECT, Stage.TRAIN),
    DPO: (Stage.PROBE, Stage.SEARCH, Stage.PAIRS, Stage.TRAIN),
}


def stage_tags(tags: tuple[str, ...]) -> tuple[Stage, ...]:
    """``tags`` as ``Stage`` members; ValueError for a tag that names no stage."""
    known = [stage.value for stage in Stage]
    unknown = [tag for tag in tags if tag not in known]
    if unknown:
        raise ValueError(f"redoes: no stage named {', '.join(map(repr, unknown))}; the stages: {', '.join(known)}")
    return tuple(Stage(tag) for tag in tags)


@dataclass(frozen=True)
class Method:
    """One training method: its ``name`` (``sft_dpo``), ``label`` (``iSFT-DPO``), recipe class in ``optima.config``,
    and the parts of one iteration in order, each ``(subfolder, trainer)`` (``None``: the iteration's own folder)."""

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
