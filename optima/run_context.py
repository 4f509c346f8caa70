"""What every stage of a run shares: the recipe, paths, environments, the served model, the tokenizer, reports.

``RunContext`` is the one object per run (``build_run_context``; the dry-run builds it too); each stage reaches it
through its ``optima.stages.common.StageCall``, the other context object, built for each stage. The servers live
in ``optima.serving.holder.ServerHolder``: the policy (one model at a time) and the loss server beside it for the
whole run.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optima.config import RecipeError, save_recipe
from optima.config.rules import loss_model, tokenizer_path
from optima.config.stage_names import Stage
from optima.environments import PythonEnv
from optima.hardware.allocation import HardwareAllocation
from optima.logging_utils import attach_driver_log
from optima.manifest import Manifest
from optima.paths import RunPaths, StagePaths
from optima.serving.holder import ServerHolder
from optima.store import write_json
from optima.tasks import Task, get_task

if TYPE_CHECKING:
    from optima.config import LoopRecipe
    from optima.hardware.machine import Hardware

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class RunContext:
    """What every stage of a run shares: one per run, built by ``build_run_context`` for the dry-run and the run.

    A dry-run only describes, so it makes nothing: the servers, the task and the tokenizer are made on first use,
    and ``prepare`` (called by the run) writes the run directory's files and resolves the trackers.

    Args:
        recipe: The validated recipe.
        paths: Every file of the run.
        envs: ``{"vllm": ..., "train": ...}``.
        hardware: Where every process runs (``optima.hardware.HardwareAllocation``), checked before the run
            starts.
        progress: Training progress bars on the console (``--quiet``: none).
        report_to: The run's trackers (``auto`` resolved by ``prepare``).
    """

    recipe: LoopRecipe
    paths: RunPaths
    envs: dict[str, PythonEnv]
    hardware: HardwareAllocation
    progress: bool = True
    report_to: list[str] = field(default_factory=list)
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def gpu(self) -> bool:
        """Whether the run's machine has GPUs (the hardware planned for: given, or detected)."""
        return self.hardware.hardware.has_gpu

    @cached_property
    def servers(self) -> ServerHolder:
        """The policy server (one model at a time) and the loss server beside it, placed as the hardware allocation
        says."""
        vllm_env, log_dir = self.envs.get("vllm"), self.paths.driver_log.parent
        training, node_launcher = self.hardware.training, None
        if training is not None and training.multi_node:  # every node serves the policy (ServerLayout.nodes)
            from optima.training.nodes import NodeCommands

            node_launcher = NodeCommands(training)
        return ServerHolder(
            self.recipe,
            vllm_env,
            loss_model(self.recipe),
            log_dir,
            layout=self.hardware.layout,
            demand=self.policy_demand,
            node_launcher=node_launcher,
        )

    def policy_demand(self, model: str) -> int | None:
        """KV bytes the run's conversations need of a policy server of ``model``: measured on a sample of the training
        split, the questions every stage draws its slice from (``optima.agents.footprint.policy_demand``)."""
        from optima.agents.footprint import policy_demand

        recipe = self.recipe
        return policy_demand(recipe, self.task.load_train(data_dir=recipe.data_dir, seed=recipe.seed), model)

    @cached_property
    def task(self) -> Task:
        """The recipe's task (``optima.tasks``)."""
        return get_task(self.recipe.dataset_type)

    def prepare(self) -> None:
        """Prepare the run directory (recipe.yaml, driver log) and resolve the trackers, before any work starts.

        Raises:
            RecipeError: the run directory cannot be created or written, or a tracker is not installed.
        """
        from optima.tracking import resolve_report_to

        check_writable(self.paths.output_dir)
        save_recipe(self.recipe, self.paths.recipe_file)
        attach_driver_log(self.paths.driver_log)
        self.report_to = resolve_report_to(self.recipe.report_to, self.envs.get("train"))

    def tokenizer(self):
        """The initial model's tokenizer (token counts, LM-loss rendering, subword F1)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(self.recipe))
        return self._tokenizer


def build_run_context(
    recipe: LoopRecipe,
    envs: dict[str, PythonEnv],
    hardware: Hardware | None = None,
    gpu: bool | None = None,
    progress: bool = True,
) -> RunContext:
    """The run's context, with the hardware allocation of the machine it runs on (checked when the run starts).

    Args:
        recipe: A validated loop recipe.
        envs: ``{"vllm": ..., "train": ...}``.
        hardware: The machine(s) (``optima.hardware.machine.Hardware``; default: detected).
        gpu: False: allocate for this machine without its GPUs (tests); default: the hardware's.
        progress: Training progress bars on the console (``--quiet``: none).
    """
    from optima.hardware.allocation import allocate_this_machine
    from optima.hardware.machine import Hardware

    if hardware is None and gpu is False:
        hardware = Hardware(1, 0, 0.0, source="no GPU")
    allocation = allocate_this_machine(recipe, hardware)
    paths = RunPaths.from_recipe(recipe)
    return RunContext(recipe=recipe, paths=paths, envs=envs, hardware=allocation, progress=progress)


def check_writable(folder: Path) -> None:
    """Create ``folder`` if needed and make sure files can be written in it; else one clear ``RecipeError``."""
    probe = folder / ".optima_write_check"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise RecipeError("output_dir", f"cannot write the run directory {folder}: {exc.strerror or exc}") from exc


def iteration_metrics(manifest: Manifest) -> dict[str, Any]:
    """metrics.json of one iteration: each stage's results and timings."""
    results = {name: manifest.result(name) for name in manifest.finished()}
    return {"stages": results, "timings_s": manifest.timings(), "written_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_iteration_report(
    ctx: RunContext, iteration: int, sp: StagePaths, manifest: Manifest, checkpoint: Path | None
) -> dict:
    """Write ``metrics.json``, log the iteration's headline numbers, and put a model card in the checkpoint."""
    metrics = {"iteration": iteration} | iteration_metrics(manifest)
    write_json(sp.metrics, metrics)
    stages = metrics["stages"]
    scored = stages.get(Stage.SCORE) or stages.get(Stage.SEARCH) or {}  # DPO iterations report their rollouts
    logger.info(
        "iteration %d/%d | answer rate %s | accuracy %s | mean tokens %s | stage seconds %s",
        iteration + 1,
        ctx.recipe.iteration_times,
        scored.get("answer_rate"),
        scored.get("accuracy"),
        scored.get("mean_tokens"),
        metrics["timings_s"],
    )
    if checkpoint is not None and checkpoint.is_dir():
        (checkpoint / "README.md").write_text(render_model_card(ctx, iteration, metrics))
    from optima.reporting import publish_iteration

    publish_iteration(ctx.paths.output_dir, ctx.report_to)  # report.md/png and the trackers, every iteration
    return metrics


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "datasets"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def render_model_card(ctx: RunContext, iteration: int, metrics: dict) -> str:
    """The checkpoint's model card (``optima.hub.build_model_card``): metadata, numbers, no local path."""
    from optima.hub import build_model_card

    return str(build_model_card(ctx.recipe, iteration, metrics, _versions()))
