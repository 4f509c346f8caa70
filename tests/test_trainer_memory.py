"""The trainer's memory as accelerate builds FSDP2 and DDP (issue 32, item 6; optima/hardware/memory.py).

accelerate 1.15 upcasts every trainable parameter to fp32 before ``fully_shard`` when ``mixed_precision`` is not
``no`` (``accelerate/utils/fsdp_utils.py: fsdp2_prepare_model``), so FSDP2 holds 16 bytes per parameter / N, not
4 w / N; DDP's reducer keeps its gradient buckets beside the gradients (one more ``w P``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from optima.config import SFTRecipe, load_recipe
from optima.hardware import memory
from optima.hardware.memory import TrainerShape
from optima.hardware.plan import plan_hardware
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
    assert 25 * GIB < mixed < 30 * GIB  # ~28 GiB on 7 processes, where the plan said 17.5 (issue 32)


def test_ddp_counts_its_gradient_buckets_and_one_process_does_not():
    ddp, single = peak("ddp"), peak("single", processes=1)
    assert math.isclose(ddp - single, 2 * LLAMA.params * (1 + memory.TRAINER_OVERHEAD_SHARE), rel_tol=1e-6)
    assert ddp > 80 * GIB  # Llama-3-8B full fine-tuning under DDP does not fit an 80 GB card


def test_the_plan_reads_mixed_precision_from_the_accelerate_config():
    recipe = load_recipe(
        SFTRecipe, REPO / "train/sft_recipes/arc.yaml", {"accelerate_config": "fsdp"}, check_paths=False
    )
    plan = plan_hardware(recipe, parse_hardware("8x80GB"), [0])
    line = next(line for line in plan.lines if line.startswith("training: fsdp"))
    shape = dict(SHAPE, mixed_precision=True)
    expected = memory.trainer_peak_bytes(LLAMA, TrainerShape("fsdp", plan.training.num_processes, **shape))
    assert f"peak ~{memory.gib(expected)} GiB" in line


def test_ddp_sft_on_80gb_cards_is_refused_with_advice_that_applies():
    """multi_gpu SFT was planned at ~72 GiB of 80 (no buckets): a wrong "feasible"."""
    recipe = load_recipe(
        SFTRecipe, REPO / "train/sft_recipes/arc.yaml", {"accelerate_config": "multi_gpu"}, check_paths=False
    )
    plan = plan_hardware(recipe, parse_hardware("8x80GB"), [0])
    training = [p for p in plan.problems if p.startswith("training:")]
    assert training and "deepspeed_zero3 or fsdp" in training[0]
