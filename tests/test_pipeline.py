"""Loop decisions that need no server: nothing selected (stop / carry forward), finished stages skipped."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from optima.config import SFTRecipe, load_recipe
from optima.environments import PythonEnv
from optima.lineage import Manifest
from optima.loop import NothingSelected, part_keys, planned_parts, run_loop, start_run
from optima.run import Run, build_run

REPO = Path(__file__).resolve().parent.parent
TRAIN_ENV = PythonEnv(sys.executable, "python", (sys.executable,))
EMPTY_SELECTION = {
    "questions": 4,
    "conversations": 8,
    "kept_conversations": 0,
    "rows": {},
    "reasons": {"below epsilon": 4},
    "epsilon": 0.5,
    "best_reward": 0.12,
    "best_reward_parts": {"task_score": 0.0, "reward": 0.12},
}


def finished_until_select(tmp_path: Path, **overrides) -> Run:
    """A one-iteration run that generated, scored and selected nothing (no server is needed)."""
    values = {
        "dataset_type": "arc",
        "initial_model_path": str(REPO / "models/SmolLM2-135M-Instruct"),
        "origin_yaml_path": str(REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml"),
        "output_dir": str(tmp_path / "run"),
        "iteration_times": 1,
    } | overrides
    recipe = load_recipe(SFTRecipe, None, values, check_paths=False)
    run = build_run(recipe, {"train": TRAIN_ENV}, gpu=False)
    start_run(run)
    first = planned_parts(run)[0]
    manifest = Manifest(first.sp.manifest, part_keys(first, None))
    manifest.record("generate", {"written": 8}, 1.0)
    manifest.record("score", {"answer_rate": 0.0, "accuracy": 0.0, "mean_tokens": 50.0}, 1.0)
    manifest.record("select", EMPTY_SELECTION, 0.1)
    return run


def test_nothing_selected_stops_with_the_reasons(tmp_path):
    run = finished_until_select(tmp_path)
    with pytest.raises(NothingSelected) as info:
        run_loop(run)
    message = str(info.value)
    for fragment in (
        "4 questions, 8 conversations",
        "best reward 0.12",
        "epsilon 0.5",
        "below epsilon",
        "carry_forward",
    ):
        assert fragment in message
    assert not run.paths.checkpoint(0).exists()


def test_nothing_selected_can_carry_the_model_forward(tmp_path):
    run = finished_until_select(tmp_path, on_empty_selection="carry_forward")
    assert run_loop(run) == run.recipe.initial_model_path  # the model is carried forward
    metrics = json.loads(run.paths.stage(0).metrics.read_text())
    assert metrics["stages"]["select"]["kept_conversations"] == 0 and "train" not in metrics["stages"]
    assert (run.paths.output_dir / "recipe.yaml").exists() and run.paths.driver_log.exists()
    report = (run.paths.output_dir / "report.md").read_text()  # written after every iteration, trained or not
    assert "| 1 | 0 | 0 | - | - | 50.0 | - | - | - | 0 | - | 2.1 |" in report  # nothing flexible or copied recorded
