"""Generation throughput: our two-agent conversation generator vs a plain concurrent client, same server.

    .venvs/train/bin/python bench/generation.py                      # SmolLM2 on CPU, 12 ARC questions x 2
    .venvs/train/bin/python bench/generation.py --questions 64 --threads 64 --max-tokens 256
    .venvs/train/bin/python bench/generation.py --task hotpot_qa --questions 12 --samples 2 --max-turns 6 \
        --max-tokens 128 --threads 64                              # information exchange: long contexts

1. Serve the model (``optima.serving.serve`` with the default KV-cache sizing; the dev API is enabled to reset the
   prefix cache, and the usage of each reply carries its cached prompt tokens).
2. Run ``generate_conversations`` and measure generated tokens per second, the prefix-cache hit rate of the stage
   (vLLM's ``/metrics``) and, per conversation turn, the share of prompt tokens the server read from its cache.
3. Rebuild every request it sent from the written records (the chat views are re-rendered from the stored
   utterances, exactly as the generator renders them) with its output length, reset the prefix cache, and send
   the same requests as independent calls, as many at once as the generator had conversations in flight, each
   forced to its recorded length (``ignore_eos`` + ``max_tokens``).
4. Print tokens/s of both and their ratio (the generator's target: >= 0.90 of the plain client) and the hit rates
   (target for multi-turn information exchange: >= 0.8 over turns 2..N).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchlib import add_model_args  # noqa: E402

from optima.agents.generation import ConversationRunner, GenerationPlan, generate_conversations  # noqa: E402
from optima.agents.prompts import AGENT_NAMES, Utterance, build_agent_messages  # noqa: E402
from optima.config import InferenceRecipe, load_recipe  # noqa: E402
from optima.environments import resolve_env  # noqa: E402
from optima.logging_utils import setup_logging  # noqa: E402
from optima.paths import RunPaths  # noqa: E402
from optima.serving import serve  # noqa: E402
from optima.serving.capacity import CacheCounters  # noqa: E402
from optima.serving.kv_monitor import fetch_metrics  # noqa: E402
from optima.store import load_records  # noqa: E402
from optima.tasks import TASKS, Example  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--task", default="arc", choices=sorted(TASKS), help="task whose train questions are used")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--port", type=int, default=8100)
    return parser.parse_args(argv)


def rebuild_requests(records: list[dict], max_tokens: int) -> list[tuple[list[dict], int]]:
    """(messages, output tokens) of every request the generator sent, from its records."""
    requests = []
    for record in records:
        example = Example.from_dict(record["example"])
        utterances = [Utterance(u["speaker"], u["text"]) for u in record["utterances"]]
        for turn, utterance in enumerate(utterances):
            prompt = record["system_prompts"][utterance.speaker]
            messages = build_agent_messages(example, utterance.speaker, utterances[:turn], prompt)
            requests.append((messages, record["utterances"][turn]["tokens"]))
        if record["status"] == "too_long":  # the discarded utterance was generated too
            speaker = AGENT_NAMES[len(utterances) % 2]
            prompt = record["system_prompts"][speaker]
            requests.append((build_agent_messages(example, speaker, utterances, prompt), max_tokens))
    return requests


def run_plain_client(endpoint: str, recipe, requests: list[tuple[list[dict], int]], threads: int, temperature: float):
    """Send every request independently from ``threads`` threads; return (generated tokens, seconds)."""
    import openai

    client = openai.OpenAI(base_url=endpoint, api_key="EMPTY", timeout=recipe.request_timeout_s, max_retries=0)

    def send(item: tuple[list[dict], int]) -> int:
        messages, tokens = item
        response = client.chat.completions.create(
            model=recipe.served_model_name,
            messages=messages,
            temperature=temperature,
            max_tokens=tokens,
            extra_body={"ignore_eos": True},
        )
        return response.usage.completion_tokens

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=threads) as executor:
        generated = sum(executor.map(send, requests))
    return generated, time.monotonic() - started


def reset_prefix_cache(endpoint: str) -> None:
    import requests

    requests.post(endpoint.removesuffix("/v1") + "/reset_prefix_cache", timeout=60).raise_for_status()


def read_counters(endpoint: str) -> CacheCounters:
    return CacheCounters.from_samples(fetch_metrics(endpoint) or [])


class _TurnRecordingPool:
    """The generator's replica pool, recording (turn, prompt tokens, cached tokens) of every reply."""

    def __init__(self, pool, log: list, local: threading.local):
        self._pool, self._log, self._local = pool, log, local

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def chat(self, replica, messages, sampling):
        reply = self._pool.chat(replica, messages, sampling)
        self._local.turn += 1
        self._log.append((self._local.turn, reply.prompt_tokens or 0, reply.cached_tokens or 0))
        return reply


