"""Helpers shared by the task-layer tests (data location, a local Llama-3-style tokenizer, a hanging checker).

Kept out of conftest.py on purpose (that file belongs to the foundation tests); import what you need from here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_DIR = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"

# The standard Meta-Llama-3-8B-Instruct chat template (the original's base model, without its name forcing).
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "[UNK]")


def resolve_test_data_dir() -> Path:
    """The dataset samples the tests read: `$OPTIMA_DATA_DIR`, else the repository's `data/` (data/README.md)."""
    value = os.environ.get("OPTIMA_DATA_DIR", "")
    return Path(value) if value else REPO_ROOT / "data"


def build_llama3_tokenizer():
    """A word-level fast tokenizer with Llama-3's special tokens and chat template, built locally (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", unk_token="[UNK]"
    )
    tokenizer.chat_template = LLAMA3_CHAT_TEMPLATE
    return tokenizer


def hanging_check(prediction: str, gold: str, timeout_s: int) -> bool:
    """A math checker that ignores its own time limit (exercises MathVerifier's hard deadline)."""
    time.sleep(60)
    return True


def timed_out_check(prediction: str, gold: str, timeout_s: int) -> bool | None:
    """A math checker that always times out (None), noting each try as a line of the file named by ``gold``."""
    with open(gold, "a") as tries:
        tries.write("try\n")
    return None


def slow_once_check(prediction: str, gold: str, timeout_s: int) -> bool | None:
    """A math checker that times out on its first try (noted in the file named by ``gold``), then answers True."""
    tries = Path(gold)
    if not tries.exists():
        tries.write_text("try\n")
        return None
    return True


def echo_check(prediction: str, gold: str, timeout_s: int) -> bool:
    """A math checker that answers at once: equal iff the strings are equal."""
    return prediction == gold
