"""bench.generation's recording of the generator against a scripted server: requests as sent, concurrency."""

from __future__ import annotations

import time

import bench.generation as bench
from optima.agents.conversation import GenerationSettings
from optima.agents.generation import GenerationHooks, generate_conversations
from tests.fake_openai import FakeOpenAIServer, agreeing_reply
from tests.test_generation import hotpot_examples


def test_plain_client_gets_the_conversations_the_generator_had_in_flight(make_recipe, tmp_path):
    """3 conversations under a KV bound of 8: the plain client gets 3 threads; prefills are recorded apart."""

    def respond(body):
        time.sleep(0.05)  # a slow "model": the three conversations overlap
        return agreeing_reply(body)

    bench.TurnRecordingRunner.log = bench.GeneratorLog()
    with FakeOpenAIServer(respond) as server:
        recipe = make_recipe(thread_count=8, max_turns=6)
        hooks = GenerationHooks(bench.TurnRecordingRunner)
        stats = generate_conversations(recipe, hotpot_examples(3), [server.base_url], tmp_path / "g.jsonl",
                                       GenerationSettings(1, 0.7, 1), hooks)  # fmt: skip
    log = bench.TurnRecordingRunner.log
    assert (log.peak_in_flight, log.in_flight) == (3, 0)
    assert bench.plain_client_threads(log, kv_in_flight=8, threads=64) == 3
    assert bench.plain_client_threads(bench.GeneratorLog(), kv_in_flight=8, threads=64) == 8  # nothing recorded
    # Every conversation request as sent, with its reply's length; Bob's prefills (max_tokens 1) are not compared.
    sent = [body for body in server.bodies() if body["max_tokens"] > 1]
    assert sorted(str(r.messages) for r in log.requests) == sorted(str(body["messages"]) for body in sent)
    assert len(log.prefills) == 3 and len(log.requests) == 9
    assert sum(r.tokens for r in log.requests) == stats.generated_tokens
    assert sorted(turn for turn, _, _ in log.turns) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
