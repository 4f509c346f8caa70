"""``make gpu-check`` (``python3 -m optima gpu-check``): its dry run, and that the loop scripts accept what it passes.

The check itself needs an NVIDIA GPU; here only its plan is tested: the stages, their order and settings, nothing
written, and each loop command validated by the script's own ``--dry-run`` (recipe overrides, trainer YAMLs).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from optima.cli import gpu_check
from tests.conftest import REPO


def test_dry_run_prints_the_stages_and_starts_nothing(tmp_path, capsys):
    out = tmp_path / "gpu_check"
    assert gpu_check.run_gpu_check_command(["--dry-run", "--output-dir", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = ["setup", "trainer-yamls", "plan", "isft", "idpo", "reload"]
    assert [line.split(":")[0] for line in lines[1:]] == names
    assert "'bf16': True" in lines[0] and "'attn_implementation': 'flash_attention_2'" in lines[0]
    settings = "--set iteration_times=1 --set accelerate_config=deepspeed_zero3 --set num_processes=1"
    for stage in lines[3:6]:
        assert settings + " --set loss_placement=after" in stage
    assert lines[3].endswith("--dry-run") and lines[4] == lines[3].removesuffix(" --dry-run").replace(
        "plan", "isft", 1
    )
    assert f"initial_model_path={out}/isft/checkpoints/iteration_0" in lines[5]
    assert lines[6].endswith(f"--reload {out}/isft/checkpoints/iteration_0 {out}/idpo/checkpoints/iteration_0")
    assert not out.exists()


@pytest.mark.parametrize(("hardware", "feasible"), [("1x80GB", True), ("2x80GB", True), ("1x2GB", False)])
def test_dry_run_on_given_hardware_prints_the_planners_plan(hardware, feasible, tmp_path, capsys):
    """The plan step is the planner's: one GPU is enough (loss model served after generation, not kept beside)."""
    argv = ["--dry-run", "--hardware", hardware, "--output-dir", str(tmp_path / "o")]
    assert gpu_check.run_gpu_check_command(argv) == 0
    out = capsys.readouterr().out
    assert f"--dry-run --hardware {hardware}" in out
    assert ("plan: feasible" in out) is feasible and "training: zero3, 1 process(es)" in out


def test_skip_setup_drops_the_setup_stage(tmp_path):
    stages = gpu_check.build_stages(tmp_path, skip_setup=True)
    assert [name for name, _ in stages] == ["trainer-yamls", "plan", "isft", "idpo", "reload"]


@pytest.mark.parametrize("stage", ["isft", "idpo"])
def test_the_loop_scripts_accept_the_gpu_settings(stage, tmp_path, capsys, monkeypatch):
    assert gpu_check.run_gpu_check_command(["--write-trainer-yamls", str(tmp_path)]) == 0  # the stage before
    command = dict(gpu_check.build_stages(tmp_path, skip_setup=True))[stage]
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO))
    script = importlib.util.spec_from_file_location(stage, REPO / command[1])
    module = importlib.util.module_from_spec(script)
    script.loader.exec_module(module)
    assert module.main([*command[2:], "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "accelerate_configs/deepspeed_zero3.yaml --num_processes 1" in plan
    assert f"trainer_{stage[1:]}_gpu.yaml" in plan


def test_the_check_starts_before_set_up_with_the_standard_library_only(tmp_path):
    """make gpu-check runs `python3 -m optima gpu-check` before any environment exists (`-S`: no site-packages)."""
    argv = [sys.executable, "-S", "-m", "optima", "gpu-check", "--dry-run", "--output-dir", str(tmp_path / "o")]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "trainer-yamls: " in result.stdout and "-m optima gpu-check --write-trainer-yamls" in result.stdout


def test_stages_run_in_order_each_logged_and_the_first_failure_stops_the_check(tmp_path, capsys):
    stages = [
        ("one", [sys.executable, "-c", "print('first')"]),
        ("two", [sys.executable, "-c", "raise SystemExit(3)"]),
        ("three", [sys.executable, "-c", "open('three-ran', 'w')"]),
    ]
    times, failure = gpu_check.run_stages(stages, tmp_path)
    assert list(times) == ["one", "two"] and failure == f"two exited with 3, see {tmp_path / 'two.log'}"
    assert (tmp_path / "one.log").read_text() == "first\n" and not (REPO / "three-ran").exists()
    assert re.search(r"gpu-check \| two \| \d+ s \| exit 3", capsys.readouterr().out)
