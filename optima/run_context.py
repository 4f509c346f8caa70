"""What every stage of a run shares: the recipe, paths, environments, the served model, the tokenizer, reports.

The servers live in ``optima.serving.holder.ServerHolder``: the policy (one model at a time) and the loss server
beside it for the whole run.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optima.config.fields import RecipeError
from optima.config.rules import loss_model
from optima.environments import PythonEnv
from optima.logging_utils import LOG_FORMAT
from optima.manifest import Manifest
from optima.paths import RunPaths, StagePaths
from optima.serving.gpus import has_gpu
from optima.serving.holder import ServerHolder
from optima.store import write_json, write_yaml
from optima.tasks import Task, get_task

logger = logging.getLogger(__name__)


@dataclass
class RunContext:
    """Shared state of one run."""

    recipe: Any
    paths: RunPaths
    envs: dict[str, PythonEnv]
    servers: ServerHolder
    task: Task
    gpu: bool
    _tokenizer: Any = field(default=None, repr=False)
    report_to: list[str] = field(default_factory=list)  # trackers of this run (``auto`` resolved)
    progress: bool = True  # a training progress bar on the console (``--quiet``: none)
    trainer: Any = None  # the run's warm trainer (optima.training.warm); None: accelerate launch for every stage

    @classmethod
    def create(cls, recipe, paths: RunPaths, envs: dict[str, PythonEnv], hardware=None) -> RunContext:
        """Prepare the run directory (recipe.yaml, driver log) and the shared objects.

        ``hardware`` is the run's hardware plan (``optima.hardware.plan``): the servers are placed as it says.

        Raises:
            RecipeError: the run directory cannot be created or written (before any work starts).
        """
        from optima.tracking import resolve_report_to

        check_writable(paths.output_dir)
        save_recipe(recipe, paths.recipe_file)
        attach_driver_log(paths.driver_log)
        holder = ServerHolder(recipe, envs.get("vllm"), loss_model(recipe), paths.driver_log.parent)
        if hardware is not None:
            holder.layout = hardware.layout
        return cls(
            recipe,
            paths,
            envs,
            holder,
            get_task(recipe.dataset_type),
            hardware.hardware.has_gpu if hardware is not None else has_gpu(),
            report_to=resolve_report_to(recipe.report_to, envs.get("train")),
        )

    def tokenizer(self):
        """The initial model's tokenizer (token counts, LM-loss rendering, subword F1)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                self.recipe.tokenizer_first_path or self.recipe.initial_model_path
            )
        return self._tokenizer


def check_writable(folder: Path) -> None:
    """Create ``folder`` if needed and make sure files can be written in it; else one clear ``RecipeError``."""
    probe = folder / ".optima_write_check"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise RecipeError("output_dir", f"cannot write the run directory {folder}: {exc.strerror or exc}") from exc


SECRET_FIELDS = ("api_key",)


def redacted(values: dict[str, Any]) -> dict[str, Any]:
    """A recipe dict fit for disk and logs: secrets replaced by a marker."""
    return {k: ("<redacted>" if k in SECRET_FIELDS and v else v) for k, v in values.items()}


def save_recipe(recipe, path: Path) -> None:
    """Write the validated recipe (secrets redacted); say which fields changed when resuming under another one."""
    import yaml

    current = redacted(recipe.to_dict())
    if path.exists():
        previous = yaml.safe_load(path.read_text()) or {}
        changed = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
        if changed:
            logger.warning("resuming %s with changed recipe fields: %s", path.parent, ", ".join(changed))
    write_yaml(path, current)


def attach_driver_log(path: Path) -> None:
    """Also write the driver's log to ``logs/driver.log`` of the run (appending across resumptions)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    if any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path for h in root.handlers):
        return
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)


def iteration_metrics(manifest: Manifest) -> dict[str, Any]:
    """metrics.json of one iteration: each stage's results and timings."""
    results = {name: manifest.result(name) for name in manifest.entries}
    return {"stages": results, "timings_s": manifest.timings(), "written_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_iteration_report(
    ctx: RunContext, iteration: int, sp: StagePaths, manifest: Manifest, checkpoint: Path | None
) -> dict:
    """Write ``metrics.json``, log the iteration's headline numbers, and put a model card in the checkpoint."""
    metrics = {"iteration": iteration} | iteration_metrics(manifest)
    write_json(sp.metrics, metrics)
    stages = metrics["stages"]
    scored = stages.get("score") or stages.get("search") or {}  # DPO iterations report their rollouts
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
    from optima.tracking import publish_iteration

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
