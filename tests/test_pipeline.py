"""Pipeline decisions that need no server: nothing selected (stop / carry forward), finished stages skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optima.config import SFTRecipe, load_recipe
from optima.manifest import Manifest
from optima.pipeline import NothingSelected, run_part
from optima.plan import build_plan
from optima.run_context import RunContext, build_run_context
from optima.stage_identity import part_keys

REPO = Path(__file__).resolve().parent.parent
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


def finished_until_select(tmp_path: Path, **overrides) -> RunContext:
    """A run whose first iteration generated, scored and selected nothing (no server is needed)."""
    values = {
        "dataset_type": "arc",
        "initial_model_path": str(REPO / "models/SmolLM2-135M-Instruct"),
        "origin_yaml_path": str(REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml"),
        "output_dir": str(tmp_path / "run"),
    } | overrides
    recipe = load_recipe(SFTRecipe, None, values, check_paths=False)
    ctx = build_run_context(recipe, {}, gpu=False)
    ctx.prepare()
    first = build_plan(recipe).parts[0]
    manifest = Manifest(first.sp.manifest, part_keys(first.stage_call(ctx, first.model), first.stages))
    manifest.record("generate", {"written": 8}, 1.0)
    manifest.record("score", {"answer_rate": 0.0, "accuracy": 0.0, "mean_tokens": 50.0}, 1.0)
    manifest.record("select", EMPTY_SELECTION, 0.1)
    return ctx


def run_sft_iteration(ctx: RunContext, iteration: int, model: str) -> str | None:
    """The iteration's stages, as ``run_plan`` runs them."""
    return run_part(ctx, build_plan(ctx.recipe).parts[iteration], model)


def test_nothing_selected_stops_with_the_reasons(tmp_path):
    ctx = finished_until_select(tmp_path)
    with pytest.raises(NothingSelected) as info:
        run_sft_iteration(ctx, 0, ctx.recipe.initial_model_path)
    message = str(info.value)
    for fragment in (
        "4 questions, 8 conversations",
        "best reward 0.12",
        "epsilon 0.5",
        "below epsilon",
        "carry_forward",
    ):
        assert fragment in message
    assert not ctx.paths.checkpoint(0).exists()


def test_nothing_selected_can_carry_the_model_forward(tmp_path):
    ctx = finished_until_select(tmp_path, on_empty_selection="carry_forward")
    assert run_sft_iteration(ctx, 0, ctx.recipe.initial_model_path) is None  # the caller keeps its model
    metrics = json.loads(ctx.paths.stage(0).metrics.read_text())
    assert metrics["stages"]["select"]["kept_conversations"] == 0 and "train" not in metrics["stages"]
    assert (ctx.paths.output_dir / "recipe.yaml").exists() and ctx.paths.driver_log.exists()
    report = (ctx.paths.output_dir / "report.md").read_text()  # written after every iteration, trained or not
    assert "| 1 | 0 | 0 | - | - | 50.0 | - | - | - | 0 | - | 2.1 |" in report  # nothing flexible or copied recorded
