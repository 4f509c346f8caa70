"""The five top-level scripts: --help, --dry-run of every shipped recipe, one clear error for bad input."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import mark_finished

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ("sft_script", "dpo_script", "sft_dpo_script", "inference_script", "multi_sc_data_generate_script")
LOOP_SCRIPT = {"sft_recipes": "sft_script", "dpo_recipes": "dpo_script", "sft_dpo_recipes": "sft_dpo_script"}
SHIPPED = sorted((REPO / "train").glob("*_recipes/*.yaml"))


def load_script(name: str):
    return importlib.import_module(name)


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.fixture
def envs(tmp_path_factory) -> list[str]:
    """Both environment flags pointing at this interpreter (single-env mode)."""
    return ["--vllm_env", sys.executable, "--alignment_env", sys.executable]


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as info:
        load_script(name).main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--dry-run" in out and "python " + name + ".py" in out


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_stay_thin(name):
    assert len((REPO / f"{name}.py").read_text().splitlines()) <= 60


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_dry_run_of_every_shipped_recipe(path, in_repo, envs, capsys):
    code = load_script(LOOP_SCRIPT[path.parent.name]).main(["--train_config_path", str(path), *envs, "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "plan:" in out and "iteration 1/" in out
    for stage in ("[serve]", "[train]", "accelerate.commands.launch"):
        assert stage in out
    assert ("[generate]" in out) == (path.parent.name != "dpo_recipes")
    assert ("[search]" in out) == (path.parent.name != "sft_recipes")


def test_dry_run_shows_iterations_models_and_commands(in_repo, envs, capsys):
    path = REPO / "train/sft_recipes/demo_arc.yaml"
    assert load_script("sft_script").main(["--train_config_path", str(path), *envs, "--dry-run"]) == 0
    out = capsys.readouterr().out
    run = REPO / "runs/demo_arc_sft"
    assert "iteration 2/2" in out
    assert f"model: {run}/checkpoints/iteration_0" in out  # iteration 2 serves iteration 1's output
    assert f"{run}/iteration_1/trainer.yaml" in out
    assert "temperature: 0.3" in out and "temperature: 0.7" in out  # docs/method.md#sampling-schedule
    assert "[ok]" in out


def test_dry_run_skip_iteration(in_repo, envs, capsys):
    path = REPO / "train/sft_recipes/demo_arc.yaml"
    argv = ["--train_config_path", str(path), *envs, "--dry-run", "--skip_iteration", "1"]
    assert load_script("sft_script").main(argv) == 0
    assert "[skip]" in capsys.readouterr().out


MISSING_START = ["--set", "initial_model_path=./runs/never_trained/checkpoints/iteration_0"]


def test_dry_run_reports_missing_inputs_without_failing(in_repo, envs, capsys):
    path = REPO / "train/dpo_recipes/demo_arc.yaml"  # starts from a checkpoint that may not exist yet
    assert load_script("dpo_script").main(["--train_config_path", str(path), *envs, *MISSING_START, "--dry-run"]) == 0
    assert "MISSING" in capsys.readouterr().out


def test_real_run_with_missing_input_fails_before_starting(in_repo, envs, capsys):
    path = REPO / "train/dpo_recipes/demo_arc.yaml"
    assert load_script("dpo_script").main(["--train_config_path", str(path), *envs, *MISSING_START]) == 2
    assert "initial_model_path: input path does not exist" in capsys.readouterr().err


def test_bad_recipe_exits_2_with_one_message(tmp_path, envs, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset_type: arc\ninitial_model_path: org/m\norigin_yaml_path: x.yaml\nexplor_count: 3\n")
    assert load_script("sft_script").main(["--train_config_path", str(bad), *envs, "--dry-run"]) == 2
    assert f"{bad}: explor_count: unknown key" in capsys.readouterr().err


def test_bad_environment_exits_2(in_repo, capsys):
    path = REPO / "train/sft_recipes/demo_arc.yaml"
    argv = ["--train_config_path", str(path), "--vllm_env", "./no/env", "--alignment_env", sys.executable, "--dry-run"]
    assert load_script("sft_script").main(argv) == 2
    assert "--vllm_env './no/env': no such file or directory" in capsys.readouterr().err


def test_set_overrides_reach_the_plan(in_repo, envs, capsys):
    path = REPO / "train/sft_recipes/demo_arc.yaml"
    argv = ["--train_config_path", str(path), *envs, "--dry-run", "--set", "iteration_times=3", "--set", "port=9100"]
    assert load_script("sft_script").main(argv) == 0
    out = capsys.readouterr().out
    assert "iteration 3/3" in out and "first port: 9100" in out


def test_inference_dry_run_lists_checkpoints_in_numeric_order(tmp_path, capsys):
    for k in (10, 2, 0):
        mark_finished(tmp_path / f"iteration_{k}")
    argv = [
        "--model_root_path",
        str(tmp_path),
        "--dataset_type",
        "arc",
        "--vllm_env",
        sys.executable,
        "--device",
        "0,1",
        "--num_thread",
        "8",
        "--limit",
        "5",
        "--dry-run",
    ]
    assert load_script("inference_script").main(argv) == 0
    out = capsys.readouterr().out
    order = [out.index(f"[iteration_{k}]") for k in (0, 2, 10)]
    assert order == sorted(order) and "5 (a seeded sample stratified" in out and "greedy" in out


def test_multi_sc_dry_run(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    argv = [
        "--model_path",
        str(tmp_path),
        "--dataset_type",
        "gsm8k",
        "--temperature",
        "0.7",
        "--num_samples",
        "8",
        "--vllm_env",
        sys.executable,
        "--dry-run",
    ]
    assert load_script("multi_sc_data_generate_script").main(argv) == 0
    out = capsys.readouterr().out
    assert "8 conversations per question at temperature 0.7" in out and f"[{tmp_path.name}]" in out


def test_scripts_run_as_commands(in_repo):
    """The README's command form, in a fresh interpreter (no test-only import paths)."""
    argv = [
        sys.executable,
        "sft_script.py",
        "--train_config_path",
        "train/sft_recipes/gsm8k.yaml",
        "--vllm_env",
        sys.executable,
        "--alignment_env",
        sys.executable,
        "--dry-run",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    assert "deepspeed_zero3.yaml" in out.stdout and "temperature: 0.7" in out.stdout  # gsm8k starts at 0.7


def test_dry_run_shows_process_count_and_multi_node_flags(in_repo, envs, capsys):
    path = REPO / "train/sft_recipes/arc.yaml"
    extra = ["--set", "num_processes=16", "--set", "train_launcher=srun", "--hardware", "2x8x141GB"]
    assert load_script("sft_script").main(["--train_config_path", str(path), *envs, *extra, "--dry-run"]) == 0
    out = capsys.readouterr().out
    # 4 per node: the released global batch 16 is a multiple of 8 processes, not 14 (docs/gpu.md#the-global-batch)
    assert "srun --nodes 2 --ntasks 2 --ntasks-per-node 1 --cpus-per-task " in out
    assert "--overlap --kill-on-bad-exit=1 env CUDA_VISIBLE_DEVICES=1,2,3,4 bash -c " in out
    assert "--num_processes 8 --num_machines 2 --main_process_ip " in out
    assert "sft global batch 16 = 1 per device x 2 accumulation x 8 processes" in out
