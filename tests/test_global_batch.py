"""The paper's global batch on any number of training processes (issue 32, item 2; optima/hardware/allocation.py).

Each shipped Llama recipe on 8x80GB, 4x80GB and 2x8x80GB: the global batch it trains with equals the released one
(the trainer YAML's per-device batch x accumulation x the accelerate config's 8 processes), through the allocation's
process count and ``gradient_accumulation_steps``, or the allocation is refused with the reason. Pure but for the dry
runs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from optima.config import DPORecipe, SFTDPORecipe, SFTRecipe, load_recipe
from optima.config.rules import trainer_base_yaml
from optima.hardware.allocation import HardwareAllocation, TrainerBatch, allocate_hardware, processes_per_node
from optima.hardware.machine import parse_hardware
from optima.paths import RunPaths
from optima.run import Part, Run, train_settings
from tests.test_pipeline import TRAIN_ENV

REPO = Path(__file__).resolve().parent.parent
CLASSES = {"sft_recipes": SFTRecipe, "dpo_recipes": DPORecipe, "sft_dpo_recipes": SFTDPORecipe}
LLAMA = sorted(p for p in (REPO / "train").glob("*/*.yaml") if "demo" not in p.name)
MACHINES = {"8x80GB": {}, "4x80GB": {"devices": None}, "2x8x80GB": {"train_launcher": "srun"}}
LINE = re.compile(
    r"(sft|dpo) global batch (\d+) = (\d+) per device x (\d+) accumulation x (\d+) processes .* released (\d+)"
)


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def load(path: Path, **overrides):
    return load_recipe(CLASSES[path.parent.name], path, overrides, check_paths=False)


def released(recipe, kind: str) -> int:
    """The released global batch: the base YAML's per-device batch x accumulation x the original's 8 GPUs."""
    base = yaml.safe_load(Path(trainer_base_yaml(recipe, kind)).read_text())
    return base["per_device_train_batch_size"] * base["gradient_accumulation_steps"] * 8


@pytest.mark.parametrize("machine", sorted(MACHINES))
@pytest.mark.parametrize("path", LLAMA, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_llama_recipe_keeps_its_released_global_batch(path, machine):
    """With the loss server on GPU 0, 7 processes trained (global batch 14 / 56 instead of 16 / 64, 28 / 112 on two
    nodes): now the processes and the accumulation keep the released batch, or the allocation says why it cannot
    run."""
    recipe = load(path, **MACHINES[machine])
    allocation = allocate_hardware(recipe, parse_hardware(machine), [0])
    if allocation.training is None:  # refused before training was placed (e.g. devices beyond the machine)
        assert allocation.problems
        return
    found = {m.group(1): m for m in map(LINE.search, allocation.lines) if m}
    kinds = {"sft_recipes": ["sft"], "dpo_recipes": ["dpo"], "sft_dpo_recipes": ["sft", "dpo"]}[path.parent.name]
    assert sorted(found) == sorted(kinds), allocation.lines
    for kind, m in found.items():
        value, per_device, steps, processes, shown = (int(m.group(i)) for i in range(2, 7))
        assert value == per_device * steps * processes == shown == released(recipe, kind)
        assert processes == allocation.training.num_processes
        assert allocation.accumulation.get(kind, steps) == steps
    if machine == "8x80GB":
        assert not allocation.problems, allocation.problems
        assert allocation.training.num_processes == 4  # of the 7 free GPUs: 16 and 64 are multiples of 4, not 7


def test_the_allocations_accumulation_goes_into_the_trainer_yaml(tmp_path):
    recipe = load(REPO / "train/sft_dpo_recipes/arc.yaml")
    allocation = allocate_hardware(recipe, parse_hardware("8x80GB"), [0])
    assert allocation.accumulation == {"sft": 4, "dpo": 16}  # base YAMLs: 2 and 8 on 8 processes; 4 train here
    run = Run(recipe=recipe, paths=RunPaths(tmp_path), envs={"train": TRAIN_ENV}, hardware=allocation)
    dpo = Part(run, 0, "dpo", "dpo", run.paths.stage(0, "dpo"), tmp_path / "out", "m")
    assert train_settings(dpo).train.values["gradient_accumulation_steps"] == 16
    run.hardware = HardwareAllocation(allocation.hardware)  # nothing to adjust: the YAML's value stays
    sft = Part(run, 0, "sft", "sft", run.paths.stage(0, "sft"), tmp_path / "out", "m")
    assert "gradient_accumulation_steps" not in train_settings(sft).train.values


def test_the_users_accumulation_is_kept_and_the_difference_shown():
    recipe = load(REPO / "train/sft_recipes/arc.yaml", trainer_overrides={"gradient_accumulation_steps": 2})
    allocation = allocate_hardware(recipe, parse_hardware("8x80GB"), [0])
    assert allocation.training.num_processes == 7 and allocation.accumulation == {}
    line = next(line for line in allocation.lines if "global batch" in line)
    assert "sft global batch 14 = 1 per device x 2 accumulation x 7 processes" in line and "released 16" in line
    assert "set in trainer_overrides" in line


def test_a_batch_that_no_process_count_keeps_is_refused():
    batches = [TrainerBatch("sft", 1, 2, 16, False)]
    assert processes_per_node(batches, 7, 1) == 4
    assert processes_per_node(batches, 8, 2) == 8
    assert processes_per_node(batches, 7, 3) == 0  # 16 is no multiple of 3 nodes
    recipe = load(REPO / "train/sft_recipes/arc.yaml", train_launcher="srun", loss_placement="after")
    allocation = allocate_hardware(recipe, parse_hardware("3x8x80GB"), [0])
    assert any("released global batch (sft 16 (1 per device)) cannot be split evenly over 3 node(s)" in p
               for p in allocation.problems)  # fmt: skip


@pytest.mark.parametrize("path", LLAMA, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_dry_run_prints_the_released_global_batch(path, tmp_path, capsys):
    from optima.cli import run_loop_script

    argv = ["--train_config_path", str(path.relative_to(REPO)), "--vllm_env", sys.executable]
    argv += ["--alignment_env", sys.executable, "--set", f"output_dir={tmp_path / 'run'}"]
    assert run_loop_script(CLASSES[path.parent.name], "", [*argv, "--dry-run", "--hardware", "8x80GB"]) == 0
    out = capsys.readouterr().out
    recipe = load(path)
    for m in (LINE.search(line) for line in out.splitlines()):
        if m:
            assert int(m.group(2)) == int(m.group(6)) == released(recipe, m.group(1))
    assert "global batch" in out and "loss server: GPUs 0" in out and "DeepSpeed's ZeRO-3 estimator" in out


def test_a_batch_kept_on_fewer_gpus_says_how_to_use_the_others():
    """4x80GB beside the loss server: 2 of 3 free GPUs keep DPO's 64, and a note says how to train on all."""
    recipe = load(REPO / "train/dpo_recipes/arc.yaml", devices=None)
    allocation = allocate_hardware(recipe, parse_hardware("4x80GB"), [0])
    assert not allocation.problems and allocation.training.num_processes == 2
    assert any(n.startswith("2 of the 3 free GPUs per node train") and "loss_placement: after" in n
               for n in allocation.notes)  # fmt: skip
    after = allocate_hardware(load(REPO / "train/dpo_recipes/arc.yaml", devices=None, loss_placement="after"),
                          parse_hardware("4x80GB"), [0])  # fmt: skip
    assert not after.problems and after.training.num_processes == 4
