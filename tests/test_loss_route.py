"""Where each stage computes its LM losses: one function (``optima.run.loss_route``) decides, the run follows it and
the dry run prints it (issue 32 item 3, issue 40 item 4).

With ``loss_placement: after`` on a GPU the tree search keeps the policy served and scores on a loss server the run
starts for the search (``ServerHolder.search_loss_server``, tests/test_node_servers.py); the dry run said
"transformers in the driver process" there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from optima.config import DPORecipe, SFTRecipe, load_recipe
from optima.config.rules import loss_model
from optima.hardware.allocation import allocate_hardware
from optima.hardware.machine import Hardware, parse_hardware
from optima.loop import planned_parts
from optima.methods import Stage
from optima.run import build_run, loss_route, stage_settings
from tests.test_pipeline import TRAIN_ENV

REPO = Path(__file__).resolve().parent.parent
GPU, CPU = parse_hardware("8x80GB"), Hardware(1, 0, 0.0, source="no GPU")


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def dpo(**overrides):
    return load_recipe(DPORecipe, REPO / "train/dpo_recipes/arc.yaml", overrides, check_paths=False)


def layout_of(recipe, hardware=GPU):
    return allocate_hardware(recipe, hardware, [0, 1]).layout


@pytest.mark.parametrize(
    ("overrides", "hardware", "stage", "served", "where"),
    [
        ({}, GPU, Stage.SEARCH, "runs/ckpt", "loss server"),  # beside: the run's loss server, for every stage
        ({}, GPU, Stage.SCORE, "runs/ckpt", "loss server"),
        ({"loss_placement": "after"}, GPU, Stage.SEARCH, "runs/ckpt", "search loss server"),
        ({"loss_placement": "after"}, GPU, Stage.SEARCH, "LOSS", "policy"),  # the policy is the loss model
        ({"loss_placement": "after"}, CPU, Stage.SEARCH, "runs/ckpt", "in process"),  # no room for a server
        ({"loss_placement": "after"}, GPU, Stage.SCORE, "runs/ckpt", "in place"),  # started in place of the policy
        ({"loss_backend": "hf"}, GPU, Stage.SCORE, "LOSS", "in process"),
        ({"loss_backend": "hf"}, GPU, Stage.SEARCH, "runs/ckpt", "in process"),
        ({"cal_ppl": False}, GPU, Stage.SEARCH, "runs/ckpt", "off"),
    ],
)
def test_the_route_of_each_case(overrides, hardware, stage, served, where):
    recipe = dpo(**overrides)
    served = str(loss_model(recipe)) if served == "LOSS" else served
    route = loss_route(recipe, layout_of(recipe, hardware), stage, served)
    assert route.where == where and route.keeps_policy == (stage == Stage.SEARCH)


def test_generation_scores_only_on_the_loss_server_beside_the_policy(tmp_path):
    values = {"dataset_type": "arc", "initial_model_path": "/models/base", "origin_yaml_path": "x.yaml"}
    beside = load_recipe(SFTRecipe, None, values, check_paths=False)
    after = load_recipe(SFTRecipe, None, values | {"loss_placement": "after"}, check_paths=False)
    assert loss_route(beside, layout_of(beside), Stage.GENERATE, "/models/base").where == "loss server"
    assert loss_route(after, layout_of(after), Stage.GENERATE, "/models/base").where == "off"
    assert loss_route(after, layout_of(after), Stage.SCORE, "/models/base").where == "in place"


def test_the_dry_run_prints_the_route_the_search_takes(tmp_path, capsys):
    """``loss_placement: after`` on 8 GPUs: every [search] stage says the loss server it starts, from the very
    object the search stage runs with."""
    from optima.cli import run_loop_script

    argv = ["--train_config_path", "train/dpo_recipes/arc.yaml", "--vllm_env", sys.executable]
    argv += ["--alignment_env", sys.executable, "--set", f"output_dir={tmp_path / 'run'}"]
    argv += ["--set", "loss_placement=after", "--dry-run", "--hardware", "8x80GB"]
    assert run_loop_script(DPORecipe, "", argv) == 0
    out = capsys.readouterr().out
    recipe = dpo(loss_placement="after", output_dir=str(tmp_path / "run"))
    run = build_run(recipe, {"train": TRAIN_ENV}, hardware=GPU)
    routes = [stage_settings(part)[Stage.SEARCH].loss for part in planned_parts(run)]
    assert {route.where for route in routes} == {"search loss server"} and len(routes) == recipe.iteration_times
    model = loss_model(recipe)
    assert out.count(f"LM loss: {model} on a vLLM loss server started with the tree search") == len(routes)
    assert f"LM loss: {routes[0]}" in out and "transformers in the driver" not in out
