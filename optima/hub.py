"""`push_to_hub`: the model card of every checkpoint, and the upload of a run's final checkpoint and training sets.

Every checkpoint gets a `huggingface_hub` model card after its iteration (base model, tags, datasets and the
iteration's numbers; no local path). With `push_to_hub` the final checkpoint goes to `hub_model_id` after the last
iteration, the run report under `run_report/`; with `hub_push_datasets` every training set goes to
`<hub_model_id>-data`, one dataset config per iteration folder. `hub_push.json` records what was pushed, so a rerun
of a finished run uploads nothing again. Token and endpoint: `HF_TOKEN`, `HF_ENDPOINT`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optima.config import HUB_ID, is_hub_id
from optima.lineage import lineage_folders
from optima.paths import RunPaths, checkpoint_label
from optima.reporting import build_row
from optima.tasks import get_task

if TYPE_CHECKING:
    from optima.config import LoopRecipe

logger = logging.getLogger(__name__)

PUSH_RECORD = "hub_push.json"
DATA_REPO_SUFFIX = "-data"
CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

Trained with Optima (iterative training of a two-agent system, Alice and Bob, to solve tasks with fewer and more
readable tokens): {{ method }} on `{{ task }}`, from `{{ base_label }}`.

- checkpoint: `{{ checkpoint }}`, the model {{ label }} of {{ iterations }}
- seed: {{ seed }}
- reward: task score {{ lambda1 }} x tokens / T_max{% if cal_ppl %} + {{ lambda2 }} / LM loss{% endif %}
{% if data_repo %}{% for config in configs %}- training set: `load_dataset("{{ data_repo }}", "{{ config }}")`
{% endfor %}{% endif %}- library versions: {{ versions }}

## This iteration

| metric | value |
|---|---|
{% for name, value in numbers %}| {{ name }} | {{ value }} |
{% endfor %}"""
# Report-row numbers shown in the card (`optima.reporting.build_row`).
CARD_NUMBERS = ("answer_rate", "task_score", "verifier_timeouts", "mean_tokens", "conversations", "kept", "train_loss",
                "train_rows")  # fmt: skip


def data_repo_id(recipe: LoopRecipe) -> str | None:
    """The dataset repository of the run's training sets (`<hub_model_id>-data`), when they are pushed."""
    return f"{recipe.hub_model_id}{DATA_REPO_SUFFIX}" if recipe.hub_model_id and recipe.hub_push_datasets else None


def config_name(path_in_run: str) -> str:
    """The dataset config of a training set: `iteration_1/dpo` -> `iteration_1_dpo`."""
    return path_in_run.replace("/", "_")


def iteration_configs(paths: RunPaths, iteration: int) -> list[str]:
    """The dataset configs of one iteration's training sets: `iteration_<i>` (iSFT-DPO: `_sft`, `_dpo`)."""
    folder = f"iteration_{iteration}"
    return [config_name(path) for path, _ in dataset_folders(paths) if path.split("/")[0] == folder]


def base_model_id(model: str) -> str | None:
    """The hub id of a model: the name itself, else what a local folder's card or config names; None if unknown."""
    if is_hub_id(model):
        return model
    folder = Path(model)
    candidates = []
    if (folder / "README.md").is_file():
        from huggingface_hub import ModelCard

        base = ModelCard.load(folder / "README.md").data.base_model
        candidates += base if isinstance(base, list) else [base]
    if (folder / "config.json").is_file():
        candidates.append(json.loads((folder / "config.json").read_text()).get("_name_or_path"))
    found = [c for c in candidates if isinstance(c, str) and HUB_ID.match(c) and not Path(c).exists()]
    return found[0] if found else None


