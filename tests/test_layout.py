"""The policy and loss servers side by side: placements, command lines, sleep-mode requests, one loss server per run.

Pure functions and the fake ``vllm`` (``tests/fake_vllm.py``); the real engine is in ``test_loss_server.py``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest

from optima.config import RecipeError, SFTRecipe, load_recipe
from optima.environments import PythonEnv
from optima.hardware.memory import GIB, MemoryShare
from optima.hardware.placement import Placement, ServerLayout, describe_layout, place_servers
from optima.paths import RunPaths
from optima.serving.holder import ServerHolder
from optima.serving.processes import group_members
from optima.serving.reload import put_to_sleep, wake_with_weights
from optima.serving.vllm_server import ReplicaLayout, build_serve_command, build_serve_env, memory_share
from tests.fake_openai import FakeOpenAIServer
from tests.helpers import child_groups

REPO = Path(__file__).resolve().parent.parent
FAKE_ENV = PythonEnv("fake", "python", (sys.executable, str(Path(__file__).with_name("fake_vllm.py"))))
VENV = PythonEnv("venv", "venv", ("/venv/bin/python",))


def sft_recipe(tmp_path: Path, **overrides):
    values = {
        "dataset_type": "arc",
        "initial_model_path": "/models/base",
        "origin_yaml_path": str(REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml"),
        "output_dir": str(tmp_path / "run"),
        "port": 18900,
        "server_startup_timeout_s": 60.0,
    } | overrides
    return load_recipe(SFTRecipe, None, values, check_paths=False)


@pytest.mark.parametrize(
    ("cpus", "policy", "loss"),
    [([0, 1], "0", "1"), ([0, 1, 2, 3, 4, 5, 6, 7], "0,1,2,3,4,5", "6,7"), ([3, 5, 4], "3,4", "5")],
)
def test_on_cpu_each_server_gets_its_own_cores(tmp_path, cpus, policy, loss):
    layout = place_servers(sft_recipe(tmp_path), [], cpus)
    # The loss model has no local config here: its KV cache is the minimum, 1 GiB.
    assert layout == ServerLayout(
        (Placement(cpu_bind=policy, carry_over=True),), Placement(cpu_bind=loss, cpu_kvcache_gb=1)
    )
    env = build_serve_env(sft_recipe(tmp_path), VENV, layout.loss, tmp_path, "/models/base")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == loss and "VLLM_SERVER_DEV_MODE" not in env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"


@pytest.mark.parametrize(
    "overrides",
    [{"loss_placement": "after"}, {"loss_backend": "hf"}, {"cal_ppl": False}, {"endpoints": ["http://h:1/v1"]}],
)
def test_without_a_loss_server_the_policy_keeps_vllms_own_binding(tmp_path, overrides):
    kept = "endpoints" not in overrides  # external endpoints are never ours to keep
    assert place_servers(sft_recipe(tmp_path, **overrides), [], [0, 1]) == ServerLayout(
        (Placement(carry_over=kept),), None
    )


def test_one_core_is_shared(tmp_path):
    assert place_servers(sft_recipe(tmp_path), [], [0]) == ServerLayout(
        (Placement(carry_over=True),), Placement(cpu_kvcache_gb=1)
    )


@pytest.mark.parametrize(("sleep_mode", "kept"), [(None, True), (True, True), (False, False)])
def test_the_policy_is_kept_across_checkpoints_by_default_on_cpu_too(tmp_path, sleep_mode, kept):
    layout = place_servers(sft_recipe(tmp_path, sleep_mode=sleep_mode), [], [0, 1])
    assert layout.policy[0].carry_over is kept and layout.loss.carry_over is False
    assert ("(weights reloaded)" in describe_layout(sft_recipe(tmp_path), "/m", layout)["policy replica 0"]) is kept


def test_on_a_shared_gpu_the_loss_server_takes_its_share_from_the_first_replica(tmp_path):
    recipe = sft_recipe(tmp_path, gpu_memory_utilization=0.9, loss_gpu_memory_utilization=0.15)
    layout = place_servers(recipe, ["0", "1"], [0, 1])
    assert layout.policy == (
        Placement(gpus=("0",), gpu_memory_utilization=0.75, carry_over=True),
        Placement(gpus=("1",), carry_over=True),
    )
    assert layout.loss == Placement(gpus=("0",), gpu_memory_utilization=0.15, scoring=True)
    commands = [" ".join(build_serve_command(recipe, "/m", 8000, VENV, p)) for p in (*layout.policy, layout.loss)]
    assert "--gpu-memory-utilization 0.75 --enable-sleep-mode" in commands[0]
    assert "--gpu-memory-utilization 0.9 --enable-sleep-mode" in commands[1]
    assert "--gpu-memory-utilization 0.15" in commands[2] and "--enable-sleep-mode" not in commands[2]
    policy_env = build_serve_env(recipe, VENV, layout.policy[0], tmp_path, "/m")
    assert policy_env["CUDA_VISIBLE_DEVICES"] == "0" and policy_env["VLLM_SERVER_DEV_MODE"] == "1"
    assert build_serve_env(recipe, VENV, layout.loss, tmp_path, "/m")["CUDA_VISIBLE_DEVICES"] == "0"


def test_named_loss_devices_keep_every_share_whole(tmp_path):
    recipe = sft_recipe(tmp_path, devices=[0], loss_devices="1", sleep_mode=False)
    layout = place_servers(recipe, ["4", "5"], [0, 1])
    assert layout == ServerLayout((Placement(gpus=("4",)),), Placement(gpus=("5",), scoring=True))
    with pytest.raises(RecipeError, match="loss_devices.*GPU 3 is not visible"):
        place_servers(sft_recipe(tmp_path, loss_devices=[3]), ["0"], [0])


def test_a_loss_share_that_leaves_the_policy_nothing_is_refused(tmp_path):
    recipe = sft_recipe(tmp_path, gpu_memory_utilization=0.3, loss_gpu_memory_utilization=0.3)
    with pytest.raises(RecipeError, match="loss_gpu_memory_utilization"):
        place_servers(recipe, ["0"], [0])
    with pytest.raises(RecipeError, match="loss_gpu_memory_utilization"):
        sft_recipe(tmp_path, loss_gpu_memory_utilization=1.0)


def test_dry_run_lines_name_both_servers(tmp_path):
    recipe = sft_recipe(tmp_path, loss_model_path="/models/judge")
    lines = describe_layout(recipe, "/models/judge", place_servers(recipe, [], [0, 1]))
    assert lines == {
        "policy replica 0": "CPU cores 0, kept across iterations (weights reloaded), KV cache sized at start: what 64 "
        "conversations need, within the memory available",
        "loss server": "/models/judge on CPU cores 1, KV cache 1 GiB (one scoring batch), started once per run",
    }
    fixed = sft_recipe(tmp_path, loss_model_path="/models/judge", cpu_kvcache_space_gb=3)
    lines = describe_layout(fixed, "/models/judge", place_servers(fixed, [], [0, 1]))
    assert lines["policy replica 0"].endswith(", KV cache 3 GiB (cpu_kvcache_space_gb)")
    assert "KV cache 1 GiB (one scoring batch)" in lines["loss server"]  # the recipe's budget is the policy's only
    gpu = describe_layout(recipe, "/models/judge", place_servers(recipe, ["0"], [0, 1], loss_share=0.1))
    assert gpu["policy replica 0"] == "GPUs 0 (memory share 0.8, sleeps during training)"
    assert gpu["loss server"] == "/models/judge on GPUs 0 (memory share 0.1), started once per run"


def test_sleep_then_wake_with_a_checkpoint_sends_vllms_requests(tmp_path):
    recipe = sft_recipe(tmp_path, api_key="secret")
    with FakeOpenAIServer() as first, FakeOpenAIServer() as second:
        urls = [first.base_url, second.base_url]
        put_to_sleep(urls, recipe)
        wake_with_weights(urls, "/ckpt/iteration_0", recipe)
        for server in (first, second):
            assert server.posts == [
                "/sleep?level=2",
                "/wake_up?tags=weights",
                "/collective_rpc",
                "/wake_up?tags=kv_cache",
                "/reset_prefix_cache",
            ]
            rpc = [body for body, _ in server.dev_requests if body][0]
            assert rpc == {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/iteration_0"}}
            assert all(headers["authorization"] == "Bearer secret" for _, headers in server.dev_requests)
    assert dict(parse_qsl(urlsplit(first.posts[0]).query)) == {"level": "2"}


def server_log_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("=== optima: starting")]


def test_the_loss_server_lives_across_policy_models_and_stops_with_the_run(tmp_path):
    recipe = sft_recipe(tmp_path, sleep_mode=False)  # a fresh policy per model
    holder = ServerHolder(
        recipe, FAKE_ENV, "/models/base", tmp_path / "logs", layout=place_servers(recipe, [], [0, 1])
    )
    stage = RunPaths.from_recipe(recipe).stage(0)
    with holder:
        first = holder.serve("/models/base", stage)
        loss_urls = holder.loss_urls()
        loss_group = holder.loss.server.pgid
        assert loss_urls != first  # its own server, on its own port
        holder.release_for_training()  # without sleep_mode the policy stops, the loss server stays
        assert holder.model is None and group_members(loss_group)
        second = holder.serve("/ckpt/iteration_0", stage)
        assert holder.loss_urls() == loss_urls and holder.loss.server.pgid == loss_group
        assert second != loss_urls
    assert group_members(loss_group) == []  # nothing outlives the run
    assert len(server_log_lines(tmp_path / "logs" / "loss_server.log")) == 1  # started once
    assert len(server_log_lines(stage.server_log(0))) == 2  # the policy: once per model


def test_the_policy_kv_budget_counts_a_starting_loss_server_once(tmp_path, monkeypatch):
    """Iteration 0: both servers start together; the loss server's cache is what scoring needs and the policy's
    budget leaves room for it. Later the loss server's memory is gone from ``MemAvailable`` already, so the new
    policy sizes its cache as the only server starting."""
    from optima.serving import vllm_server

    asked = []
    monkeypatch.setattr(vllm_server, "resolve_cpu_kvcache_gb", lambda explicit, model, share: asked.append(share) or 1)
    recipe = sft_recipe(tmp_path, sleep_mode=False)  # a fresh policy per model
    holder = ServerHolder(
        recipe, FAKE_ENV, "/models/base", tmp_path / "logs", layout=place_servers(recipe, [], [0, 1])
    )
    stage = RunPaths.from_recipe(recipe).stage(0)
    with holder:
        holder.serve("/models/base", stage)
        assert asked == [MemoryShare(policy_replicas=1, loss_kv_gb=1)]  # the loss server's own is fixed
        holder.release_for_training()
        holder.serve("/ckpt/iteration_0", stage)
        assert asked[1:] == [MemoryShare(policy_replicas=1)]


def test_an_error_stops_the_loss_server_too(tmp_path):
    recipe = sft_recipe(tmp_path)
    holder = ServerHolder(
        recipe, FAKE_ENV, "/models/base", tmp_path / "logs", layout=place_servers(recipe, [], [0, 1])
    )
    with pytest.raises(RuntimeError, match="boom"), holder:
        holder.serve("/models/base", RunPaths.from_recipe(recipe).stage(0))
        group = holder.loss.server.pgid
        raise RuntimeError("boom")
    assert group_members(group) == []


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, -signal.SIGINT)])
def test_a_signalled_driver_leaves_neither_server_behind(tmp_path, sig, code):
    driver = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("servers_driver.py")), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert driver.stdout.readline().startswith("READY") or pytest.fail(driver.stdout.read())
        groups = child_groups(driver.pid)
        assert len(groups) == 2  # the policy and the loss server
        driver.send_signal(sig)
        assert driver.wait(timeout=60) == code
    finally:
        driver.kill()
    assert all(group_members(group) == [] for group in groups)


def test_on_cpu_a_kept_policy_only_reloads_its_weights(tmp_path):
    recipe = sft_recipe(tmp_path, sleep_mode=True)
    layout = place_servers(recipe, [], [0, 1])
    assert layout.policy == (Placement(cpu_bind="0", carry_over=True),)
    assert "--enable-sleep-mode" not in build_serve_command(recipe, "/m", 8000, VENV, layout.policy[0])  # GPU only
    assert build_serve_env(recipe, VENV, layout.policy[0], tmp_path, "/m")["VLLM_SERVER_DEV_MODE"] == "1"
    with FakeOpenAIServer() as server:
        put_to_sleep([server.base_url], recipe, gpu=False)
        wake_with_weights([server.base_url], "/ckpt/iteration_0", recipe, gpu=False)
        assert server.posts == ["/collective_rpc", "/collective_rpc", "/reset_prefix_cache"]
        assert [body.get("method") for body, _ in server.dev_requests] == [
            "reload_weights",
            "refresh_packed_weights",
            None,
        ]
    assert "--worker-extension-cls" in build_serve_command(recipe, "/m", 8000, VENV, layout.policy[0])


def test_a_kept_policy_serves_the_next_checkpoint_without_a_restart(tmp_path):
    recipe = sft_recipe(tmp_path, sleep_mode=True)
    holder = ServerHolder(
        recipe, FAKE_ENV, "/models/base", tmp_path / "logs", layout=place_servers(recipe, [], [0, 1])
    )
    stage = RunPaths.from_recipe(recipe).stage(0)
    with holder:
        first = holder.serve("/models/base", stage)
        holder.release_for_training()  # the process stays
        assert holder.asleep and holder.serve("/ckpt/iteration_0", stage) == first
        assert holder.model == "/ckpt/iteration_0" and not holder.asleep
    assert len(server_log_lines(stage.server_log(0))) == 1


@pytest.mark.parametrize("keep_served", [True, False])
def test_search_and_score_stage_use_the_loss_server_never_the_driver(tmp_path, monkeypatch, keep_served):
    from types import SimpleNamespace

    from optima import lm_loss
    from optima import run as run_module
    from optima.methods import Stage
    from optima.run import loss_route, loss_scorer

    def no_hf(*args, **kwargs):
        raise AssertionError("an in-process HF loss model in the driver")

    asked = []
    monkeypatch.setattr(lm_loss.HFLossScorer, "__init__", no_hf)
    monkeypatch.setattr(run_module, "served_loss_scorer", lambda run, urls: lambda texts: asked.append(urls) or [1.0])
    recipe = sft_recipe(tmp_path, loss_model_path="/models/judge")
    layout = place_servers(recipe, [], [0, 1])
    holder = ServerHolder(recipe, FAKE_ENV, "/models/judge", tmp_path / "logs", layout=layout)
    stage = RunPaths.from_recipe(recipe).stage(0)
    route = loss_route(recipe, layout, Stage.SEARCH if keep_served else Stage.SCORE, "/ckpt/iteration_0")
    with holder:
        policy = holder.serve("/ckpt/iteration_0", stage)  # the policy is not the loss model
        with loss_scorer(SimpleNamespace(recipe=recipe, servers=holder), route, stage) as score:
            assert score(["Alice: hi"]) == [1.0]
        assert asked == [holder.loss_urls()] and asked[0] != policy
        assert holder.model == "/ckpt/iteration_0"  # the policy kept serving


def smollm2_config(folder: Path) -> Path:
    """A folder with SmolLM2-135M's ``config.json`` (no weights): what the KV sizes read."""
    folder.mkdir()
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    config |= {"vocab_size": 49152, "intermediate_size": 1536, "max_position_embeddings": 8192}
    (folder / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    return folder


def test_the_policys_memory_share_counts_the_loss_server_starting_with_it_and_its_conversations_need():
    """The trainer is not reserved for: the caches take at most half of what the servers leave, and the train stage
    weighs the idle policy against the preflight's measured peak (``tests/test_holder.py``)."""
    recipe = sft_recipe(Path("/tmp"))
    kept, stopped = Placement(cpu_bind="0", carry_over=True), Placement(cpu_bind="0")
    share = memory_share(recipe, ReplicaLayout([kept], loss_starting=True, demand=3 * GIB))
    assert share == MemoryShare(1, loss_kv_gb=1, need_bytes=3 * GIB)
    assert memory_share(recipe, ReplicaLayout([stopped], demand=3 * GIB)) == MemoryShare(1, need_bytes=3 * GIB)
    assert memory_share(recipe, ReplicaLayout([stopped, stopped])) == MemoryShare(2)


def test_the_recipes_kv_budget_is_the_policys_and_the_loss_server_keeps_its_need(tmp_path):
    model = smollm2_config(tmp_path / "smollm2")
    recipe = sft_recipe(tmp_path, initial_model_path=str(model), cpu_kvcache_space_gb=3)
    layout = place_servers(recipe, [], [0, 1])
    assert layout.loss.cpu_kvcache_gb == 1  # one scoring batch of SmolLM2: 16,000 tokens, 0.7 GiB
    assert build_serve_env(recipe, VENV, layout.loss, tmp_path, str(model))["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert build_serve_env(recipe, VENV, layout.policy[0], tmp_path, str(model))["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_the_cpu_default_is_the_measured_one(tmp_path):
    """bench/RESULTS.md ("Both cores at work"): on 2 cores the policy on core 0 with the loss server scoring beside it
    on core 1 was kept against one replica on both cores (faster at iteration 0 on a quiet box, 2-3x slower under
    load, and a loss-server start-up per later iteration) and two single-core replicas (slower); pinning the API
    servers and engine cores away gained 3%, within the noise: they stay where the kernel puts them."""
    recipe = sft_recipe(tmp_path)
    assert recipe.loss_placement == "beside"
    layout = place_servers(recipe, [], [0, 1])
    assert [p.cpu_bind for p in (*layout.policy, layout.loss)] == ["0", "1"]
    assert [p.service_bind for p in (*layout.policy, layout.loss)] == [None, None]
