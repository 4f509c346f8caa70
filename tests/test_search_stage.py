"""The search stage (``optima.stages.search``) against a scripted server: tokens counted as generation counts
them when the server sends no usage, and failed requests retried, then left out and counted.

See docs/method.md#rollouts.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from optima import stages
from optima.config import DPORecipe, load_recipe
from optima.methods import Stage
from optima.paths import StagePaths
from optima.run import Part, Settings, loss_route
from optima.selection.mcts import ERROR_RETRIES
from optima.stages import search
from optima.store import load_records
from tests.fake_openai import FakeOpenAIServer, FakeReply, question_of, speaker_of
from tests.helpers import arc_examples
from tests.tiny_model import build_tiny_tokenizer

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = arc_examples(2)  # q1's Bob always fails; q0 answers without usage
ALICE = "Alice: 2 + 2 = 4 so the answer is <A>B</A>"


def respond(body: dict) -> FakeReply:
    """No usage in any reply; every request of Bob about question 1 fails (HTTP 400: failed for good at once)."""
    if speaker_of(body) == "Bob":
        if "Question 1:" in question_of(body):
            return FakeReply(status=400)
        return FakeReply("Bob: 4 is right", usage=False)
    return FakeReply(ALICE, usage=False)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("search")
    tokenizer_dir = tmp_path / "tokenizer"
    build_tiny_tokenizer().save_pretrained(tokenizer_dir)
    overrides = {
        "initial_model_path": str(tokenizer_dir),
        "tokenizer_first_path": str(tokenizer_dir),
        "tokenizer_second_path": str(tokenizer_dir),
        "loss_model_path": None,
        "cal_ppl": False,
        "mcts_selections": 1,
        "mcts_rollouts": 2,
        "max_turns": 4,
        "max_tokens": 64,
        "min_tokens": 0,
        "max_retries": 0,
        "thread_count": 2,
        "output_dir": str(tmp_path / "run"),
    }
    recipe = load_recipe(DPORecipe, REPO / "train/dpo_recipes/arc.yaml", overrides, check_paths=False)
    with pytest.MonkeyPatch.context() as monkeypatch, FakeOpenAIServer(respond) as server:
        monkeypatch.setattr(stages, "training_questions", lambda run, iteration, stage, count: QUESTIONS)
        servers = SimpleNamespace(serve=lambda model, sp: [server.base_url])
        run = SimpleNamespace(recipe=recipe, servers=servers, math_verifier=lambda: contextlib.nullcontext(None))
        sp = StagePaths(tmp_path / "run" / "iteration_0")
        sp.root.mkdir(parents=True)
        part = Part(run, 0, None, "dpo", sp, tmp_path / "ckpt", "m")
        stats = search(part, Settings({}, loss=loss_route(recipe, None, Stage.SEARCH, "m")), 100)  # T_max 100
    lines = {line["task_id"]: line for line in load_records(sp.rollouts)[0]}
    return stats, lines, tokenizer_dir


def test_search_counts_tokens_with_the_tokenizer_when_the_server_sends_no_usage(searched):
    stats, lines, tokenizer_dir = searched
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rollouts = lines["q0"]["rollouts"]
    assert len(rollouts) == 2 and {r["status"] for r in rollouts} == {"ok"}
    expected = [len(tokenizer.tokenize(text)) for text in (ALICE, "Bob: 4 is right", ALICE)]
    for rollout in rollouts:
        assert rollout["tokens"] == expected and rollout["token_count"] == sum(expected) > 0
        # lambda1 * tokens / T_max, not the -1 of a conversation counted as 0 tokens
        assert rollout["reward_parts"]["token_term"] == pytest.approx(-0.4 * sum(expected) / 100)
    assert stats["mean_tokens"] == sum(expected)


def test_failed_requests_are_retried_then_left_out_and_counted(searched):
    stats, lines, _ = searched
    failed = lines["q1"]["rollouts"]
    assert [r["status"] for r in failed] == ["error", "error"]
    assert all(r["reward"] is None and r["failed_requests"] == ERROR_RETRIES + 1 for r in failed)
    assert [n["id"] for n in lines["q1"]["nodes"]] == [0] and lines["q1"]["nodes"][0]["visits"] == 0
    assert stats["rollouts"] == 4 and stats["failed_rollouts"] == 2
    assert stats["failed_requests"] == 2 * (ERROR_RETRIES + 1)
    # The rates are those of the rollouts that were scored: both of q0's answered B (gold B).
    assert (stats["answer_rate"], stats["accuracy"]) == (1.0, 1.0)
    json.dumps(stats)
