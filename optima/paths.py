"""Every file of a run, derived from the run directory, an iteration and a stage.

One run directory per recipe (`output_dir`, docs/method.md D3); nothing is written into the source tree, and no
other module builds run paths by hand::

    <output_dir>/
      recipe.yaml                     the validated recipe, every field
      logs/driver.log                 what the driver said
      vllm_cache/                     VLLM_CACHE_ROOT of the launched servers
      tensorboard/                    TensorBoard events (optima.tracking)
      set_aside/, iteration_<i>/set_aside/, checkpoints/set_aside/
                                      what a rerun under other settings made stale (optima.lineage)
      checkpoints/iteration_<i>/      the model after iteration i + 1 (folders count from 0; check_point_root_path
                                      overrides the root)
      iteration_<i>/[sft|dpo/]        one folder per iteration (two stages in iSFT-DPO)
        manifest.json                 started and finished stages, their keys, counts and timings
        generations.jsonl             raw conversations, one line per (question, sample)
        rewarded.jsonl                conversations with their reward parts
        probe.jsonl, rollouts.jsonl   (DPO stages)
        dataset/                      the training set (datasets.save_to_disk)
        selection.jsonl               what selection kept and why
        trainer.yaml                  the rendered TRL trainer recipe
        metrics.json                  per-iteration metrics
        logs/                         vllm_<replica>.log, train.log
      conversations.html              the conversation browser (`optima.browser`), beside report.md
      heldout/                        the held-out evaluation (heldout_size > 0): <model>.jsonl, summary.*
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from optima.identity import COMPLETE_MARKER
from optima.methods import PART_FOLDERS

logger = logging.getLogger(__name__)

PAGE = "conversations.html"  # the conversation browser's page, in a run or an evaluation folder
TENSORBOARD_DIR = "tensorboard"


class RunLocation(Protocol):
    """Where a loop's recipe puts its run (a protocol: this module sits below `optima.config`)."""

    output_dir: str | None
    check_point_root_path: str | None


@dataclass(frozen=True)
class StagePaths:
    """Files of one iteration's stage folder."""

    root: Path

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def generations(self) -> Path:
        return self.root / "generations.jsonl"

    @property
    def losses(self) -> Path:
        """LM losses scored while generating (`optima.lm_loss`)."""
        return self.root / "losses.jsonl"

    @property
    def rewarded(self) -> Path:
        return self.root / "rewarded.jsonl"

    @property
    def probe(self) -> Path:
        return self.root / "probe.jsonl"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts.jsonl"

    @property
    def dataset(self) -> Path:
        return self.root / "dataset"

    @property
    def selection_record(self) -> Path:
        return self.root / "selection.jsonl"

    @property
    def trainer_yaml(self) -> Path:
        return self.root / "trainer.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def server_log(self, replica: int) -> Path:
        return self.logs / f"vllm_{replica}.log"

    @property
    def train_log(self) -> Path:
        return self.logs / "train.log"


@dataclass(frozen=True)
class RunPaths:
    """The layout of one run directory.

    Args:
        output_dir: The run directory (absolute).
        checkpoint_root: Where checkpoints go; default `<output_dir>/checkpoints`.
    """

    output_dir: Path
    checkpoint_root: Path | None = None

    @classmethod
    def from_recipe(cls, recipe: RunLocation) -> RunPaths:
        """Paths of a validated recipe (`output_dir` and `check_point_root_path` are absolute there)."""
        root = Path(recipe.check_point_root_path) if recipe.check_point_root_path else None
        return cls(Path(recipe.output_dir), root)

    @property
    def recipe_file(self) -> Path:
        return self.output_dir / "recipe.yaml"

    @property
    def driver_log(self) -> Path:
        return self.output_dir / "logs" / "driver.log"

    @property
    def vllm_cache(self) -> Path:
        return self.output_dir / "vllm_cache"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard events: the trainers' per stage folder, the iteration scalars (`optima.tracking`)."""
        return self.output_dir / TENSORBOARD_DIR

    def trainer_logs(self, sp: StagePaths) -> Path:
        """The TensorBoard events of one stage folder's trainer: `tensorboard/iteration_<i>[/<stage>]`."""
        return self.tensorboard / sp.root.relative_to(self.output_dir)

    @property
    def heldout(self) -> Path:
        """The held-out evaluation's folder (`optima.evaluation.heldout`)."""
        return self.output_dir / "heldout"

    @property
    def checkpoints(self) -> Path:
        return self.checkpoint_root or self.output_dir / "checkpoints"

    def checkpoint(self, iteration: int, stage: str | None = None) -> Path:
        """`checkpoints/iteration_<i>`; an intermediate stage's is `checkpoints/<stage>_iteration_<i>`."""
        name = f"iteration_{iteration}" if stage is None else f"{stage}_iteration_{iteration}"
        return self.checkpoints / name

    def stage(self, iteration: int, stage: str | None = None) -> StagePaths:
        """The folder of `iteration`, or of one of its stages (`sft`/`dpo` in iSFT-DPO)."""
        root = self.output_dir / f"iteration_{iteration}"
        return StagePaths(root / stage if stage else root)


def stage_folders(run_dir: Path) -> list[tuple[int, str, StagePaths]]:
    """`(iteration, part, folder)` of every `iteration_<i>` folder of `run_dir` and each of its possible parts, in
    run order, whether the folder exists or not (each reader keeps those holding its file)."""
    paths, found = RunPaths(Path(run_dir)), []
    for folder in Path(run_dir).glob("iteration_*"):
        number = folder.name.removeprefix("iteration_")
        if number.isdigit():
            found += [(int(number), part, paths.stage(int(number), part or None)) for part in PART_FOLDERS]
    return sorted(found, key=lambda item: (item[0], PART_FOLDERS.index(item[1])))


def find_checkpoints(root: Path) -> list[tuple[str, Path]]:
    """The finished checkpoints under `root` (completion marker present; the others named in a warning) in numeric
    order (docs/method.md, D29); a folder that is itself a model (`config.json`) is one checkpoint."""
    root = Path(root)
    if (root / "config.json").is_file():
        return [(root.name, root)]
    found = []
    for child in root.iterdir() if root.is_dir() else []:
        prefix, _, number = child.name.rpartition("_")
        if child.is_dir() and prefix.endswith("iteration") and number.isdigit():
            if (child / COMPLETE_MARKER).is_file():
                found.append((prefix.removesuffix("iteration"), int(number), child))
            else:
                logger.warning(
                    "checkpoints | %s: no %s (unfinished or unverified save), left out", child, COMPLETE_MARKER
                )
    # Numeric order; within one iteration an intermediate stage (sft_iteration_k) precedes iteration_k.
    found.sort(key=lambda item: (item[1], item[0] == "", item[0]))
    return [(path.name, path) for _, _, path in found]


def checkpoint_label(name: str) -> str:
    """A checkpoint folder's name for people: `iteration_k` is the model after iteration k+1 (`sft_iteration_k`:
    of its SFT stage); other names stay as they are."""
    prefix, _, number = name.rpartition("_")
    if not number.isdigit() or prefix not in ("iteration", "sft_iteration", "dpo_iteration"):
        return name
    stage = prefix.removesuffix("iteration").rstrip("_")
    return f"after iteration {int(number) + 1}" + (f" ({stage.upper()} stage)" if stage else "")


def models_label(root: Path) -> str:
    """A folder of checkpoints for a title, without the machine's path: the run's name (`<run>/checkpoints`)."""
    root = Path(root)
    return root.parent.name if root.name == "checkpoints" and root.parent.name else root.name
