"""The training progress bar: fed from the trainer's state file, drawn while a (fake) trainer runs; --quiet."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from optima.environments import resolve_env
from optima.hardware.accelerate import ACCELERATE_CONFIGS
from optima.training.launch import STATE_FILE, run_training
from optima.training.launch_config import TrainLaunch
from optima.training.progress import STATE_ENV, TrainingProgress, console_stream, last_loss, read_state, state_callback


def write_state(path: Path, step: int, max_steps: int, losses: list[float]) -> None:
    """A ``trainer_state.json`` as the Hugging Face ``Trainer`` writes it (the keys the bar reads)."""
    history = [{"loss": loss, "step": i + 1} for i, loss in enumerate(losses)]
    state = {"global_step": step, "max_steps": max_steps, "epoch": step / max_steps, "log_history": history}
    path.write_text(json.dumps(state))


def test_the_bar_follows_the_state_file(tmp_path):
    state, stream = tmp_path / "trainer_state.json", io.StringIO()
    progress = TrainingProgress(state, stream, "train iteration 1")
    progress.refresh()
    assert progress.bar is None  # nothing written yet: no bar
    write_state(state, 2, 10, [2.5, 2.0])
    progress.refresh()
    assert (progress.bar.n, progress.bar.total) == (2, 10)
    write_state(state, 6, 10, [2.5, 2.0, 1.25])
    progress.refresh()
    progress.bar.close()
    text = stream.getvalue()
    assert "train iteration 1" in text and "6/10" in text and "loss=1.25" in text and "epoch=0.60" in text
    assert "<" in text.split("6/10")[-1]  # elapsed<remaining: the ETA


def test_a_resumed_trainer_starts_the_bar_at_its_step(tmp_path):
    state = tmp_path / "trainer_state.json"
    write_state(state, 40, 50, [])
    progress = TrainingProgress(state, io.StringIO())
    progress.refresh()
    assert (progress.bar.n, progress.bar.initial) == (40, 40)
    assert last_loss(read_state(state)) is None


# A fake trainer: the training env's "python" writes three states to $OPTIMA_TRAINER_STATE, like the callback.
FAKE_TRAINER = """#!/bin/sh
echo "fake trainer: $*"
if [ -e "$OPTIMA_TRAINER_STATE" ]; then echo "stale state present"; fi
for step in 1 2 3; do
  printf '{"global_step": %s, "max_steps": 3, "epoch": 1.0, "log_history": [{"loss": 0.%s}]}' \\
    "$step" "$step" > "$OPTIMA_TRAINER_STATE.tmp"
  mv "$OPTIMA_TRAINER_STATE.tmp" "$OPTIMA_TRAINER_STATE"
  sleep 0.2  # a training step
done
"""


@pytest.fixture
def fake_launch(tmp_path) -> TrainLaunch:
    python = tmp_path / "env" / "python"
    python.parent.mkdir()
    python.write_text(FAKE_TRAINER)
    python.chmod(0o755)
    return TrainLaunch("sft", resolve_env(str(python), "train"), ACCELERATE_CONFIGS / "cpu.yaml", tmp_path / "t.yaml")


def test_run_training_draws_the_bar_while_the_trainer_runs(fake_launch, tmp_path):
    log, stream = tmp_path / "logs" / "train.log", io.StringIO()
    (log.parent).mkdir()
    (log.parent / STATE_FILE).write_text('{"global_step": 9, "max_steps": 9}')  # a killed attempt's state
    run_training(fake_launch, log, progress=stream, desc="train iteration 2 sft")
    text = stream.getvalue()
    assert "train iteration 2 sft" in text and "3/3" in text and "loss=0.3" in text
    assert "9/9" not in text and "stale state present" not in log.read_text()  # removed before the start
    assert "fake trainer" in log.read_text() and "fake trainer" not in text  # its output stays in the log


def test_quiet_draws_nothing_and_the_state_is_still_written(fake_launch, tmp_path, capfd):
    log = tmp_path / "logs" / "train.log"
    run_training(fake_launch, log, progress=None)
    assert read_state(log.parent / STATE_FILE)["global_step"] == 3
    captured = capfd.readouterr()
    assert "3/3" not in captured.err + captured.out
    assert console_stream(False) is None


def test_console_stream_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal (a log file, CI)
    assert console_stream(True) is None


def test_loop_scripts_accept_quiet():
    from optima.cli import build_loop_parser

    parser = build_loop_parser("x")
    assert parser.parse_args(["--train_config_path", "r.yaml", "--quiet"]).quiet is True
    assert parser.parse_args(["--train_config_path", "r.yaml"]).quiet is False


def test_the_trainer_callback_writes_the_state(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from transformers import TrainerState

    monkeypatch.delenv(STATE_ENV, raising=False)
    assert state_callback() is None  # not launched by the orchestrator: no file
    path = tmp_path / "trainer_state.json"
    monkeypatch.setenv(STATE_ENV, str(path))
    callback = state_callback()
    state = TrainerState(global_step=4, max_steps=8, epoch=0.5, log_history=[{"loss": 1.5, "step": 4}])
    callback.on_step_end(None, state, None)
    written = read_state(path)
    assert (written["global_step"], written["max_steps"], last_loss(written)) == (4, 8, 1.5)
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow
def test_the_real_sft_trainer_writes_its_state_every_step(tiny_model, tmp_path, monkeypatch):
    import yaml

    from optima.selection.io import save_splits
    from tests.test_dpo_train import run_trainer, write_config
    from tests.test_eval_split import RUN_SFT, SFT_ROWS

    save_splits({"train": SFT_ROWS, "test": []}, tmp_path / "data")
    config = yaml.safe_load(
        write_config(tmp_path / "base.yaml", tiny_model, tmp_path / "data", tmp_path / "out").read_text()
    )
    for key in ("beta", "max_prompt_length"):  # DPO-only settings
        config.pop(key)
    config |= {"max_steps": 3, "logging_steps": 1, "packing": False, "per_device_train_batch_size": 2}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    state_file = tmp_path / "trainer_state.json"
    monkeypatch.setenv(STATE_ENV, str(state_file))
    run_trainer(RUN_SFT, tmp_path / "sft.yaml", tmp_path / "train.log")
    state = read_state(state_file)
    assert (state["global_step"], state["max_steps"]) == (3, 3)
    assert isinstance(last_loss(state), float)
