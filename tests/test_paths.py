"""Run directory layout and checkpoint discovery."""

from __future__ import annotations

from pathlib import Path

from optima.paths import RunPaths, find_checkpoints
from tests.helpers import mark_finished


def test_run_layout(tmp_path):
    paths = RunPaths(tmp_path)
    assert paths.checkpoint(2) == tmp_path / "checkpoints" / "iteration_2"
    assert paths.checkpoint(1, "sft") == tmp_path / "checkpoints" / "sft_iteration_1"
    assert paths.stage(0).generations == tmp_path / "iteration_0" / "generations.jsonl"
    assert paths.stage(3, "dpo").rollouts == tmp_path / "iteration_3" / "dpo" / "rollouts.jsonl"
    assert paths.stage(0).server_log(1) == tmp_path / "iteration_0" / "logs" / "vllm_1.log"
    assert RunPaths(tmp_path, Path("/ckpt")).checkpoint(0) == Path("/ckpt/iteration_0")


def test_checkpoints_in_numeric_order(tmp_path):
    for name in ("iteration_10", "iteration_2", "sft_iteration_2", "iteration_0", "notes", "iteration_x"):
        mark_finished(tmp_path / name)
    (tmp_path / "iteration_3").write_text("a file, not a checkpoint")
    names = [name for name, _ in find_checkpoints(tmp_path)]
    assert names == ["iteration_0", "sft_iteration_2", "iteration_2", "iteration_10"]


def test_only_finished_checkpoints_are_found(tmp_path, caplog):
    """A save killed half-way or that failed its verification has no completion marker: it is not evaluated."""
    mark_finished(tmp_path / "iteration_0")
    (tmp_path / "iteration_1").mkdir()
    (tmp_path / "iteration_1" / "config.json").write_text("{}")
    assert find_checkpoints(tmp_path) == [("iteration_0", tmp_path / "iteration_0")]
    assert "iteration_1: no optima_complete.json" in caplog.text


def test_a_model_folder_is_its_own_checkpoint(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert find_checkpoints(model) == [("my-model", model)]
    assert find_checkpoints(tmp_path / "absent") == []


def test_stage_folders_in_run_order_for_the_report_and_the_browser(tmp_path):
    from optima.browser.collect import stage_folders as browsed
    from optima.paths import stage_folders
    from optima.reporting import find_metrics

    for folder in ("iteration_10", "iteration_2/sft", "iteration_2/dpo", "iteration_x"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "iteration_10" / "metrics.json").write_text("{}")
    (tmp_path / "iteration_2" / "dpo" / "metrics.json").write_text("{}")
    (tmp_path / "iteration_2" / "sft" / "generations.jsonl").write_text("")
    order = [(i, part) for i, part, _ in stage_folders(tmp_path)]
    assert order == [(2, ""), (2, "sft"), (2, "dpo"), (10, ""), (10, "sft"), (10, "dpo")]  # numeric, not by name
    assert [(i, part) for i, part, _ in find_metrics(tmp_path)] == [(2, "dpo"), (10, "")]
    assert [(i, part) for i, part, _ in browsed(tmp_path)] == [(2, "sft")]
