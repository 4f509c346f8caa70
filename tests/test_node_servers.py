"""Every training node serves the policy, and the tree search's LM loss is served whatever the loss placement.

Issue 32 items 10 and 3. With ``train_launcher: srun`` the allocation places the other nodes' replicas
(``ServerLayout.nodes``) on their nodes; the holder starts each one as an srun step on its node (here a stand-in for
srun that runs the command on this machine, recording it: ``tests/helpers.write_fake_slurm``) and pools them with
node 0's; with ``loss_placement: after`` on a GPU the search scores on a loss server started for it and stopped
after it. Servers are the fake ``vllm`` (``tests/fake_vllm.py``). The real engine on two loopback nodes:
``tests/test_multinode_generation.py`` (slow).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from optima.hardware.allocation import allocate_hardware
from optima.hardware.machine import Hardware, parse_hardware
from optima.hardware.placement import NodeServers, Placement, describe_layout, place_servers
from optima.paths import RunPaths
from optima.serving.holder import ServerHolder
from optima.serving.node_servers import node_server_specs
from optima.serving.processes import group_members
from optima.serving.vllm_server import VLLMServer, answers_health
from tests.helpers import slurm_env, write_fake_slurm
from tests.test_hardware_allocation import recipe_at
from tests.test_layout import FAKE_ENV, sft_recipe

PRIVATE = {"api_key": "k", "private_hosts": ["n2"]}  # the other nodes' servers bind to their names


@pytest.fixture
def slurm(tmp_path, monkeypatch) -> Path:
    """A fake allocation of two nodes (this machine twice); the srun calls' file."""
    folder, calls = write_fake_slurm(tmp_path / "slurm", nodes=2)
    for name, value in slurm_env(folder).items():
        monkeypatch.setenv(name, value)
    return calls


def two_cpu_nodes(tmp_path: Path, **overrides):
    recipe = sft_recipe(tmp_path, cal_ppl=False, cpu_kvcache_space_gb=1, train_launcher="srun", **overrides)
    return recipe, allocate_hardware(recipe, Hardware(2, 0, 0.0), [0, 1])


def test_the_allocation_gives_every_training_node_the_policy_replicas():
    recipe = recipe_at("train/sft_recipes/arc.yaml", train_launcher="srun", **PRIVATE)
    allocation = allocate_hardware(recipe, parse_hardware("2x8x80GB"), [0])
    assert not allocation.problems
    (node,) = allocation.layout.nodes
    assert (node.rank, node.host) == (1, "")  # a Slurm node, named at run time
    # node 0's replicas, but each keeps the whole share (no loss server there), and sleeps for training
    assert node.policy == tuple(Placement(gpus=(str(g),), carry_over=True) for g in range(8))
    assert "node 1 (Slurm): GPUs 0; 1; 2; 3; 4; 5; 6; 7, pooled with node 0" in allocation.lines
    lines = describe_layout(recipe, "/m", allocation.layout)
    assert "started through srun" in lines["node 1 policy replica 7"]


def test_srun_nodes_bind_to_their_names_so_they_need_an_api_key():
    recipe = recipe_at("train/sft_recipes/arc.yaml", train_launcher="srun")
    allocation = allocate_hardware(recipe, parse_hardware("2x8x80GB"), [0])
    assert any(
        "nodes 1-1: its servers bind to each Slurm node's name" in p and "api_key" in p for p in allocation.problems
    )


def test_a_node_server_is_one_srun_step_on_its_node_with_no_secret_on_its_command_line(tmp_path, slurm):
    recipe, allocation = two_cpu_nodes(tmp_path, api_key="s3cret-key", sleep_mode=False)
    stage = RunPaths.from_recipe(recipe).stage(0)
    (spec,) = node_server_specs(recipe, "/models/base", FAKE_ENV, stage, allocation.layout.nodes, (), 1)
    step = list(spec.argv[: spec.argv.index("--overlap") + 2])
    assert step[:7] == ["srun", "--nodes", "1", "--ntasks", "1", "--ntasks-per-node", "1"]
    assert step[7] == "--cpus-per-task" and step[9:] == ["--relative", "1", "--overlap", "--kill-on-bad-exit=1"]
    assert spec.host == "127.0.0.1" and f"--host 127.0.0.1 --port {spec.port}" in " ".join(spec.argv)
    assert "s3cret-key" not in " ".join(spec.argv) and spec.env["VLLM_API_KEY"] == "s3cret-key"  # srun carries it
    assert "OPTIMA_PARENT_PID" not in spec.env  # the driver's pid means nothing on another node
    with VLLMServer(spec) as server:
        server.wait_until_ready(60)
    (call,) = [json.loads(line) for line in slurm.read_text().splitlines()]
    assert call == list(spec.argv[1:]) and "s3cret-key" not in stage.server_log(1).read_text()


def test_the_holder_pools_every_nodes_servers_and_stops_them_for_training(tmp_path, slurm):
    recipe, allocation = two_cpu_nodes(tmp_path, sleep_mode=False)
    assert allocation.layout.nodes == (NodeServers(1, "", (Placement(),)),)
    holder = ServerHolder(recipe, FAKE_ENV, layout=allocation.layout)
    stage = RunPaths.from_recipe(recipe).stage(0)
    with holder:
        urls = holder.serve("/models/base", stage)
        assert len(urls) == 2 and len(set(urls)) == 2  # node 0's replica and node 1's, one pool
        assert all(answers_health(url) for url in urls)
        (call,) = slurm.read_text().splitlines()  # node 1's server went through srun, node 0's did not
        port = urls[1].rsplit(":", 1)[1].removesuffix("/v1")
        assert "--relative" in call and f'"--port", "{port}"' in call
        assert stage.server_log(1).read_text().startswith("=== optima: starting")
        launcher_group = holder.node_servers[0].pgid
        assert group_members(launcher_group)
        holder.release_for_training()  # without sleep_mode every replica stops, on every node
        assert not any(answers_health(url) for url in urls) and group_members(launcher_group) == []
        assert holder.node_servers == []


def test_no_process_outlives_the_node_servers(tmp_path, slurm):
    """srun's process group (the stand-in and the server it started) goes with the run."""
    recipe, allocation = two_cpu_nodes(tmp_path)
    holder = ServerHolder(recipe, FAKE_ENV, layout=allocation.layout)
    with holder:
        holder.serve("/models/base", RunPaths.from_recipe(recipe).stage(0))
        launcher_group = holder.node_servers[0].pgid
        assert group_members(launcher_group)
    assert group_members(launcher_group) == []


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
