"""Shared fixtures: the tiny local model, recipes for serving/generation tests, scripted OpenAI servers.

Nothing here downloads anything: the tiny model is built from scratch once per session (``tests/tiny_model.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from optima.hardware.machine import has_gpu
from tests.ci_strict import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks: CI fails on skips for missing set-up)
from tests.fake_openai import FakeOpenAIServer
from tests.helpers import build_test_recipe

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venvs" / "vllm" / "bin" / "python"
SMOLLM2 = REPO / "models" / "SmolLM2-135M-Instruct"

requires_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venvs/vllm (run `make setup`)")
requires_smollm2 = pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(), reason="no SmolLM2 (run `make setup`)")
require_gpu = pytest.mark.skipif(not has_gpu(), reason="needs a visible NVIDIA GPU")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random 2-layer Llama with a word-level tokenizer and a ChatML template (built once per session)."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "model")


@pytest.fixture
def make_recipe(tmp_path):
    """``make_recipe(max_turns=6, ...)``: a test recipe writing under ``tmp_path``."""

    def make(**overrides):
        return build_test_recipe(tmp_path / "run", **overrides)

    return make


@pytest.fixture
def fake_server():
    """One scripted OpenAI server (default: conversations agree on B after three utterances)."""
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture
def fake_servers():
    """Two scripted OpenAI servers (two replicas)."""
    with FakeOpenAIServer() as first, FakeOpenAIServer() as second:
        yield [first, second]
