"""Every training node serves the policy, and the tree search's LM loss is served whatever the loss placement.

Issue 32 items 10 and 3. The allocation places the other nodes' replicas (``ServerLayout.nodes``) on their nodes;
the holder starts them through the training's launcher (here a stand-in for ssh that runs the command
on this machine, recording it) and pools them with node 0's; with ``loss_placement: after`` on a GPU the search
scores on a loss server started for it and stopped after it. Servers are the fake ``vllm`` (``tests/fake_vllm.py``).
The real engine on two loopback nodes: ``tests/test_multinode_generation.py`` (slow).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from optima.hardware.allocation import allocate_hardware
from optima.hardware.machine import Hardware, parse_hardware
from optima.hardware.placement import NodeServers, Placement, describe_layout, place_servers
from optima.paths import RunPaths
from optima.serving.holder import ServerHolder
from optima.serving.processes import group_members
from optima.serving.vllm_server import answers_health
from optima.training.nodes import NodeCommands
from tests.test_hardware_allocation import recipe_at
from tests.test_layout import FAKE_ENV, sft_recipe

SHIM = '''#!{python}
"""Stands in for ssh: ssh [-o OPT] [-L SPEC] [-tt] HOST COMMAND runs COMMAND here (no tunnel: the same machine)."""
import subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args = args[2:] if args[0] in ("-o", "-p", "-i", "-l", "-L") else args[1:]
with open({calls!r}, "a") as calls:
    calls.write(" ".join(sys.argv[1:]) + "\\n")
fresh = {{"PATH": "/usr/bin:/bin", "HOME": {home!r}}}  # a login on another machine: only what the command sets
raise SystemExit(subprocess.call(["/bin/sh", "-c", " ".join(args[1:])], env=fresh))
'''


def write_shim(folder: Path) -> tuple[Path, Path]:
    calls, shim = folder / "ssh_calls.txt", folder / "fake_ssh"
    shim.write_text(SHIM.format(python=sys.executable, calls=str(calls), home=str(folder)))
    shim.chmod(0o755)
    return shim, calls


def test_the_allocation_gives_every_training_node_the_policy_replicas():
    recipe = recipe_at("train/sft_recipes/arc.yaml", train_hosts=["n1", "n2"])
    allocation = allocate_hardware(recipe, parse_hardware("2x8x80GB"), [0])
    assert not allocation.problems
    (node,) = allocation.layout.nodes
    assert (node.rank, node.host) == (1, "n2")
    # node 0's replicas, but each keeps the whole share (no loss server there), and sleeps for training
    assert node.policy == tuple(Placement(gpus=(str(g),), carry_over=True) for g in range(8))
    assert "node 1 (n2): GPUs 0; 1; 2; 3; 4; 5; 6; 7, pooled with node 0" in allocation.lines
    assert not any("the other nodes train only" in note for note in allocation.notes)
    lines = describe_layout(recipe, "/m", allocation.layout)
    assert "started through ssh" in lines["node 1 policy replica 7"]


def test_srun_nodes_bind_to_their_names_so_they_need_an_api_key():
    recipe = recipe_at("train/sft_recipes/arc.yaml", train_launcher="srun")
    allocation = allocate_hardware(recipe, parse_hardware("2x8x80GB"), [0])
    assert any(
        "nodes 1-1: its servers bind to each Slurm node's name" in p and "api_key" in p for p in allocation.problems
    )


def test_node_commands_tunnel_ssh_to_the_nodes_loopback_and_srun_a_step_on_the_node(monkeypatch):
    recipe = recipe_at("train/sft_recipes/arc.yaml", train_hosts=["n1", "me@n2"])
    training = allocate_hardware(recipe, parse_hardware("2x8x80GB"), [0]).training
    commands = NodeCommands(training)
    assert commands.host(1) == "127.0.0.1"
    ssh = commands.command(1, ["vllm", "serve", "m"], {"CUDA_VISIBLE_DEVICES": "0"}, 8001)
    assert ssh[:6] == ["ssh", "-o", "ExitOnForwardFailure=yes", "-L", "8001:127.0.0.1:8001", "-tt"]
    assert ssh[-2] == "me@n2" and "CUDA_VISIBLE_DEVICES=0 vllm serve m" in ssh[-1]
    srun = NodeCommands(
        allocate_hardware(
            recipe_at("train/sft_recipes/arc.yaml", train_launcher="srun"), parse_hardware("2x8x80GB")
        ).training
    )
    monkeypatch.setattr("optima.training.nodes.slurm_hosts", lambda environ: ["a1", "a2"])
    assert srun.host(1) == "a2"
    step = srun.command(1, ["vllm", "serve"], {"X": "1"}, 8001)
    assert step[:8] == ["srun", "--nodes", "1", "--ntasks", "1", "--relative", "1", "--overlap"]
    assert step[-4:] == ["env", "X=1", "vllm", "serve"]


def test_the_holder_pools_every_nodes_servers_and_stops_them_for_training(tmp_path):
    shim, calls = write_shim(tmp_path)
    hosts = {"train_hosts": ["127.0.0.1", "127.0.0.1"], "train_launcher_executable": str(shim)}
    recipe = sft_recipe(tmp_path, cal_ppl=False, sleep_mode=False, cpu_kvcache_space_gb=1, **hosts)
    allocation = allocate_hardware(recipe, Hardware(1, 0, 0.0), [0, 1])
    assert allocation.layout.nodes == (NodeServers(1, "127.0.0.1", (Placement(),)),)
    holder = ServerHolder(recipe, FAKE_ENV, layout=allocation.layout, node_launcher=NodeCommands(allocation.training))
    stage = RunPaths.from_recipe(recipe).stage(0)
    with holder:
        urls = holder.serve("/models/base", stage)
        assert len(urls) == 2 and len(set(urls)) == 2  # node 0's replica and node 1's, one pool
        assert all(answers_health(url) for url in urls)
        (call,) = calls.read_text().splitlines()  # node 1's server went through the launcher, node 0's did not
        port = urls[1].rsplit(":", 1)[1].removesuffix("/v1")
        assert f"-L {port}:127.0.0.1:{port}" in call and f"--host 127.0.0.1 --port {port}" in call
        assert "VLLM_TARGET_DEVICE=cpu" in call and "OPTIMA_PARENT_PID" not in call
        assert stage.server_log(1).read_text().startswith("=== optima: starting")
        launcher_group = holder.node_servers[0].pgid
        assert group_members(launcher_group)
        holder.release_for_training()  # without sleep_mode every replica stops, on every node
        assert not any(answers_health(url) for url in urls) and group_members(launcher_group) == []
        assert holder.node_servers == []


def dpo_after(tmp_path: Path, **overrides):
    values = {"output_dir": str(tmp_path / "run"), "port": 18950, "loss_placement": "after", "devices": [0]}
    values |= {"server_startup_timeout_s": 60.0} | overrides
    return recipe_at("train/dpo_recipes/arc.yaml", loss_model_path="/models/judge", **values)


def test_after_on_a_gpu_plans_a_loss_server_for_the_search_only():
    recipe = recipe_at("train/dpo_recipes/arc.yaml", loss_placement="after")
    allocation = allocate_hardware(recipe, parse_hardware("8x80GB"), [0])
    assert not allocation.problems and allocation.layout.loss is not None and not allocation.layout.loss_resident
    assert any(
        line.startswith("search loss server: GPUs 0") and "stopped after it" in line for line in allocation.lines
    )
    assert allocation.training.num_processes == 8  # training still runs on the GPU it shared
    policy_share = allocation.layout.policy[0].gpu_memory_utilization
    assert policy_share == round(recipe.gpu_memory_utilization - allocation.layout.loss.gpu_memory_utilization, 4)
    text = describe_layout(recipe, "/m", allocation.layout)["tree search LM loss"]
    assert "started with each search and stopped after it" in text and "policy server itself" in text
    cpu = allocate_hardware(recipe, Hardware(1, 0, 0.0), [0, 1])  # CPU: the driver scores, and the dry run says so
    assert cpu.layout.loss is None
    assert "transformers in the driver" in describe_layout(recipe, "/m", cpu.layout)["tree search LM loss"]


@pytest.fixture
def no_driver_scoring(monkeypatch):
    from optima import lm_loss
    from optima import run as run_module

    def no_hf(*args, **kwargs):
        raise AssertionError("an in-process HF loss model in the driver")

    asked: list[list[str]] = []
    monkeypatch.setattr(lm_loss.HFLossScorer, "__init__", no_hf)
    monkeypatch.setattr(run_module, "served_loss_scorer", lambda run, urls: lambda texts: asked.append(urls) or [1.0])
    return asked


def test_after_on_a_gpu_the_search_scores_on_a_loss_server_it_starts_and_stops(tmp_path, no_driver_scoring):
    from optima.methods import Stage
    from optima.run import loss_route, loss_scorer

    recipe = dpo_after(tmp_path)
    layout = place_servers(recipe, ["0"], [0, 1], loss_share=0.2)
    holder = ServerHolder(recipe, FAKE_ENV, "/models/judge", tmp_path / "logs", layout=layout)
    run = SimpleNamespace(recipe=recipe, servers=holder)
    stage = RunPaths.from_recipe(recipe).stage(0)
    route = loss_route(recipe, layout, Stage.SEARCH, "/ckpt/iteration_0")  # what the dry run prints, too
    assert route.where == "search loss server"
    with holder:
        policy = holder.serve("/ckpt/iteration_0", stage)  # the policy is not the loss model
        with loss_scorer(run, route, stage) as score:
            assert score(["Alice: hi"]) == [1.0]
            (urls,) = no_driver_scoring
            assert urls != policy and answers_health(urls[0])
        assert not answers_health(urls[0])  # stopped with the search, before anything trains
        assert holder.urls == policy and all(answers_health(url) for url in policy)
        log = (tmp_path / "logs" / "search_loss_server.log").read_text()
        assert "--gpu-memory-utilization 0.2" in log and "--max-num-seqs" in log


def test_the_policy_scores_the_search_while_it_serves_the_loss_model(tmp_path, no_driver_scoring):
    from optima.methods import Stage
    from optima.run import loss_route, loss_scorer

    recipe = dpo_after(tmp_path)
    layout = place_servers(recipe, ["0"], [0, 1], loss_share=0.2)
    holder = ServerHolder(recipe, FAKE_ENV, "/models/judge", tmp_path / "logs", layout=layout)
    stage = RunPaths.from_recipe(recipe).stage(0)
    route = loss_route(recipe, layout, Stage.SEARCH, "/models/judge")
    assert route.where == "policy"
    with holder:
        policy = holder.serve("/models/judge", stage)
        with loss_scorer(SimpleNamespace(recipe=recipe, servers=holder), route, stage) as score:
            score(["Alice: hi"])
        assert no_driver_scoring == [policy]
        assert not (tmp_path / "logs" / "search_loss_server.log").exists()


def test_no_process_outlives_the_node_servers(tmp_path):
    """The launcher's process group (the ssh stand-in and the server it started) goes with the run."""
    shim, _ = write_shim(tmp_path)
    hosts = {"train_hosts": ["127.0.0.1", "127.0.0.1"], "train_launcher_executable": str(shim)}
    recipe = sft_recipe(tmp_path, cal_ppl=False, cpu_kvcache_space_gb=1, **hosts)
    allocation = allocate_hardware(recipe, Hardware(1, 0, 0.0), [0, 1])
    holder = ServerHolder(recipe, FAKE_ENV, layout=allocation.layout, node_launcher=NodeCommands(allocation.training))
    with holder:
        holder.serve("/models/base", RunPaths.from_recipe(recipe).stage(0))
        launcher_group = holder.node_servers[0].pgid
        assert group_members(launcher_group)
    assert group_members(launcher_group) == []


def test_a_node_servers_api_key_is_redacted_from_its_log(tmp_path):
    """The key travels in the ssh command (the node has no other way to get it); the log's command line hides it."""
    from optima.serving.node_servers import node_server_specs
    from optima.serving.vllm_server import VLLMServer

    shim, calls = write_shim(tmp_path)
    hosts = {"train_hosts": ["127.0.0.1", "127.0.0.1"], "train_launcher_executable": str(shim)}
    recipe = sft_recipe(tmp_path, cal_ppl=False, cpu_kvcache_space_gb=1, api_key="s3cret-key", **hosts)
    allocation = allocate_hardware(recipe, Hardware(1, 0, 0.0), [0, 1])
    stage = RunPaths.from_recipe(recipe).stage(0)
    launcher = NodeCommands(allocation.training)
    (spec,) = node_server_specs(recipe, "/models/base", FAKE_ENV, stage, allocation.layout.nodes, launcher, (), 1)
    assert "VLLM_API_KEY=s3cret-key" in spec.argv[-1]
    with VLLMServer(spec) as server:
        server.wait_until_ready(60)
    log = stage.server_log(1).read_text()
    assert "s3cret-key" not in log and "VLLM_API_KEY=<redacted>" in log
