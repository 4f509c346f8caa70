"""What the hardware allocation refuses and how (issue 32, items 4, 8 and 9): memory unknown, the single-process
config, every problem listed, and setup's Python version check. Memory itself is the engines' to check.

Pure functions only: the allocation reads the recipes, the trainer YAMLs and the built-in model table.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from optima import install
from optima.config import RecipeError, SFTRecipe, load_recipe
from optima.hardware.allocation import allocate_hardware
from optima.hardware.machine import Hardware, detect_hardware, parse_hardware
from optima.training.launch_config import launch_for
from tests.test_hardware_allocation import VENV

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def sft(**overrides):
    return load_recipe(SFTRecipe, REPO / "train/sft_recipes/arc.yaml", overrides, check_paths=False)


def test_gpus_of_unknown_memory_are_refused_naming_hardware_not_divided_by(tmp_path):
    """CUDA_VISIBLE_DEVICES set, no nvidia-smi (a compute-only container): memory reads 0 GiB, and the loss share
    was ``need / 0`` (ZeroDivisionError). Now one refusal naming --hardware."""
    hardware = detect_hardware({"PATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": "0,1"})
    assert hardware.has_gpu and hardware.gpu_gib == 0 and hardware.source == "memory unknown"
    allocation = allocate_hardware(sft(), hardware, [0])
    assert (
        len(allocation.problems) == 1
        and "--hardware" in allocation.problems[0]
        and "memory is unknown" in allocation.problems[0]
    )
    with pytest.raises(RecipeError, match="--hardware 2x80GB"):
        allocation.check()


def test_single_gpu_config_is_planned_as_one_process():
    """accelerate's simple launcher (distributed_type NO) starts one process whatever --num_processes says."""
    recipe = sft(accelerate_config="single_gpu", loss_placement="after")
    allocation = allocate_hardware(recipe, parse_hardware("8x80GB"), [0])
    assert allocation.training.num_processes == 1 and allocation.training.nodes[0].gpus == ("0",)
    argv = launch_for(recipe, "sft", VENV, Path("/t.yaml"), True, allocation.training).argv()
    assert argv[argv.index("--num_processes") + 1] == "1"
    assert any(line.startswith("training: single,") for line in allocation.lines)


def test_single_gpu_config_on_several_nodes_is_refused():
    recipe = sft(accelerate_config="single_gpu", loss_placement="after", train_launcher="srun")
    allocation = allocate_hardware(recipe, parse_hardware("2x8x80GB"), [0])
    assert any("single_gpu (distributed_type NO) runs one process on one node" in p for p in allocation.problems)


def test_every_problem_is_listed_not_only_the_first():
    """Sleep mode's routes on a public address and a loss server on a policy GPU: both refused in one message."""
    recipe = sft(host="10.0.0.5", api_key="k", loss_devices=[3])
    allocation = allocate_hardware(recipe, parse_hardware("8x80GB"), [0])
    assert [p.split(":")[0] for p in allocation.problems] == [
        "host '10.0.0.5'",
        "loss_devices [3] overlap the policy's GPUs on GPU 3",
    ]
    with pytest.raises(RecipeError) as raised:
        allocation.check()
    assert "2 problems: (1) host '10.0.0.5':" in str(raised.value) and "(2) loss_devices [3]" in str(raised.value)


def test_memory_is_left_to_the_engines():
    """A share too small for the weights and a trainer too big for its GPU are vLLM's and the preflight's to refuse
    (they were estimated here): the plan places them and says what it leaves to the engines."""
    allocation = allocate_hardware(sft(loss_gpu_memory_utilization=0.01), Hardware(1, 8, 24.0, source="test"), [0])
    assert not allocation.problems and allocation.layout.loss.gpu_memory_utilization == 0.01
    assert allocation.training.num_processes == 4
    assert any(line.startswith("      left to the engines: vLLM checks") for line in allocation.render())


@pytest.mark.parametrize(("version", "refused"), [((3, 10, 12), True), ((3, 11, 0), False), ((3, 13, 1), False)])
def test_setup_checks_the_python_version(version, refused):
    if refused:
        with pytest.raises(install.SetupError, match=r"Python 3\.10\.12 \(/usr/bin/python3\) is too old.*>= 3\.11"):
            install.check_python(version, "/usr/bin/python3")
    else:
        install.check_python(version, "/usr/bin/python3")


def test_gpu_check_refuses_an_old_python_before_importing_what_needs_a_newer_one(tmp_path):
    """``make gpu-check`` runs the system's python3 (3.10 on Ubuntu 22.04): a clear refusal, not an ImportError of
    ``enum.StrEnum`` from ``optima.config``'s imports."""
    code = (
        "import sys, optima.install; from dev.gpu_check import main; sys.version_info = (3, 10, 12, 'final', 0); "
        f"code = main(['--dry-run', '--output-dir', {str(tmp_path / 'o')!r}]); "
        "print('optima.cli' in sys.modules, 'optima.config.loading' in sys.modules); raise SystemExit(code)"
    )
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stdout.split() == ["False", "False"]  # refused before optima.cli was imported
    assert re.search(
        r"gpu-check: Python 3\.10\.12 .* too old: Optima needs Python >= 3\.11\. Run gpu-check", result.stderr
    )
    assert "make gpu-check PYTHON=python3.11" in result.stderr and not (tmp_path / "o").exists()


def test_setup_stops_before_building_on_an_old_python(tmp_path, monkeypatch, capsys):
    from optima.__main__ import main

    monkeypatch.setattr(install.sys, "version_info", (3, 10, 12, "final", 0))
    monkeypatch.setattr(install, "ensure_env", lambda *a: pytest.fail("an environment was built"))
    assert main(["setup", "--venvs-dir", str(tmp_path), "--no-model"]) == 2
    assert "setup stopped: Python 3.10.12" in capsys.readouterr().err  # main's logging writes to stderr
