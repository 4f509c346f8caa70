"""``push_to_hub``: upload the final checkpoint of a loop run (and optionally its training sets) to the Hub.

Off by default. After the last iteration the final checkpoint folder goes to the model repository
``hub_model_id`` with its model card (``README.md``, written after each iteration) and the run report under
``run_report/``. With ``hub_push_datasets`` every iteration's training set (the ``dataset/`` folder that selection
saved with ``datasets.save_to_disk``; read it back with ``datasets.load_from_disk`` after a download) goes to the
dataset repository ``<hub_model_id>-data`` under ``iteration_<i>[/<stage>]``.

The uploads go through ``huggingface_hub.HfApi`` (``create_repo`` with ``exist_ok``, ``upload_folder``,
``upload_file``); the token comes from the usual place (``HF_TOKEN`` or ``huggingface-cli login``). ``push_run``
takes the API object as an argument, so another endpoint (``HfApi(endpoint=...)``) or a stand-in can be used.
A file ``hub_push.json`` in the run directory records what was pushed: a rerun of a finished run does not upload
the same checkpoint again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from optima.paths import RunPaths

logger = logging.getLogger(__name__)

PUSH_RECORD = "hub_push.json"


def dataset_folders(paths: RunPaths) -> list[tuple[str, Path]]:
    """``(path in the dataset repo, folder)`` of every saved training set of the run, in run order."""
    found = []
    for metrics in sorted(paths.output_dir.glob("iteration_*/**/dataset/dataset_dict.json")):
        folder = metrics.parent
        found.append((folder.parent.relative_to(paths.output_dir).as_posix(), folder))
    return sorted(found, key=lambda item: (int(item[0].split("/")[0].removeprefix("iteration_")), item[0]))


def push_run(recipe, paths: RunPaths, final_model: str, api: Any = None) -> dict | None:
    """Upload the final checkpoint (model card and run report included) and, if asked, the training sets.

    Args:
        recipe: A loop recipe with ``push_to_hub``, ``hub_model_id``, ``hub_private``, ``hub_push_datasets``.
        paths: The run's paths.
        final_model: The model the run ended with.
        api: An ``HfApi``-like object (default ``huggingface_hub.HfApi()``).

    Returns:
        The push record, or None when nothing was trained (the base model is never re-uploaded).
    """
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
    api.create_repo(repo, repo_type="model", private=recipe.hub_private, exist_ok=True)
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
        data_repo = f"{repo}-data"
        api.create_repo(data_repo, repo_type="dataset", private=recipe.hub_private, exist_ok=True)
        for path_in_repo, folder in dataset_folders(paths):
            api.upload_folder(
                repo_id=data_repo,
                folder_path=str(folder),
                path_in_repo=path_in_repo,
                repo_type="dataset",
                commit_message=f"training set of {path_in_repo}",
            )
            logger.info("push_to_hub | %s -> dataset repo %s/%s", folder, data_repo, path_in_repo)
    record_file.write_text(json.dumps(record, indent=2) + "\n")
    return record
