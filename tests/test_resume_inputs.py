"""Resume follows its inputs: changing one field of a finished 2-iteration run redoes exactly what depends on it.

Every stage function is replaced by a recorder (no server, no trainer); the train stage writes a checkpoint with a
fresh ``weights_id``, as the trainer scripts do, so a retrained iteration is a new model for the next one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
from pathlib import Path

import pytest

from optima import loop, stages
from optima.identity import COMPLETE_MARKER, model_identity, new_weights_id
from optima.methods import TRAINER_STAGES
from optima.run import build_run
from tests.test_stage_table import TRAIN_ENV, make_recipe

SFT = ["generate", "score", "select", "train"]
DPO = ["probe", "search", "pairs", "train"]
PARTS = {"sft": [(None, SFT)], "dpo": [(None, DPO)], "sft_dpo": [("sft", SFT), ("dpo", DPO)]}


def write_model(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def fake_stage(name: str, ran: list):
    def run(part, settings, *more):
        ran.append((part.iteration, part.name, name))
        for path in loop.stage_outputs(part, name):  # what the stage writes, as the loop sets it aside
            if path == part.out:  # a finished checkpoint: new weights, new id
                write_model(path, b"trained")
                (path / COMPLETE_MARKER).write_text(json.dumps({"weights_id": new_weights_id()}))
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f"{name} from {model_identity(part.model)}\n")
        return {"kept_conversations": 1, "pairs_kept": 1, "t_max": 10}

    return run


@pytest.fixture
def ran(monkeypatch) -> list:
    calls: list = []
    for name in {stage for order in TRAINER_STAGES.values() for stage in order}:
        monkeypatch.setattr(stages, name, fake_stage(name, calls))
    monkeypatch.setattr(loop, "check_env", lambda env, role: None)
    monkeypatch.setattr(loop, "write_iteration_report", lambda *args: None)  # plots: slow, not tested here
    return calls


def run(tmp_path: Path, method: str, **overrides) -> None:
    recipe = make_recipe(tmp_path, method, **overrides)
    loop.run_loop(build_run(recipe, {"train": TRAIN_ENV}, gpu=False))


def every_stage(method: str, iterations=(0, 1)) -> list:
    return [(i, part, stage) for i in iterations for part, stages in PARTS[method] for stage in stages]


# (method, the changed field, the stages that must run again; every other stage must not)
CASES = [
    ("sft", {"initial_epsilon": 0.7}, [(0, None, "select"), (0, None, "train"), *every_stage("sft", [1])]),
    ("sft", {"lambda1": -0.3}, [(0, None, s) for s in SFT[1:]] + every_stage("sft", [1])),
    ("sft", {"initial_model_path": "other"}, every_stage("sft")),
    ("sft", {"thread_count": 3}, []),  # how fast, not what: nothing is redone
    ("dpo", {"initial_model_path": "other"}, every_stage("dpo")),  # the probe, trees and pairs too
    ("dpo", {"initial_dpo_epsilon": 0.3}, [(0, None, "pairs"), (0, None, "train"), *every_stage("dpo", [1])]),
    ("dpo", {"lambda2": 0.5}, [(0, None, s) for s in DPO[1:]] + every_stage("dpo", [1])),
    (
        "sft_dpo",
        {"initial_dpo_epsilon": 0.3},
        [(0, "dpo", "pairs"), (0, "dpo", "train"), *every_stage("sft_dpo", [1])],
    ),
    (
        "sft_dpo",
        {"initial_epsilon": 0.7},
        [(0, "sft", "select"), (0, "sft", "train"), *[(0, "dpo", s) for s in DPO], *every_stage("sft_dpo", [1])],
    ),
]


@pytest.mark.parametrize(("method", "change", "redone"), CASES, ids=lambda v: str(v)[:40])
def test_a_changed_field_redoes_what_depends_on_it_across_iterations(tmp_path, ran, caplog, method, change, redone):
    base = write_model(tmp_path / "base_model", b"base")
    write_model(tmp_path / "other", b"other weights")
    run(tmp_path, method)
    assert ran == every_stage(method)
    ran.clear()
    run(tmp_path, method)
    assert ran == []  # a finished run is a no-op
    if "initial_model_path" in change:
        change = {"initial_model_path": str(tmp_path / change["initial_model_path"])}
    with caplog.at_level(logging.WARNING, logger="optima.lineage"):
        run(tmp_path, method, **change)
    assert ran == redone
    if redone:  # the warning names why: the field that changed, or the model that changed under the stage
        assert any(name in caplog.text for name in change) or "served model" in caplog.text
    ran.clear()
    run(tmp_path, method, **change)
    assert ran == [] and base.is_dir()


def test_samples_of_a_redone_iteration_are_kept_aside(tmp_path, ran, caplog):
    write_model(tmp_path / "base_model", b"base")
    run(tmp_path, "sft")
    second = tmp_path / "run" / "iteration_1"
    old = (second / "generations.jsonl").read_text()
    old_checkpoint = (tmp_path / "run" / "checkpoints" / "iteration_1" / COMPLETE_MARKER).read_text()
    with caplog.at_level(logging.WARNING):
        run(tmp_path, "sft", initial_epsilon=0.7)
    # Iteration 2 chains to the redone iteration 1: its folder and checkpoint went aside as a whole, not deleted.
    (kept,) = (tmp_path / "run" / "set_aside").glob("old-lineage-*/iteration_1")
    assert (kept / "generations.jsonl").read_text() == old
    (checkpoint,) = (tmp_path / "run" / "checkpoints" / "set_aside").glob("old-lineage-*/iteration_1")
    assert (checkpoint / COMPLETE_MARKER).read_text() == old_checkpoint
    assert (second / "generations.jsonl").read_text() != old  # sampled from the retrained checkpoint
    assert "initial_epsilon: 0.5 -> 0.7" in caplog.text and "set aside" in caplog.text


def test_a_checkpoint_replaced_in_place_redoes_the_iterations_after_it(tmp_path, ran):
    """Weights rewritten under the same path (e.g. retrained by hand) are a new model for iteration 2."""
    write_model(tmp_path / "base_model", b"base")
    run(tmp_path, "sft")
    ran.clear()
    marker = tmp_path / "run" / "checkpoints" / "iteration_0" / COMPLETE_MARKER
    marker.write_text(json.dumps({"weights_id": new_weights_id()}))
    run(tmp_path, "sft")
    assert ran == every_stage("sft", [1])


def with_metrics(monkeypatch) -> None:
    """Each part writes its ``metrics.json`` (the report's rows), without the plots of the real report."""
    from optima.store import write_json

    def write(part, trained):
        write_json(part.sp.metrics, {"iteration": part.iteration} | loop.iteration_metrics(part.manifest))

    monkeypatch.setattr(loop, "write_iteration_report", write)


def test_iterations_beyond_iteration_times_are_set_aside(tmp_path, ran, monkeypatch):
    """Three iterations, then a rerun with two and another epsilon: no row, checkpoint or log of the third is read."""
    from optima.lineage import lineage_checkpoints
    from optima.reporting import find_metrics

    with_metrics(monkeypatch)
    write_model(tmp_path / "base_model", b"base")
    run(tmp_path, "sft", iteration_times=3)
    run_dir = tmp_path / "run"
    old_third = (run_dir / "iteration_2" / "generations.jsonl").read_text()
    run(tmp_path, "sft", iteration_times=2, initial_epsilon=0.7)
    assert not (run_dir / "iteration_2").exists() and not (run_dir / "checkpoints" / "iteration_2").exists()
    (kept,) = run_dir.glob("set_aside/beyond-iteration_times-2-*/iteration_2")
    assert (kept / "generations.jsonl").read_text() == old_third  # moved, never deleted
    assert list(run_dir.glob("checkpoints/set_aside/beyond-iteration_times-2-*/iteration_2"))
    assert [iteration for iteration, _, _ in find_metrics(run_dir)] == [0, 1]  # the report's rows
    assert [name for name, _ in lineage_checkpoints(run_dir / "checkpoints")] == ["iteration_0", "iteration_1"]


def test_readers_skip_what_an_earlier_lineage_left(tmp_path, ran, monkeypatch, caplog):
    """A folder holding an earlier run's third iteration (as older versions left it): the report, the browser, the
    hub upload and the sweep follow the key chain and stop where it breaks."""
    from optima.browser.collect import stage_folders
    from optima.hub import dataset_folders
    from optima.lineage import lineage_checkpoints
    from optima.paths import RunPaths
    from optima.reporting import find_metrics

    with_metrics(monkeypatch)
    write_model(tmp_path / "base_model", b"base")
    run(tmp_path, "sft", iteration_times=3)
    run(tmp_path, "sft", iteration_times=2, initial_epsilon=0.7)
    run_dir = tmp_path / "run"
    for stale in run_dir.glob("**/set_aside/beyond-iteration_times-2-*/iteration_2"):  # put the leftovers back
        stale.rename(stale.parent.parent.parent / "iteration_2")
    assert (run_dir / "iteration_2" / "metrics.json").is_file() and (run_dir / "checkpoints" / "iteration_2").is_dir()
    for iteration in (0, 1, 2):  # datasets as the hub upload finds them
        (run_dir / f"iteration_{iteration}" / "dataset").unlink()
        (run_dir / f"iteration_{iteration}" / "dataset").mkdir()
        (run_dir / f"iteration_{iteration}" / "dataset" / "dataset_dict.json").write_text("{}")
    assert [iteration for iteration, _, _ in find_metrics(run_dir)] == [0, 1]  # the report's rows
    assert [iteration for iteration, _, _ in stage_folders(run_dir)] == [0, 1]
    assert [name for name, _ in dataset_folders(RunPaths(run_dir))] == ["iteration_0", "iteration_1"]
    with caplog.at_level(logging.WARNING):
        names = [name for name, _ in lineage_checkpoints(run_dir / "checkpoints")]
    assert names == ["iteration_0", "iteration_1"] and "iteration_2: not written by the current lineage" in caplog.text


def test_a_second_run_cannot_write_the_same_folder(tmp_path, ran):
    from optima.lineage import LOCK_FILE

    write_model(tmp_path / "base_model", b"base")
    (tmp_path / "run").mkdir()
    holder = {"pid": os.getppid(), "host": socket.gethostname(), "started": None}  # a live process, not this one
    (tmp_path / "run" / LOCK_FILE).write_text(json.dumps(holder))
    with pytest.raises(
        RuntimeError, match=rf"{tmp_path / 'run'} is being written by another run \(pid {os.getppid()}"
    ):
        run(tmp_path, "sft")
    assert ran == []  # nothing ran, nothing was written


def write_arc_train(root: Path, question: str) -> Path:
    folder = root / "arc_challenge"
    folder.mkdir(parents=True, exist_ok=True)
    row = {"id": "q0", "question": question, "choices": {"text": ["3", "4"], "label": ["A", "B"]}, "answerKey": "B"}
    (folder / "train.jsonl").write_text(json.dumps(row) + "\n")
    return root


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_rewritten_training_data_redoes_the_run(tmp_path, ran, method):
    """The same ``data_dir`` with another ``train.jsonl``: every stage samples other questions, so all are redone."""
    write_model(tmp_path / "base_model", b"base")
    data = write_arc_train(tmp_path / "data", "What is 2 + 2?")
    run(tmp_path, method, data_dir=str(data))
    ran.clear()
    write_arc_train(data, "What is 2 + 3?")
    run(tmp_path, method, data_dir=str(data))
    assert ran == every_stage(method)


def test_changed_role_prompts_redo_the_run(tmp_path, ran, monkeypatch):
    """The role prompts live in code: a new wording is a new input of every stage that samples conversations."""
    from optima.agents import prompts

    write_model(tmp_path / "base_model", b"base")
    run(tmp_path, "sft")
    ran.clear()
    solver, critic = prompts.ROLE_PROMPTS["choice"]
    reworded = dataclasses.replace(solver, reminder=solver.reminder + " Be brief.")
    monkeypatch.setitem(prompts.ROLE_PROMPTS, "choice", (reworded, critic))
    run(tmp_path, "sft")
    assert ran == every_stage("sft")


def test_a_new_parser_rescores_without_sampling_again(tmp_path, ran, monkeypatch):
    """Generations keep their text (re-parsed when read); the stages that score answers are redone."""
    write_model(tmp_path / "base_model", b"base")
    run(tmp_path, "sft")
    ran.clear()
    monkeypatch.setattr(loop, "PARSER_VERSION", loop.PARSER_VERSION + 1)
    run(tmp_path, "sft")
    assert ran == [(0, None, s) for s in SFT[1:]] + every_stage("sft", [1])
