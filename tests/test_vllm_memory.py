"""vLLM's own memory in the hardware allocation (issue 32, item 1): the parts of a server's need from vLLM's arguments,
and the loss server's command sized for scoring. Pure: nothing starts (no GPU here; docs/gpu.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from optima.config import SFTRecipe, load_recipe
from optima.config.rules import loss_server_limits
from optima.hardware import memory, vllm_memory
from optima.hardware.allocation import allocate_hardware
from optima.hardware.placement import Placement
from optima.hardware.spec import parse_hardware
from optima.serving.vllm_server import build_serve_command
from tests.test_hardware_allocation import VENV

REPO = Path(__file__).resolve().parent.parent
GIB = 1024**3
LLAMA = memory.model_size("meta-llama/Meta-Llama-3-8B-Instruct")
VOCAB = 128256


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def sft(**overrides):
    return load_recipe(SFTRecipe, REPO / "train/sft_recipes/arc.yaml", overrides, check_paths=False)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_policy_need_follows_vllms_defaults_on_a_large_gpu():
    """vLLM 0.32 on a >= 70 GiB GPU: 8192 batched tokens, 1024 sequences; the sampler pass over 1024 x 128k logits,
    the KV floor of one max_model_len request."""
    args = vllm_memory.policy_args(None, LLAMA, 80, [])
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (8192, 1024, 8192)
    need = vllm_memory.server_need(LLAMA, 0, 1, 2, args)
    assert need.part("sampler") == 1024 * VOCAB * 28  # 3.4 GiB
    assert need.part("KV") == (8192 + 16) * 128 * 1024  # Llama-3-8B: 128 KiB per token
    assert need.part("profile activations") == 8192 * (6 * 4096 + 3 * 14336) * 2
    assert need.part("weights") == LLAMA.params * 2 and need.part("prompt logprobs") == 0
    assert need.total == sum(size for _, size in need.parts)
    small = vllm_memory.policy_args(None, LLAMA, 40, [])
    assert (small.max_num_seqs, small.max_num_batched_tokens) == (256, 2048)


def test_vllm_extra_args_and_tensor_parallel_change_the_parts():
    extra = ["--enforce-eager", "--max-num-seqs", "64", "--max-num-batched-tokens=4096", "--max-model-len", "4096"]
    args = vllm_memory.policy_args(8192, LLAMA, 80, extra)
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens, args.cuda_graphs) == (
        4096,
        64,
        4096,
        False,
    )
    one, two = (vllm_memory.server_need(LLAMA, 0, tp, 2, args) for tp in (1, 2))
    assert one.part("CUDA graphs") == 0 and one.part("sampler") == 64 * VOCAB * 28
    assert two.part("weights") == one.part("weights") // 2 and two.part("sampler") == one.part("sampler")
    assert two.part("runtime") > one.part("runtime")  # NCCL with tensor parallel


def test_a_long_context_model_needs_its_kv_floor():
    """vLLM refuses to start without KV for one request of max_model_len: Llama-3.1's 128k context is 16 GiB."""
    long = memory.model_size("meta-llama/Llama-3.1-8B-Instruct")
    need = vllm_memory.server_need(long, GIB, 1, 2, vllm_memory.policy_args(None, long, 80, []))
    assert need.part("KV") == (131072 + 16) * 128 * 1024


def test_the_loss_server_is_started_with_the_limits_scoring_needs():
    """It was started with vLLM's defaults (1024 sequences, the model's 8k context) and sized with 2 GiB for all of
    vLLM's own memory; now it gets --max-model-len, --max-num-seqs and --max-num-batched-tokens for scoring, and its
    share is sized from the parts those imply."""
    recipe = sft()
    allocation = allocate_hardware(recipe, parse_hardware("8x80GB"), [0])
    loss = build_serve_command(recipe, "meta-llama/Meta-Llama-3-8B-Instruct", 8001, VENV, allocation.layout.loss)
    expected = loss_server_limits(recipe, None)
    assert expected == (2000 + 64, 32, 1024)
    assert (flag(loss, "--max-model-len"), flag(loss, "--max-num-seqs"), flag(loss, "--max-num-batched-tokens")) == (
        "2064",
        "32",
        "1024",
    )
    policy = build_serve_command(
        recipe, "meta-llama/Meta-Llama-3-8B-Instruct", 8000, VENV, allocation.layout.policy[0]
    )
    assert "--max-num-seqs" not in policy  # the policy keeps vLLM's defaults (and the recipe's max_model_len)
    need = vllm_memory.server_need(
        LLAMA, memory.loss_kv_min_bytes(LLAMA, recipe, 2), 1, 2, vllm_memory.loss_args(recipe, LLAMA)
    )
    assert (
        need.total <= allocation.loss_share * 80 * GIB < need.total + 0.01 * 80 * GIB
    )  # the smallest share that holds it
    assert need.part("prompt logprobs") == 1024 * VOCAB * (2 + 8)


def test_the_loss_server_limits_respect_the_context():
    recipe = sft(max_model_len=1024)
    assert loss_server_limits(recipe, 8192)[0] == 1024
    assert loss_server_limits(sft(), 512)[0] == 512  # the model's own context
    unchunked = sft(vllm_extra_args=["--no-enable-chunked-prefill"])
    assert loss_server_limits(unchunked, None)[2] == 2064  # vLLM 0.32 then refuses batched tokens < max_model_len
    cpu = build_serve_command(sft(), "/m", 8001, VENV, Placement(scoring=True))
    assert "--max-num-seqs" not in cpu  # the CPU loss server keeps its own settings (docs/cpu.md)


def test_dry_run_shows_every_claims_parts(tmp_path, capsys):
    from optima.cli import run_loop_script

    argv = ["--train_config_path", "train/sft_recipes/arc.yaml", "--vllm_env", sys.executable]
    argv += ["--alignment_env", sys.executable, "--set", f"output_dir={tmp_path / 'run'}"]
    assert run_loop_script(SFTRecipe, "", [*argv, "--dry-run", "--hardware", "8x80GB"]) == 0
    out = capsys.readouterr().out
    loss = next(line for line in out.splitlines() if "loss server: GPUs 0" in line)
    for part in (
        "weights 15.0",
        "KV 2.0",
        "runtime",
        "profile activations",
        "sampler",
        "CUDA graphs",
        "prompt logprobs",
    ):
        assert part in loss, loss
    policy = next(line for line in out.splitlines() if "policy replica 1: GPUs 1" in line)
    assert "sampler 3.4" in policy and "max_num_seqs 1024" in policy