def build_model_card(recipe: LoopRecipe, iteration: int, metrics: dict, versions: dict[str, str]):
    """The model card of a checkpoint: metadata, the iteration's numbers (`metrics.json`), library `versions`."""
    from huggingface_hub import ModelCard, ModelCardData

    base = base_model_id(str(recipe.initial_model_path))
    data_repo = data_repo_id(recipe)
    datasets = [d for d in (get_task(recipe.dataset_type).hub_name, data_repo) if d]
    tags = ["optima", "trl", "multi-agent", *dict.fromkeys(recipe.method.split("_")), recipe.dataset_type]
    data = ModelCardData(
        base_model=base,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=tags,
        datasets=datasets or None,
    )
    row = build_row(iteration, "", metrics)
    checkpoint = f"iteration_{iteration}"  # the 0-based folder name; people read "after iteration <i + 1>"
    numbers = [(name, row[name]) for name in CARD_NUMBERS if row.get(name) is not None]
    return ModelCard.from_template(
        data,
        template_str=CARD_TEMPLATE,
        title=f"Optima {recipe.method} checkpoint: {recipe.dataset_type}, {checkpoint_label(checkpoint)}",
        method=recipe.method,
        task=recipe.dataset_type,
        base_label=base or Path(str(recipe.initial_model_path)).name,  # a folder's name, never its path
        checkpoint=checkpoint,
        label=checkpoint_label(checkpoint),
        iterations=recipe.iteration_times,
        seed=recipe.seed,
        lambda1=recipe.lambda1,
        lambda2=recipe.lambda2,
        cal_ppl=recipe.cal_ppl,
        data_repo=data_repo,
        configs=iteration_configs(RunPaths.from_recipe(recipe), iteration) if data_repo else [],
        versions=json.dumps(versions),
        numbers=numbers,
    )


def dataset_folders(paths: RunPaths) -> list[tuple[str, Path]]:
    """`(path in the dataset repo, folder)` of every saved training set of the run's current lineage, in order."""
    return [
        (sp.root.relative_to(paths.output_dir).as_posix(), sp.dataset)
        for _, _, sp in lineage_folders(paths.output_dir)
        if (sp.dataset / "dataset_dict.json").is_file()
    ]


def push_run(recipe: LoopRecipe, paths: RunPaths, final_model: str, api: Any = None) -> dict | None:
    """Upload the final checkpoint (card and run report included) and, if asked, the training sets, through `api`
    (default `huggingface_hub.HfApi()`); the push record, or None when nothing was trained."""
    checkpoint = Path(final_model)
    if str(final_model) == str(recipe.initial_model_path) or not checkpoint.is_dir():
        logger.warning("push_to_hub | the run trained no checkpoint; nothing uploaded")
        return None
    record_file = paths.output_dir / PUSH_RECORD
    record = {"repo_id": recipe.hub_model_id, "checkpoint": str(checkpoint), "datasets": recipe.hub_push_datasets}
    if record_file.is_file() and json.loads(record_file.read_text()) == record:
        logger.info("push_to_hub | %s already pushed to %s; skipped", checkpoint, recipe.hub_model_id)
        return record
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    repo = recipe.hub_model_id
    api.create_repo(repo, repo_type="model", private=True, exist_ok=True)
    message = f"Optima {recipe.method} on {recipe.dataset_type}: {checkpoint.name}"
    api.upload_folder(repo_id=repo, folder_path=str(checkpoint), repo_type="model", commit_message=message)
    for name in ("report.md", "report.png"):
        report = paths.output_dir / name
        if report.is_file():
            api.upload_file(
                path_or_fileobj=str(report), path_in_repo=f"run_report/{name}", repo_id=repo, repo_type="model"
            )
    logger.info("push_to_hub | %s -> model repo %s", checkpoint, repo)
    if recipe.hub_push_datasets:
        push_datasets(recipe, paths, api.token)
    record_file.write_text(json.dumps(record, indent=2) + "\n")
    return record


def push_datasets(recipe: LoopRecipe, paths: RunPaths, token: str | None = None) -> None:
    """Push every training set of the run to `<hub_model_id>-data`, one dataset config per iteration folder."""
    from datasets import load_from_disk

    data_repo = data_repo_id(recipe)
    for path_in_run, folder in dataset_folders(paths):
        name = config_name(path_in_run)
        load_from_disk(str(folder)).push_to_hub(
            data_repo,
            config_name=name,
            private=True,
            token=token,
            commit_message=f"training set of {path_in_run}",
        )
        logger.info("push_to_hub | %s -> dataset repo %s, config %s", folder, data_repo, name)
