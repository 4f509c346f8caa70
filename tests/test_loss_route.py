"""Where the LM loss is scored, said truthfully by the dry run (issue 32, item 3; optima/stages/common.py).

With ``loss_placement: after`` the tree search keeps the policy served, so unless the policy is the loss model its
losses come from transformers in the driver process (fp32, on the CPU); the dry run said "vllm backend".
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from optima.config import DPORecipe, load_recipe
from optima.config.rules import loss_model
from optima.hardware.allocation import allocate_hardware
from optima.hardware.machine import parse_hardware
from optima.stages.common import loss_route

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def dpo(**overrides):
    return load_recipe(DPORecipe, REPO / "train/dpo_recipes/arc.yaml", overrides, check_paths=False)


def test_the_route_of_each_case():
    after = dpo(loss_placement="after")
    loss = str(loss_model(after))
    assert loss_route(after, False, "runs/ckpt", keep_served=True) == "in process"
    assert loss_route(after, False, loss, keep_served=True) == "served"  # the policy is the loss model
    assert loss_route(after, False, "runs/ckpt", keep_served=False) == "served"  # started in place of the policy
    assert loss_route(dpo(), True, "runs/ckpt", keep_served=True) == "loss server"
    assert loss_route(dpo(cal_ppl=False), True, None, keep_served=True) == "off"
    assert loss_route(dpo(loss_backend="hf"), False, loss, keep_served=False) == "in process"


def test_dry_run_says_the_search_scores_in_the_driver(tmp_path, capsys):
    from optima.cli import run_loop_script

    argv = ["--train_config_path", "train/dpo_recipes/arc.yaml", "--vllm_env", sys.executable]
    argv += ["--alignment_env", sys.executable, "--set", f"output_dir={tmp_path / 'run'}"]
    argv += ["--set", "loss_placement=after", "--dry-run", "--hardware", "8x80GB"]
    assert run_loop_script(DPORecipe, "", argv) == 0
    out = capsys.readouterr().out
    assert out.count("LM loss: meta-llama/Meta-Llama-3-8B-Instruct with transformers in the driver process") == 2
    assert "note: the tree search scores LM losses" in out


def test_with_the_loss_server_the_dry_run_names_it():
    allocation = allocate_hardware(dpo(), parse_hardware("8x80GB"), [0])
    assert not any("tree search scores" in note for note in allocation.notes)
