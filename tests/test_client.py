"""ReplicaPool against scripted OpenAI servers: request shape, the SDK's retries, errors it does not retry,
fail-over."""

from __future__ import annotations

import pytest

from optima.serving.client import NoReplicaLeft, ReplicaPool, RequestFailed, Sampling
from optima.serving.vllm_server import find_free_port
from tests.fake_openai import FakeOpenAIServer, FakeReply

MESSAGES = [{"role": "system", "content": "You are Alice."}, {"role": "user", "content": "Problem: 2+2"}]


class Script:
    """Replies in order (the last one repeats)."""

    def __init__(self, *replies: FakeReply):
        self.replies, self.calls = list(replies), 0

    def __call__(self, body: dict) -> FakeReply:
        self.calls += 1
        return self.replies[min(self.calls, len(self.replies)) - 1]


def dead_url() -> str:
    return f"http://127.0.0.1:{find_free_port('127.0.0.1', 23000)}/v1"


def test_request_carries_model_sampling_seed_and_key(make_recipe):
    with FakeOpenAIServer(Script(FakeReply("Alice: hi", completion_tokens=3))) as server:
        pool = ReplicaPool([server.base_url], make_recipe(api_key="k1", served_model_name="m"))
        reply = pool.chat(0, MESSAGES, Sampling(temperature=0.3, max_tokens=50, seed=11))
        body, headers = server.requests[0]
    assert (reply.text, reply.finish_reason, reply.completion_tokens, reply.replica) == ("Alice: hi", "stop", 3, 0)
    assert body["model"] == "m" and body["messages"] == MESSAGES
    assert (body["temperature"], body["max_tokens"], body["seed"]) == (0.3, 50, 11)
    assert headers["authorization"] == "Bearer k1"


def test_missing_usage_gives_no_token_count(make_recipe):
    with FakeOpenAIServer(Script(FakeReply("x", usage=False))) as server:
        reply = ReplicaPool([server.base_url], make_recipe()).chat(0, MESSAGES, Sampling(0.0, 5))
    assert reply.completion_tokens is None and "seed" not in server.bodies()[0]


@pytest.mark.parametrize("status", [500, 503, 429])
def test_transient_errors_are_retried(make_recipe, status):
    script = Script(FakeReply(status=status), FakeReply(status=status), FakeReply("ok"))
    with FakeOpenAIServer(script) as server:
        pool = ReplicaPool([server.base_url], make_recipe(max_retries=2))
        reply = pool.chat(0, MESSAGES, Sampling(0, 5))
    assert reply.text == "ok" and script.calls == 3


def test_retries_are_capped(make_recipe):
    script = Script(FakeReply(status=500))
    with FakeOpenAIServer(script) as server:
        pool = ReplicaPool([server.base_url], make_recipe(max_retries=2))
        with pytest.raises(RequestFailed, match="after 3 attempts"):
            pool.chat(0, MESSAGES, Sampling(0, 5))
    assert script.calls == 3 and pool.dead == set()  # a server that answers 5xx is not dead


def test_client_errors_are_not_retried(make_recipe):
    script = Script(FakeReply(status=400))
    with FakeOpenAIServer(script) as server:
        pool = ReplicaPool([server.base_url], make_recipe(max_retries=3))
        with pytest.raises(RequestFailed, match="replica 0"):
            pool.chat(0, MESSAGES, Sampling(0, 5))
    assert script.calls == 1


def test_timeouts_are_retried_then_fail(make_recipe):
    script = Script(FakeReply("slow", delay_s=1.6))
    with FakeOpenAIServer(script) as server:
        pool = ReplicaPool([server.base_url], make_recipe(request_timeout_s=1, max_retries=1))
        with pytest.raises(RequestFailed):
            pool.chat(0, MESSAGES, Sampling(0, 5))
    assert script.calls == 2 and pool.dead == set()


def test_dead_replica_fails_over_and_stays_dead(make_recipe, fake_server):
    pool = ReplicaPool([dead_url(), fake_server.base_url], make_recipe(max_retries=1))
    assert pool.route(0) == 0
    reply = pool.chat(0, MESSAGES, Sampling(0, 5))
    assert reply.replica == 1 and pool.dead == {0}
    assert pool.route(0) == 1 and pool.route(1) == 1


def test_round_robin_routing(make_recipe, fake_servers):
    pool = ReplicaPool([s.base_url for s in fake_servers], make_recipe())
    assert [pool.route(k) for k in range(5)] == [0, 1, 0, 1, 0]


def test_no_replica_left(make_recipe):
    pool = ReplicaPool([dead_url(), dead_url()], make_recipe(max_retries=0))
    with pytest.raises(NoReplicaLeft):
        pool.chat(1, MESSAGES, Sampling(0, 5))
    assert pool.dead == {0, 1}


def test_stopped_pool_refuses_requests(make_recipe, fake_server):
    pool = ReplicaPool([fake_server.base_url], make_recipe())
    pool.close()
    with pytest.raises(NoReplicaLeft, match="stopping"):
        pool.chat(0, MESSAGES, Sampling(0, 5))
