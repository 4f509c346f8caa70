"""push_to_hub against a local stand-in of HfApi: every call checked against the real HfApi signature."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

from huggingface_hub import HfApi

from optima.config import SFTRecipe, load_recipe
from optima.hub import PUSH_RECORD, push_run
from optima.paths import RunPaths
from optima.selection.io import save_splits

REPO = Path(__file__).resolve().parent.parent


class LocalHub:
    """Records the calls and copies what would be uploaded into ``root/<repo_type>/<repo_id>/``."""

    def __init__(self, root: Path):
        self.root, self.calls = root, []

    def _check(self, name: str, *args, **kwargs) -> None:
        inspect.signature(getattr(HfApi, name)).bind(self, *args, **kwargs)  # a wrong keyword fails here
        self.calls.append((name, args, kwargs))

    def create_repo(self, repo_id, **kwargs):
        self._check("create_repo", repo_id, **kwargs)
        (self.root / kwargs["repo_type"] / repo_id).mkdir(parents=True, exist_ok=True)

    def upload_folder(self, **kwargs):
        self._check("upload_folder", **kwargs)
        target = self.root / kwargs["repo_type"] / kwargs["repo_id"] / (kwargs.get("path_in_repo") or "")
        shutil.copytree(kwargs["folder_path"], target, dirs_exist_ok=True)

    def upload_file(self, **kwargs):
        self._check("upload_file", **kwargs)
        target = self.root / kwargs["repo_type"] / kwargs["repo_id"] / kwargs["path_in_repo"]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(kwargs["path_or_fileobj"], target)


def finished_run(tmp_path: Path, **overrides):
    values = {
        "dataset_type": "arc",
        "initial_model_path": str(REPO / "models/SmolLM2-135M-Instruct"),
        "origin_yaml_path": str(REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml"),
        "output_dir": str(tmp_path / "run"),
        "push_to_hub": True,
        "hub_model_id": "me/optima-arc",
    } | overrides
    recipe = load_recipe(SFTRecipe, None, values, check_paths=False)
    paths = RunPaths.from_recipe(recipe)
    for i in (0, 1):
        save_splits({"train": [{"text": f"row {i}"}]}, paths.stage(i).dataset)
        checkpoint = paths.checkpoint(i)
        checkpoint.mkdir(parents=True)
        (checkpoint / "model.safetensors").write_bytes(b"weights %d" % i)
        (checkpoint / "README.md").write_text(f"# Optima sft checkpoint: arc, iteration {i}\n")
    (paths.output_dir / "report.md").write_text("# report\n")
    return recipe, paths


def test_push_uploads_the_final_checkpoint_card_report_and_datasets(tmp_path):
    recipe, paths = finished_run(tmp_path, hub_push_datasets=True)
    hub = LocalHub(tmp_path / "hub")
    record = push_run(recipe, paths, str(paths.checkpoint(1)), api=hub)
    model_repo = hub.root / "model" / "me/optima-arc"
    assert (model_repo / "model.safetensors").read_bytes() == b"weights 1"
    assert "iteration 1" in (model_repo / "README.md").read_text()
    assert (model_repo / "run_report" / "report.md").read_text() == "# report\n"
    data_repo = hub.root / "dataset" / "me/optima-arc-data"
    from datasets import load_from_disk

    assert [load_from_disk(str(data_repo / f"iteration_{i}"))["train"][0]["text"] for i in (0, 1)] == [
        "row 0",
        "row 1",
    ]
    assert ("create_repo", ("me/optima-arc",), {"repo_type": "model", "private": True, "exist_ok": True}) in hub.calls
    assert record == json.loads((paths.output_dir / PUSH_RECORD).read_text())
    # a rerun of the finished run does not upload again
    calls = len(hub.calls)
    push_run(recipe, paths, str(paths.checkpoint(1)), api=hub)
    assert len(hub.calls) == calls


def test_push_without_datasets_and_without_training(tmp_path):
    recipe, paths = finished_run(tmp_path)
    hub = LocalHub(tmp_path / "hub")
    assert push_run(recipe, paths, recipe.initial_model_path, api=hub) is None and hub.calls == []
    push_run(recipe, paths, str(paths.checkpoint(0)), api=hub)
    assert not (hub.root / "dataset").exists()
    assert (hub.root / "model" / "me/optima-arc" / "model.safetensors").read_bytes() == b"weights 0"


def test_push_needs_a_repository_name(tmp_path):
    import pytest

    from optima.config.fields import RecipeError

    with pytest.raises(RecipeError, match="hub_model_id"):
        finished_run(tmp_path, hub_model_id=None)
