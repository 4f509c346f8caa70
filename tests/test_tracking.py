"""Tracking: TensorBoard scalars through tensorboardX, and W&B (offline) for the driver and the trainers."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optima.reporting import collect_rows, publish_iteration
from optima.tracking import RUN_FILE, log_rows, row_key, run_record, scalars_of, trainer_env, write_tensorboard_scalars
from tests.test_reporting import sft_run  # noqa: F401  (a fixture)

# ---------------------------------------------------------------- TensorBoard


def _write_with_event_file_writer(folder: Path, rows: list[dict]) -> None:
    """How ``write_tensorboard_scalars`` wrote before tensorboardX (tensorboard's internal writer): the reference."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(folder))
    for row in rows:
        values = [summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in scalars_of(row).items()]
        summary = summary_pb2.Summary(value=values)
        writer.add_event(event_pb2.Event(wall_time=time.time(), step=row["iteration"], summary=summary))
    writer.close()


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboardx_scalars_read_back_as_the_event_file_writer_wrote_them(sft_run, tmp_path):  # noqa: F811
    rows = collect_rows(sft_run)
    reference = tmp_path / "reference"
    _write_with_event_file_writer(reference, rows)
    folder = write_tensorboard_scalars(sft_run, rows)
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1
    written = _scalars(folder)
    assert written == _scalars(reference)
    assert written["conversations/mean_tokens"] == [(0, 150.0), (1, 50.0)]
    assert len(written) > 10  # every group: conversations, train, reward parts, stage times


# ---------------------------------------------------------------- W&B, offline


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    """wandb in offline mode, its settings and caches under ``tmp_path``, no W&B variable of the caller's."""
    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))


def offline_records(run_dir: Path, run_id: str) -> list:
    """Every record of the offline W&B runs with ``run_id`` under ``run_dir`` (one folder per init), in order.

    The ``.wandb`` file is wandb's transaction log (LevelDB log framing: 32 KiB blocks of CRC-framed chunks) of
    wandb's own ``Record`` protobufs.
    """
    from wandb.proto import wandb_internal_pb2

    records = []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / f"run-{run_id}.wandb"))):
        data, pos, chunks = Path(path).read_bytes(), 7, []  # 7 bytes of file header (":W&B", magic, version)
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if left < 7 or (kind == 0 and length == 0):
                pos += left  # block trailer or padding
                continue
            chunks.append(data[pos + 7 : pos + 7 + length])
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST chunk: a whole record
                record = wandb_internal_pb2.Record()
                record.ParseFromString(b"".join(chunks))
                records.append(record)
                chunks = []
    return records


def logged_history(run_dir: Path, run_id: str) -> list[dict]:
    history = [r.history for r in offline_records(run_dir, run_id) if r.WhichOneof("record_type") == "history"]
    rows = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in h.item} for h in history]
    return [{key: value for key, value in row.items() if not key.startswith("_")} for row in rows]


def run_header(run_dir: Path, run_id: str):
    return next(r.run for r in offline_records(run_dir, run_id) if r.WhichOneof("record_type") == "run")


def test_driver_run_project_group_step_metric_and_backfill(sft_run, wandb_offline):  # noqa: F811
    rows = collect_rows(sft_run)
    # The run so far had iteration 0 only; a resumed run then finishes iteration 1.
    assert log_rows(sft_run, rows[:1]) == ["0"]
    assert log_rows(sft_run, rows[:1]) == []  # nothing new: no W&B run started
    assert log_rows(sft_run, rows) == ["1"]
    record = json.loads((sft_run / RUN_FILE).read_text())
    assert record["project"] == "optima" and record["group"] == "run_sft" and record["logged"] == ["0", "1"]
    header = run_header(sft_run, record["id"])
    assert (header.project, header.run_group, header.display_name) == ("optima", "run_sft", "run_sft")
    metrics = [r.metric for r in offline_records(sft_run, record["id"]) if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "iteration" for m in metrics)
    # one offline folder per init, named to the second: two inits in one second have no defined order
    history = sorted(logged_history(sft_run, record["id"]), key=lambda h: h["iteration"])
    assert [(h["iteration"], h["conversations/mean_tokens"]) for h in history] == [(0, 150.0), (1, 50.0)]
    assert history[1]["train/train_loss"] == 1.25


def test_rows_finished_before_wandb_was_on_are_backfilled(sft_run, wandb_offline, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WANDB_PROJECT", "my-project")
    publish_iteration(sft_run, ["wandb"])  # the run is resumed with wandb on: both finished iterations go
    record = run_record(sft_run)
    assert record["project"] == "my-project"
    assert run_header(sft_run, record["id"]).project == "my-project"
    assert [h["iteration"] for h in logged_history(sft_run, record["id"])] == [0, 1]


def test_reruns_get_their_own_id_and_a_resumed_run_keeps_it(tmp_path, wandb_offline):
    first, second = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert run_record(first)["id"] != run_record(second)["id"]  # same run name, different runs
    assert run_record(first)["id"] == run_record(first)["id"]  # read back from wandb_run.json


def test_trainer_env_routes_the_trainer_to_the_run(tmp_path, wandb_offline):
    run = tmp_path / "demo"
    env = trainer_env(["wandb", "tensorboard"], run, run / "iteration_1" / "dpo")
    run_id = run_record(run)["id"]
    assert env["WANDB_RUN_ID"] == f"{run_id}-iteration_1-dpo"
    assert (env["WANDB_PROJECT"], env["WANDB_RUN_GROUP"], env["WANDB_RESUME"]) == ("optima", "demo", "allow")
    assert env["TENSORBOARD_LOGGING_DIR"] == str(run / "tensorboard" / "iteration_1" / "dpo")
    assert "WANDB_RUN_ID" not in trainer_env(["tensorboard"], run, run / "iteration_0")


TRAINER_CALLBACK = """
import sys
import wandb
from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.integrations import WandbCallback

args = TrainingArguments(output_dir=sys.argv[1], report_to=["wandb"], run_name="demo/iteration_0", use_cpu=True)
state = TrainerState(global_step=1)
callback = WandbCallback()
callback.on_log(args, state, TrainerControl(), logs={"loss": 2.5})  # what the Trainer calls at each logging step
wandb.finish()
"""


@pytest.mark.slow
def test_the_trainers_wandb_callback_logs_into_the_runs_project_and_group(tmp_path, wandb_offline):
    run = tmp_path / "demo"
    env = os.environ | trainer_env(["wandb"], run, run / "iteration_0")
    subprocess.run([sys.executable, "-c", TRAINER_CALLBACK, str(tmp_path / "out")], env=env, check=True, timeout=300)
    trainer_id = f"{run_record(run)['id']}-iteration_0"
    header = run_header(run, trainer_id)
    assert (header.project, header.run_group, header.display_name) == ("optima", "demo", "demo/iteration_0")
    assert logged_history(run, trainer_id)[0]["train/loss"] == 2.5


def test_a_redone_iteration_is_a_new_row_for_wandb(sft_run):  # noqa: F811
    """A row names the key of its folder's last finished stage: an iteration redone under another key is sent again."""
    manifest = sft_run / "iteration_0" / "manifest.json"
    manifest.write_text(json.dumps({"stages": {"train": {"identity": "old0123456789ab", "result": {}}}}))
    before = [row_key(row) for row in collect_rows(sft_run)]
    manifest.write_text(json.dumps({"stages": {"train": {"identity": "new0123456789ab", "result": {}}}}))
    after = [row_key(row) for row in collect_rows(sft_run)]
    assert before == ["0@old012345678", "1"] and after == ["0@new012345678", "1"]
