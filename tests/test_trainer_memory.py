"""The trainer's memory as accelerate builds FSDP2 and DDP (issue 32, item 6; optima/hardware/memory.py).

accelerate 1.15 upcasts every trainable parameter to fp32 before ``fully_shard`` when ``mixed_precision`` is not
``no`` (``accelerate/utils/fsdp_utils.py: fsdp2_prepare_model``), so FSDP2 holds 16 bytes per parameter / N, not
4 w / N; DDP's reducer keeps its gradient buckets beside the gradients (one more ``w P``).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from optima.config import SFTRecipe, load_recipe
from optima.hardware import memory
from optima.hardware.allocation import allocate_hardware
from optima.hardware.memory import TrainerShape
from optima.hardware.spec import parse_hardware

REPO = Path(__file__).resolve().parent.parent
LLAMA = memory.model_size("meta-llama/Meta-Llama-3-8B-Instruct")
GIB = 1024**3
SHAPE = dict(dtype_bytes=2, batch=1, seq=2048, checkpointing=True)


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def peak(strategy: str, processes: int = 7, **extra) -> int:
    return memory.trainer_peak_bytes(LLAMA, TrainerShape(strategy, processes, **SHAPE, **extra))


def test_fsdp2_under_mixed_precision_holds_fp32_master_weights():
    mixed, plain = peak("fsdp", mixed_precision=True), peak("fsdp")
    expected = (16 - 4 * 2) * LLAMA.params / 7 * (1 + memory.TRAINER_OVERHEAD_SHARE)
    assert math.isclose(mixed - plain, expected, rel_tol=1e-6)
    assert 25 * GIB < mixed < 30 * GIB  # ~28 GiB on 7 processes, where the allocation said 17.5 (issue 32)


def test_ddp_counts_its_gradient_buckets_and_one_process_does_not():
    ddp, single = peak("ddp"), peak("single", processes=1)
    assert math.isclose(ddp - single, 2 * LLAMA.params * (1 + memory.TRAINER_OVERHEAD_SHARE), rel_tol=1e-6)
    assert ddp > 80 * GIB  # Llama-3-8B full fine-tuning under DDP does not fit an 80 GB card


def test_the_allocation_reads_mixed_precision_from_the_accelerate_config():
    recipe = load_recipe(
        SFTRecipe, REPO / "train/sft_recipes/arc.yaml", {"accelerate_config": "fsdp"}, check_paths=False
    )
    allocation = allocate_hardware(recipe, parse_hardware("8x80GB"), [0])
    line = next(line for line in allocation.lines if line.startswith("training: fsdp"))
    shape = dict(SHAPE, mixed_precision=True)
    expected = memory.trainer_peak_bytes(LLAMA, TrainerShape("fsdp", allocation.training.num_processes, **shape))
    assert f"peak ~{memory.gib(expected)} GiB" in line


def test_ddp_sft_on_80gb_cards_is_refused_with_advice_that_applies():
    """multi_gpu SFT was planned at ~72 GiB of 80 (no buckets): a wrong "feasible"."""
    recipe = load_recipe(
        SFTRecipe, REPO / "train/sft_recipes/arc.yaml", {"accelerate_config": "multi_gpu"}, check_paths=False
    )
    allocation = allocate_hardware(recipe, parse_hardware("8x80GB"), [0])
    training = [p for p in allocation.problems if p.startswith("training:")]
    assert training and "deepspeed_zero3 or fsdp" in training[0]


PEAK_SITE = Path(__file__).resolve().parent / "peak_rss"
# The estimate is an upper bound (the allocation refuses on it), so a measurement above it is a failure; one far below
# it (more than this) would make the allocation refuse machines that fit. Measured on this 2-core machine,
# SmolLM2-135M fp32, 2 gloo processes, batch 2, 128 tokens: DDP 3.24 GiB per rank (estimate 5.19), FSDP2 3.26
# (estimate 3.68); the Python stack, torch and the allocator's cache weigh more than the sharded states at this size.
SLACK = int(2.5 * GIB)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_estimate_bounds_a_real_two_process_gloo_run(strategy, tmp_path):
    from optima.environments import resolve_env
    from optima.selection.io import save_splits
    from optima.training.launch import run_training
    from optima.training.launch_config import TrainLaunch
    from tests.helpers import tiny_trainer_yaml
    from tests.test_sharded_training import AUDIT_PATH, SFT_ROWS, cpu_accelerate_config, launch_env

    model = REPO / "models" / "SmolLM2-135M-Instruct"
    if not (model / "config.json").is_file():
        pytest.skip("models/SmolLM2-135M-Instruct is not prepared (make setup)")
    save_splits({"train": SFT_ROWS * 4}, tmp_path / "data")
    config = tiny_trainer_yaml(
        tmp_path / "t.yaml", model.resolve(), tmp_path / "data", tmp_path / "out", max_length=128
    )
    peaks = tmp_path / "peaks"
    peaks.mkdir()
    env = launch_env(tmp_path / "audit")
    env["PYTHONPATH"] = os.pathsep.join([str(PEAK_SITE), env["PYTHONPATH"]])
    env |= {"OPTIMA_TEST_PEAK_RSS": str(peaks), "OPTIMA_TEST_AUDIT_SITE": str(Path(AUDIT_PATH) / "sitecustomize.py")}
    launch = TrainLaunch(
        "sft", resolve_env(sys.executable, "train"), cpu_accelerate_config(tmp_path, strategy), config
    )
    run_training(launch, tmp_path / "train.log", extra_env=env)
    measured = [int(p.read_text()) for p in peaks.iterdir()]
    assert len(measured) == 2
    size = memory.model_size(model)
    estimate = memory.trainer_peak_bytes(size, TrainerShape(strategy, 2, 4, 2, 128, False))
    for peak in measured:
        assert peak <= estimate <= peak + SLACK, (memory.gib(peak), memory.gib(estimate))
