"""What a run folder holds: the lock of a run folder, what is set aside, the checkpoints of the current lineage."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optima.hub import dataset_folders
from optima.identity import COMPLETE_MARKER
from optima.lineage import LOCK_FILE, lineage_checkpoints, run_lock, set_aside
from optima.paths import RunPaths


def hold(folder, pid: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": None}))


def test_the_lock_names_the_folder_and_the_live_holder(tmp_path):
    hold(tmp_path, os.getppid())  # a live process that is not this one
    with pytest.raises(RuntimeError, match=rf"{tmp_path} is being written by another run \(pid {os.getppid()} on"):
        with run_lock(tmp_path):
            pass
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getppid()  # the holder's lock stays


def test_a_lock_of_a_process_that_is_gone_is_taken_over(tmp_path, caplog):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    hold(tmp_path, int(gone.stdout))
    with run_lock(tmp_path) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        with run_lock(tmp_path):  # the same process again (an outer run): allowed, and the outer one releases
            pass
        assert lock.is_file()
    assert not lock.exists() and f"taking over the lock of pid {int(gone.stdout)}" in caplog.text


def test_set_aside_moves_and_says_why(tmp_path):
    (tmp_path / "rewarded.jsonl").write_text("old\n")
    (moved,) = set_aside([tmp_path / "rewarded.jsonl", tmp_path / "absent"], "score-abc", {"reasons": ["lambda1"]})
    assert moved.read_text() == "old\n" and moved.parent.name.startswith("score-abc-")
    assert moved.parent.parent == tmp_path / "set_aside"
    assert json.loads((moved.parent / "why.json").read_text()) == {"reasons": ["lambda1"]}


def write_part(run, iteration: int, weights_id: str | None, finished: bool = True) -> None:
    """A part whose train stage recorded ``weights_id``, and the checkpoint it wrote."""
    folder = run / f"iteration_{iteration}"
    folder.mkdir(parents=True)
    previous = {"previous stage": f"iteration_{iteration - 1}/train@id{iteration - 1}"} if iteration else {}
    train = {"inputs": previous, "identity": f"id{iteration}"} | (
        {"result": {"weights_id": weights_id}} if finished else {}
    )
    (folder / "manifest.json").write_text(json.dumps({"stages": {"train": train}}))
    checkpoint = run / "checkpoints" / f"iteration_{iteration}"
    checkpoint.mkdir(parents=True)
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps({"weights_id": f"w{iteration}"}))


def test_only_the_checkpoints_the_lineage_recorded_are_swept(tmp_path):
    write_part(tmp_path, 0, "w0")
    write_part(tmp_path, 1, "replaced")  # the manifest recorded other weights: this checkpoint is not its
    write_part(tmp_path, 2, None, finished=False)  # training started under the lineage's key, then stopped
    assert [name for name, _ in lineage_checkpoints(tmp_path / "checkpoints")] == ["iteration_0", "iteration_2"]


def test_the_hub_upload_never_finds_a_set_aside_training_set(tmp_path):
    for folder in ("iteration_0/dataset", "iteration_0/set_aside/select-abc-1/dataset"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "dataset_dict.json").write_text("{}")
    assert dataset_folders(RunPaths(tmp_path)) == [("iteration_0", tmp_path / "iteration_0" / "dataset")]


def test_a_lock_of_a_killed_child_not_yet_reaped_is_taken_over(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    stat, deadline = Path(f"/proc/{child.pid}/stat"), time.monotonic() + 30
    while stat.read_text().rpartition(")")[2].split()[0] != "Z":  # exited, not reaped: a zombie
        assert time.monotonic() < deadline
        time.sleep(0.01)
    hold(tmp_path, child.pid)
    with run_lock(tmp_path) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    child.wait()
