"""Model cards and push_to_hub, against a local stand-in of the Hub (``tests/fake_hub.py``).

The upload test runs the real clients (``HfApi``, ``DatasetDict.push_to_hub``, ``load_dataset``, ``ModelCard.load``)
in a child process whose ``HF_ENDPOINT`` is the stand-in's address: what a user would run, minus the network.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import HfApi, ModelCard

from optima.config import SFTDPORecipe, SFTRecipe, load_recipe
from optima.hub import PUSH_RECORD, base_model_id, build_model_card, push_run
from optima.paths import RunPaths
from optima.store import save_splits
from tests.fake_hub import FakeHub

REPO = Path(__file__).resolve().parent.parent
METRICS = {
    "stages": {
        "score": {"answer_rate": 0.75, "accuracy": 0.5, "mean_tokens": 120.0, "conversations": 8},
        "select": {"kept_conversations": 3},
        "train": {"train_loss": 1.25, "train_rows": 6, "model": "/somewhere/local/model"},
    }
}
SFT_ROWS = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "A"}]}
            for i in range(3)]  # fmt: skip
DPO_ROWS = [{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "short"}],
             "rejected": [{"role": "assistant", "content": "long answer"}]}] * 2  # fmt: skip


def local_model(folder: Path, name_or_path: str | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"_name_or_path": name_or_path} if name_or_path else {}))
    return folder


def finished_run(tmp_path: Path, **overrides):
    """A run with two finished iterations: a training set (SFT rows, then DPO-style pairs) and a checkpoint each."""
    model = local_model(tmp_path / "models" / "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
    values = {
        "dataset_type": "arc",
        "initial_model_path": str(model),
        "origin_yaml_path": str(REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml"),
        "output_dir": str(tmp_path / "run"),
        "push_to_hub": True,
        "hub_model_id": "me/optima-arc",
    } | overrides
    recipe = load_recipe(SFTRecipe, None, values, check_paths=False)
    paths = RunPaths.from_recipe(recipe)
    for i, rows in enumerate((SFT_ROWS, DPO_ROWS)):
        save_splits({"train": rows, "test": rows[:1]}, paths.stage(i).dataset)
        checkpoint = paths.checkpoint(i)
        checkpoint.mkdir(parents=True)
        (checkpoint / "model.safetensors").write_bytes(b"weights %d" % i)
        build_model_card(recipe, i, METRICS, {"trl": "1.16.0"}).save(checkpoint / "README.md")
    (paths.output_dir / "report.md").write_text("# report\n")
    return recipe, paths


def test_model_card_metadata_and_no_local_path(tmp_path):
    recipe, paths = finished_run(tmp_path, hub_push_datasets=True)
    text = (paths.checkpoint(1) / "README.md").read_text()
    card = ModelCard(text)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.data.library_name == "transformers"
    assert card.data.datasets == ["allenai/ai2_arc", "me/optima-arc-data"]
    assert {"optima", "trl", "sft", "arc"} <= set(card.data.tags)
    # checkpoints/iteration_1 is the model after the second iteration (folders count from 0, people from 1)
    assert "Optima sft checkpoint: arc, after iteration 2" in text
    assert "- checkpoint: `iteration_1`, the model after iteration 2" in text
    assert "| task_score | 0.5 |" in text and "| train_loss | 1.25 |" in text
    assert 'load_dataset("me/optima-arc-data", "iteration_1")' in text
    assert str(tmp_path) not in text and "/somewhere" not in text  # no machine path anywhere


def test_model_card_counts_iterations_from_one_and_names_each_stage_set_of_isft_dpo(tmp_path):
    model = local_model(tmp_path / "models" / "m", "org/base")
    values = {
        "dataset_type": "arc",
        "initial_model_path": str(model),
        "output_dir": str(tmp_path / "run"),
        "iteration_times": 2,
        "push_to_hub": True,
        "hub_model_id": "me/optima-arc",
        "hub_push_datasets": True,
        "origin_yaml_path": "sft.yaml",
        "origin_dpo_yaml_path": "dpo.yaml",
    }
    recipe = load_recipe(SFTDPORecipe, None, values, check_paths=False)
    paths = RunPaths.from_recipe(recipe)
    for stage, rows in (("sft", SFT_ROWS), ("dpo", DPO_ROWS)):
        save_splits({"train": rows, "test": rows[:1]}, paths.stage(0, stage).dataset)
    text = str(build_model_card(recipe, 0, METRICS, {}))
    assert "checkpoint: arc, after iteration 1" in text
    assert "- checkpoint: `iteration_0`, the model after iteration 1 of 2" in text
    # push_datasets names the configs iteration_0_sft and iteration_0_dpo: the card names those, not iteration_0
    assert 'load_dataset("me/optima-arc-data", "iteration_0_sft")' in text
    assert 'load_dataset("me/optima-arc-data", "iteration_0_dpo")' in text
    assert '"iteration_0")' not in text


def test_base_model_of_a_local_folder(tmp_path):
    assert base_model_id("org/model") == "org/model"
    assert base_model_id(str(local_model(tmp_path / "a", "org/base"))) == "org/base"
    assert base_model_id(str(local_model(tmp_path / "b", str(tmp_path / "a")))) is None  # a path is no hub id
    card_folder = local_model(tmp_path / "c")
    (card_folder / "README.md").write_text("---\nbase_model: org/from-card\n---\n# a fine-tune\n")
    assert base_model_id(str(card_folder)) == "org/from-card"
    recipe, paths = finished_run(tmp_path / "run2", initial_model_path=str(local_model(tmp_path / "plain")))
    card = ModelCard((paths.checkpoint(0) / "README.md").read_text())
    assert card.data.base_model is None and "from `plain`" in card.text  # the folder's name only


PUSH_AND_LOAD = """
import json, sys
from pathlib import Path
from datasets import load_dataset
from huggingface_hub import ModelCard
from optima.hub import push_run
from tests.test_hub import finished_run