class TurnRecordingRunner(ConversationRunner):
    """``ConversationRunner`` whose requests are logged per conversation turn (1 = Alice's first)."""

    log: list = []

    def __init__(self, recipe, plan, pool):
        self._local = threading.local()
        super().__init__(recipe, plan, _TurnRecordingPool(pool, self.log, self._local))

    def run(self, job):
        self._local.turn = 0
        return super().run(job)


def hit_rates_by_turn(log: list[tuple[int, int, int]]) -> dict[int, tuple[int, int]]:
    """{turn: (prompt tokens, cached tokens)} summed over conversations."""
    totals: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for turn, prompt, cached in log:
        totals[turn][0] += prompt
        totals[turn][1] += cached
    return {turn: (p, c) for turn, (p, c) in sorted(totals.items())}


def share(turns: dict[int, tuple[int, int]], first: int) -> float | None:
    prompt = sum(p for t, (p, _) in turns.items() if t >= first)
    return sum(c for t, (_, c) in turns.items() if t >= first) / prompt if prompt else None


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /reset_prefix_cache on the benchmark's own server
    run_dir = Path(tempfile.mkdtemp(prefix="optima_bench_"))
    recipe = load_recipe(
        InferenceRecipe,
        None,
        {
            "dataset_type": args.task,
            "initial_model_path": args.model,
            "model_root_path": args.model,
            "output_dir": str(run_dir),
            "port": args.port,
            "thread_count": args.threads,
            "max_turns": args.max_turns,
            "max_tokens": args.max_tokens,
            "request_timeout_s": 600.0,
            "vllm_extra_args": ["--enable-prompt-tokens-details"],  # cached tokens in each reply's usage
        },
    )
    examples = TASKS[args.task].load_train(data_dir=args.data_dir)[: args.questions]
    stage = RunPaths(run_dir).stage(0)  # an evaluation recipe has no checkpoint root
    plan = GenerationPlan(iteration=1, temperature=args.temperature, samples=args.samples, stage="bench")
    with serve(recipe, args.model, resolve_env(None, "vllm"), stage) as endpoints:
        run_plain_client(endpoints[0], recipe, [([{"role": "user", "content": "Hello"}], 8)], 1, 0.0)  # warm-up
        reset_prefix_cache(endpoints[0])
        stats = generate_conversations(recipe, examples, endpoints, stage.generations, plan, TurnRecordingRunner)
        requests = rebuild_requests(load_records(stage.generations)[0], args.max_tokens)
        in_flight = stats.kv.get("in_flight") or args.threads
        reset_prefix_cache(endpoints[0])
        before = read_counters(endpoints[0])
        plain_tokens, plain_s = run_plain_client(endpoints[0], recipe, requests, in_flight, args.temperature)
        plain_hit_rate = (read_counters(endpoints[0]) - before).hit_rate
    ours = stats.generated_tokens / stats.elapsed_s
    plain = plain_tokens / plain_s
    turns = hit_rates_by_turn(TurnRecordingRunner.log)
    print(
        f"model {args.model} | {args.task} | {len(examples)} questions x {args.samples} | {args.threads} threads, "
        f"{in_flight} in flight | {args.max_turns} turns x {args.max_tokens} tokens | {len(requests)} requests | "
        f"KV cache {stats.kv.get('kv_cache_tokens')} tokens"
    )
    print(f"conversation generator: {stats.generated_tokens} tokens in {stats.elapsed_s:.1f} s = {ours:.1f} tok/s")
    print(f"plain concurrent client: {plain_tokens} tokens in {plain_s:.1f} s = {plain:.1f} tok/s")
    print(f"ratio generator / plain: {ours / plain:.3f} (target >= 0.90)")
    print(
        f"prefix-cache hit rate (vLLM /metrics): generator {stats.kv.get('prefix_cache_hit_rate')}, "
        f"plain {round(plain_hit_rate, 4) if plain_hit_rate is not None else None}"
    )
    by_turn = ", ".join(f"{t}: {c / p:.3f} of {p}" for t, (p, c) in turns.items() if p)
    print(f"prefix-cache hit rate by turn (share of prompt tokens): {by_turn}")
    for first in (2, 3):
        rate = share(turns, first)
        if rate is not None:
            print(f"prefix-cache hit rate over turns {first}..N: {rate:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
