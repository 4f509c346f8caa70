"""generate_conversations against scripted OpenAI servers: routing, records, resume, seeds, pool, failover, kills."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from optima.agents.conversation import GenerationSettings, Prefill
from optima.agents.generation import generate_conversations, generation_settings
from optima.agents.prompts import build_agent_messages, build_system_prompt
from optima.serving.client import NoReplicaLeft, RequestFailed
from optima.serving.processes import group_members
from optima.serving.vllm_server import find_free_port
from optima.store import load_records
from optima.tasks import Example
from tests.fake_openai import FakeOpenAIServer, FakeReply, agreeing_reply, question_of, speaker_of, turn_of
from tests.helpers import arc_examples, child_groups, count_lines, wait_for, with_default_signals

DRIVER = Path(__file__).with_name("generation_driver.py")
SETTINGS = GenerationSettings(iteration=1, temperature=0.7, samples=2)


def run(recipe, servers, out: Path, examples=None, generation: GenerationSettings = SETTINGS):
    examples = examples if examples is not None else arc_examples(3)
    return generate_conversations(recipe, examples, [s.base_url for s in servers], out, generation)


def keys(path: Path) -> list[tuple[str, int]]:
    return [(r["task_id"], r["sample_index"]) for r in load_records(path)[0]]


def test_conversations_are_written_and_routed_round_robin(make_recipe, fake_servers, tmp_path):
    out = tmp_path / "gen.jsonl"
    stats = run(make_recipe(), fake_servers, out, arc_examples(5))
    records, torn = load_records(out)
    assert not torn and len(records) == 10 and sorted(keys(out)) == [(f"q{i}", k) for i in range(5) for k in (0, 1)]
    assert stats.written == 10 and stats.statuses == {"ok": 10} and stats.already_done == 0
    for record in records:
        position = int(record["task_id"][1:])
        assert record["replica"] == position % 2
        assert (record["status"], record["stop_reason"], record["final_answer"]) == ("ok", "same_answer", "B")
        assert [u["speaker"] for u in record["utterances"]] == ["Alice", "Bob", "Alice"]
        assert record["token_count"] == sum(u["tokens"] for u in record["utterances"]) == 19
        assert record["agent_tokens"] == {"Alice": 16, "Bob": 3}
    # Every turn of a question's conversations went to the same server.
    for index, server in enumerate(fake_servers):
        questions = {re.search(r"Question (\d+)", question_of(body)).group(1) for body in server.bodies()}
        assert questions == {str(i) for i in range(5) if i % 2 == index}
    assert stats.generated_tokens == 190 and stats.tokens_per_s > 0


def test_record_keeps_what_reward_and_selection_need(make_recipe, fake_server, tmp_path):
    out = tmp_path / "gen.jsonl"
    run(make_recipe(), [fake_server], out, arc_examples(1), GenerationSettings(3, 0.5, 1))
    (record,), _ = load_records(out)
    assert record["system_prompts"] == {
        "Alice": build_system_prompt("arc", "Alice"),
        "Bob": build_system_prompt("arc", "Bob"),
    }
    assert (record["iteration"], record["temperature"], record["prompt_pool"]) == (3, 0.5, False)
    assert record["error"] is None
    assert record["question"] == "Question 0: what is 2 + 2?" and record["answer"] == "B"
    assert Example.from_dict(record["example"]) == arc_examples(1)[0]
    assert all(not u["text"].startswith(("Alice", "Bob")) for u in record["utterances"])
    assert {body["temperature"] for body in fake_server.bodies()} == {0.5}


def test_resume_cuts_a_torn_line_and_only_runs_what_is_missing(make_recipe, fake_server, tmp_path):
    out = tmp_path / "gen.jsonl"
    run(make_recipe(), [fake_server], out)
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:3]) + lines[3][:25])  # killed while writing the 4th line
    before = len(fake_server.requests)
    stats = run(make_recipe(), [fake_server], out)
    assert (stats.already_done, stats.written) == (3, 3)
    assert len(fake_server.requests) - before == 3 * 3  # three conversations of three utterances
    assert sorted(keys(out)) == [(f"q{i}", k) for i in range(3) for k in (0, 1)]
    assert run(make_recipe(), [fake_server], out).written == 0


def test_failed_requests_are_recorded_as_errors_and_retried_on_resume(make_recipe, tmp_path):
    def refuse_q1(body: dict) -> FakeReply:
        return FakeReply(status=400) if "Question 1" in question_of(body) else agreeing_reply(body)

    out = tmp_path / "gen.jsonl"
    with FakeOpenAIServer(refuse_q1) as server:
        stats = run(make_recipe(), [server], out)
    assert stats.statuses == {"ok": 4, "error": 2}
    errors = [r for r in load_records(out)[0] if r["status"] == "error"]
    assert {r["task_id"] for r in errors} == {"q1"} and all(r["utterances"] == [] for r in errors)
    assert "400" in errors[0]["error"]
    with FakeOpenAIServer() as server:
        stats = run(make_recipe(), [server], out)
    assert (stats.already_done, stats.statuses) == (4, {"ok": 2})
    assert sorted(keys(out)) == [(f"q{i}", k) for i in range(3) for k in (0, 1)]


def test_request_seeds_are_reproducible_and_distinct(make_recipe, tmp_path):
    def seeds(out: Path) -> dict:
        with FakeOpenAIServer() as server:
            run(make_recipe(), [server], out)
            # Both samples of a question send the same messages: compare (messages, seed) pairs as a sorted list.
            return sorted((json.dumps(b["messages"]), b["seed"]) for b in server.bodies())

    first, second = seeds(tmp_path / "a.jsonl"), seeds(tmp_path / "b.jsonl")
    with FakeOpenAIServer() as server:
        run(make_recipe(), [server], tmp_path / "c.jsonl")
        all_seeds = [b["seed"] for b in server.bodies()]
    assert first == second
    assert len(set(all_seeds)) == len(all_seeds)  # every (question, sample, turn) has its own seed


def test_prompt_pool_is_drawn_per_conversation_and_reproducibly(make_recipe, fake_server, tmp_path):
    generation = GenerationSettings(iteration=0, temperature=0.3, samples=4, use_prompt_pool=True)
    run(make_recipe(), [fake_server], tmp_path / "a.jsonl", arc_examples(3), generation)
    run(make_recipe(), [fake_server], tmp_path / "b.jsonl", arc_examples(3), generation)
    first, second = load_records(tmp_path / "a.jsonl")[0], load_records(tmp_path / "b.jsonl")[0]
    prompts = {(r["task_id"], r["sample_index"]): r["system_prompts"]["Alice"] for r in first}
    assert prompts == {(r["task_id"], r["sample_index"]): r["system_prompts"]["Alice"] for r in second}
    assert len(set(prompts.values())) > 1 and build_system_prompt("arc", "Alice") not in prompts.values()
    assert {r["system_prompts"]["Bob"] for r in first} == {build_system_prompt("arc", "Bob")}  # debate: critic fixed


@pytest.mark.parametrize(
    ("task", "iteration", "override", "temperature", "pool"),
    [
        ("arc", 0, None, 0.3, True),
        ("gsm8k", 0, None, 0.7, True),
        ("arc", 1, None, 0.7, False),
        ("arc", 0, 0.9, 0.9, True),
    ],
)
def test_settings_follow_the_temperature_schedule(make_recipe, task, iteration, override, temperature, pool):
    generation = generation_settings(make_recipe(dataset_type=task, temperature_iteration0=override), iteration)
    assert (generation.temperature, generation.use_prompt_pool, generation.samples, generation.iteration) == (
        temperature,
        pool,
        2,
        iteration,
    )


def test_a_replica_dying_mid_run_fails_over(make_recipe, tmp_path):
    first = FakeOpenAIServer().start()
    calls = []

    def die_after_three(body: dict) -> FakeReply:
        calls.append(1)
        if len(calls) == 3:
            threading.Thread(target=second.stop).start()
        return agreeing_reply(body)

    second = FakeOpenAIServer(die_after_three).start()
    out = tmp_path / "gen.jsonl"
    try:
        stats = run(make_recipe(max_retries=1), [first, second], out, arc_examples(6))
    finally:
        first.stop()
    records = load_records(out)[0]
    assert stats.statuses == {"ok": 12} and len(records) == 12
    assert {r["replica"] for r in records if int(r["task_id"][1:]) % 2 == 1} == {0}  # all ended on replica 0


def test_no_replica_left_stops_the_run_without_error_records(make_recipe, tmp_path):
    dead = [f"http://127.0.0.1:{find_free_port('127.0.0.1', 24000 + i)}/v1" for i in range(2)]
    out = tmp_path / "gen.jsonl"
    with pytest.raises(NoReplicaLeft):
        generate_conversations(make_recipe(max_retries=0), arc_examples(2), dead, out, SETTINGS)
    assert count_lines(out) == 0


def start_driver(tmp_path: Path, config: dict) -> subprocess.Popen:
    path = tmp_path / "driver.json"
    path.write_text(json.dumps({"output_dir": str(tmp_path / "run"), "out": str(tmp_path / "gen.jsonl"), **config}))
    log = open(tmp_path / "driver.log", "ab")  # noqa: SIM115 - the child keeps it
    argv = with_default_signals([sys.executable, str(DRIVER), str(path)])  # the tests interrupt it
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def test_kill_9_then_rerun_loses_and_duplicates_nothing(tmp_path):
    def slow(body: dict) -> FakeReply:
        reply = agreeing_reply(body)
        reply.delay_s = 0.05
        return reply

    with FakeOpenAIServer(slow) as server:
        config = {"examples": 15, "samples": 2, "recipe": {"endpoints": [server.base_url], "thread_count": 3}}
        driver = start_driver(tmp_path, config)
        wait_for(lambda: count_lines(tmp_path / "gen.jsonl") >= 4, 60, "a few lines")
        driver.kill()
        driver.wait(timeout=30)
        written = count_lines(tmp_path / "gen.jsonl")
        assert written < 30
        rerun = start_driver(tmp_path, config)
        assert rerun.wait(timeout=120) == 0
    assert sorted(keys(tmp_path / "gen.jsonl")) == sorted((f"q{i}", k) for i in range(15) for k in (0, 1))


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, None), (signal.SIGTERM, 143)])
def test_interrupting_the_driver_leaves_no_server_behind(tmp_path, monkeypatch, sig, code):
    monkeypatch.setenv("FAKE_VLLM_CHILD", "1")
    monkeypatch.setenv("FAKE_VLLM_DELAY_S", "0.05")
    port = find_free_port("127.0.0.1", 25000 + os.getpid() % 5000)
    config = {"examples": 40, "samples": 2, "vllm_env": "fake", "cpu_replicas": 2, "recipe": {"port": port}}
    driver = start_driver(tmp_path, config)
    wait_for(lambda: count_lines(tmp_path / "gen.jsonl") >= 2, 60, "generation to start")
    groups = child_groups(driver.pid)
    assert len(groups) == 2 and all(len(group_members(g)) == 2 for g in groups)
    driver.send_signal(sig)
    returncode = driver.wait(timeout=60)
    assert returncode != 0 and (code is None or returncode == code)
    assert not any(group_members(g) for g in groups), (tmp_path / "driver.log").read_text()[-2000:]


def hotpot_examples(count: int) -> list[Example]:
    """``count`` information-exchange questions (task ``hotpot_qa``), each agent holding one paragraph."""
    return [
        Example(f"h{i}", "hotpot_qa", f"Question {i}: where do the Niles meet?", "Khartoum", "f1",
                (f"Paragraph {i}: Lake Tana feeds the Blue Nile.",), (f"Paragraph {i}: the Niles meet at Khartoum.",))
        for i in range(count)
    ]  # fmt: skip


def test_information_exchange_prefills_bobs_opening_view_beside_alices_first_turn(make_recipe, tmp_path):
    """Bob's system + task turn goes out with max_tokens 1 while Alice's first turn runs; its reply is discarded."""
    prefilled, alice_waited = threading.Event(), []
    first_reply = "Alice:  Lake Tana feeds the Blue Nile <A>B</A>  \n"

    def respond(body: dict) -> FakeReply:
        if body["max_tokens"] == 1:
            prefilled.set()
            return FakeReply("Bob: PREFILL", completion_tokens=1)
        if speaker_of(body) == "Alice" and turn_of(body) == 0:
            alice_waited.append(prefilled.wait(10))  # Alice's first turn ends only once Bob's prefill arrived
            return FakeReply(first_reply)
        return agreeing_reply(body)

    out = tmp_path / "gen.jsonl"
    with FakeOpenAIServer(respond) as server:
        stats = run(make_recipe(max_turns=6), [server], out, hotpot_examples(2), GenerationSettings(1, 0.7, 1))
    assert alice_waited == [True, True]  # sent beside Alice's first turn, not after it
    records = load_records(out)[0]
    prefills = [body for body in server.bodies() if body["max_tokens"] == 1]
    assert len(prefills) == 2 and {body["temperature"] for body in prefills} == {0.0}
    for record in records:
        example = Example.from_dict(record["example"])
        bob_view = build_agent_messages(example, "Bob", [], record["system_prompts"]["Bob"])
        assert sum(body["messages"] == bob_view for body in prefills) == 1  # exactly Bob's opening view
        bodies = [b for b in server.bodies() if f"Question {example.id[1:]}:" in question_of(b)]
        bob_turns = [i for i, b in enumerate(bodies) if speaker_of(b) == "Bob" and b["max_tokens"] > 1]
        assert bodies.index(next(b for b in prefills if b["messages"] == bob_view)) < bob_turns[0]
        # Never in the conversation, never counted: 3 utterances, their tokens only.
        assert [u["speaker"] for u in record["utterances"]] == ["Alice", "Bob", "Alice"]
        assert all("PREFILL" not in u["text"] for u in record["utterances"])
        assert record["token_count"] == sum(u["tokens"] for u in record["utterances"]) == 8 + 3 + 8
        assert record["agent_tokens"] == {"Alice": 16, "Bob": 3}
    assert stats.generated_tokens == 2 * 19


def test_an_agents_second_prompt_holds_its_first_reply_byte_for_byte(make_recipe, tmp_path):
    """Information exchange: Alice's own first reply comes back verbatim (prefix cache); Bob sees the rendering."""
    first_reply = "Alice:  Lake Tana feeds the Blue Nile <A>B</A>  \n"

    def respond(body: dict) -> FakeReply:
        if speaker_of(body) == "Alice" and turn_of(body) == 0 and body["max_tokens"] > 1:
            return FakeReply(first_reply)
        return agreeing_reply(body)

    with FakeOpenAIServer(respond) as server:
        run(
            make_recipe(max_turns=6),
            [server],
            tmp_path / "gen.jsonl",
            hotpot_examples(1),
            GenerationSettings(1, 0.7, 1),
        )
    turns = [body["messages"] for body in server.bodies() if body["max_tokens"] > 1]
    alice_first, bob_first, alice_second = turns
    assert alice_second[: len(alice_first)] == alice_first
    assert alice_second[len(alice_first)] == {"role": "assistant", "content": first_reply}
    assert bob_first[-1]["content"].endswith("\n\nAlice: Lake Tana feeds the Blue Nile <A>B</A>")
    (record,), _ = load_records(tmp_path / "gen.jsonl")
    assert record["utterances"][0]["text"] == "Lake Tana feeds the Blue Nile <A>B</A>"  # what the reward reads


def test_debate_sends_no_prefill(make_recipe, fake_server, tmp_path):
    run(make_recipe(), [fake_server], tmp_path / "gen.jsonl", arc_examples(2))
    assert fake_server.bodies() and all(body["max_tokens"] == 32 for body in fake_server.bodies())


@pytest.mark.parametrize(("error", "raised"), [(RequestFailed("400"), False), (ValueError("a bug"), True)])
def test_a_failed_prefill_costs_only_the_cache_hit_but_a_bug_is_raised(error, raised):
    class FailingPool:
        def chat(self, replica, messages, sampling):
            assert sampling.max_tokens == 1
            raise error

    prefill = Prefill(FailingPool(), 0, [{"role": "user", "content": "x"}])
    if raised:
        with pytest.raises(ValueError, match="a bug"), prefill:
            pass
    else:
        with prefill:
            pass