recipe, paths = finished_run(Path(sys.argv[1]), hub_push_datasets=True)
push_run(recipe, paths, str(paths.checkpoint(1)))
push_run(recipe, paths, str(paths.checkpoint(1)))  # a rerun of the finished run: nothing uploaded again
sft, dpo = load_dataset("me/optima-arc-data", "iteration_0"), load_dataset("me/optima-arc-data", "iteration_1")
card = ModelCard.load("me/optima-arc")
print(json.dumps({
    "sft": {split: sft[split].num_rows for split in sft}, "sft_row": sft["train"][0],
    "dpo_columns": dpo["train"].column_names, "dpo_row": dpo["train"][0],
    "base_model": card.data.base_model, "datasets": card.data.datasets,
}))
"""


def test_push_to_the_stand_in_hub_then_load_dataset_by_config(tmp_path):
    with FakeHub(tmp_path / "hub") as hub:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": "hf_stand_in",
            "HF_HOME": str(tmp_path / "hf_home"),
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONPATH": str(REPO),
        }
        child = subprocess.run(
            [sys.executable, "-c", PUSH_AND_LOAD, str(tmp_path / "work")],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert child.returncode == 0, child.stderr[-4000:]
        commits = [r for r in hub.requests if r.startswith("POST /api/") and "/commit/" in r]
    loaded = json.loads(child.stdout.strip().splitlines()[-1])
    assert loaded["sft"] == {"train": 3, "test": 1} and loaded["sft_row"] == SFT_ROWS[0]
    assert loaded["dpo_columns"] == ["prompt", "chosen", "rejected"] and loaded["dpo_row"] == DPO_ROWS[0]
    assert loaded["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert loaded["datasets"] == ["allenai/ai2_arc", "me/optima-arc-data"]
    model_repo, data_repo = hub.folder("model", "me/optima-arc"), hub.folder("dataset", "me/optima-arc-data")
    assert (model_repo / "model.safetensors").read_bytes() == b"weights 1"
    assert (model_repo / "run_report" / "report.md").read_text() == "# report\n"
    assert {"iteration_0/train-00000-of-00001.parquet", "iteration_1/test-00000-of-00001.parquet"} <= set(
        hub.files("dataset", "me/optima-arc-data")
    )
    card = (data_repo / "README.md").read_text()  # the viewer reads the configs from the dataset card
    assert "config_name: iteration_0" in card and "config_name: iteration_1" in card
    assert len(commits) == 4  # model folder, report.md, one per training set; none from the rerun
    assert json.loads((tmp_path / "work" / "run" / PUSH_RECORD).read_text())["repo_id"] == "me/optima-arc"


class LocalHub:
    """Records the calls (checked against the real ``HfApi`` signatures) and copies uploads into ``root``."""

    def __init__(self, root: Path):
        self.root, self.calls, self.token = root, [], None

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


def test_push_without_datasets_and_without_training(tmp_path):
    recipe, paths = finished_run(tmp_path)
    hub = LocalHub(tmp_path / "hub")
    assert push_run(recipe, paths, recipe.initial_model_path, api=hub) is None and hub.calls == []
    push_run(recipe, paths, str(paths.checkpoint(0)), api=hub)
    assert not (hub.root / "dataset").exists()
    assert (hub.root / "model" / "me/optima-arc" / "model.safetensors").read_bytes() == b"weights 0"
    assert ("create_repo", ("me/optima-arc",), {"repo_type": "model", "private": True, "exist_ok": True}) in hub.calls


def test_push_needs_a_repository_name(tmp_path):
    from optima.config import RecipeError

    with pytest.raises(RecipeError, match="hub_model_id"):
        finished_run(tmp_path, hub_model_id=None)
