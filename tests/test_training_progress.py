"""The training progress bar: fed from the trainer's state file, drawn while a (fake) trainer runs; --quiet."""

from __future__ import annotations

import io

import pytest

from optima.environments import resolve_env
from optima.hardware.machine import ACCELERATE_CONFIGS
from optima.training.common import STATE_ENV, state_callback
from optima.training.launch import STATE_FILE, console_stream, read_state, run_training
from optima.training.launch_config import TrainLaunch

# A fake trainer: the training env's "python" writes states to $OPTIMA_TRAINER_STATE, like the callback: a resumed
# trainer at step 40 of 50 (nothing logged yet), then steps 41 and 42 with their losses.
FAKE_TRAINER = """#!/bin/sh
echo "fake trainer: $*"
if [ -e "$OPTIMA_TRAINER_STATE" ]; then echo "stale state present"; fi
for step in 40 41 42; do
  loss=""; if [ "$step" != 40 ]; then loss='{"loss": 0.'$step'}'; fi
  printf '{"global_step": %s, "max_steps": 50, "log_history": [%s]}' "$step" "$loss" > "$OPTIMA_TRAINER_STATE.tmp"
  mv "$OPTIMA_TRAINER_STATE.tmp" "$OPTIMA_TRAINER_STATE"
  sleep 1.2  # a training step, longer than the bar's poll interval
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
    assert "train iteration 2 sft" in text and "40/50" in text and "42/50" in text and "loss=0.42" in text
    assert "0/50" not in text.replace("40/50", "")  # a resumed trainer's bar starts at its step
    assert "<" in text.split("42/50")[-1]  # elapsed<remaining: the ETA
    assert "9/9" not in text and "stale state present" not in log.read_text()  # removed before the start
    assert "fake trainer" in log.read_text() and "fake trainer" not in text  # its output stays in the log


def test_quiet_draws_nothing_and_the_state_is_still_written(fake_launch, tmp_path, capfd):
    log = tmp_path / "logs" / "train.log"
    run_training(fake_launch, log, progress=None)
    assert read_state(log.parent / STATE_FILE)["global_step"] == 42
    captured = capfd.readouterr()
    assert "/50" not in captured.err + captured.out
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
    assert (written["global_step"], written["max_steps"], written["log_history"]) == (4, 8, [{"loss": 1.5, "step": 4}])
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow
def test_the_real_sft_trainer_writes_its_state_every_step(tiny_model, tmp_path, monkeypatch):
    import yaml

    from optima.store import save_splits
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
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(losses) == 3 and all(isinstance(loss, float) for loss in losses)  # one per step (logging_steps 1)
