"""Generation throughput: our two-agent conversation generator vs a plain concurrent client, same server.

    .venvs/train/bin/python -m bench.generation                      # SmolLM2 on CPU, 12 ARC questions x 2
    .venvs/train/bin/python -m bench.generation --questions 64 --threads 64 --max-tokens 256
    .venvs/train/bin/python -m bench.generation --task hotpot_qa --questions 12 --samples 2 --max-turns 6 \
        --max-tokens 128 --threads 64                              # information exchange: long contexts

1. Serve the model (``optima.serving.serve`` with the default KV-cache sizing; the dev API is enabled to reset the
   prefix cache, and the usage of each reply carries its cached prompt tokens).
2. Run ``generate_conversations`` and measure generated tokens per second, the prefix-cache hit rate of the stage
   (vLLM's ``/metrics``) and, per conversation turn, the share of prompt tokens the server read from its cache.
   Every request the generator sends is recorded as sent (messages, continuation flags, output length), and so is
   the number of conversations it had in flight at once; information exchange's prefill requests (Bob's opening
   view, ``max_tokens`` 1) are counted apart: they are part of the generator's method, not of the work compared.
3. Reset the prefix cache and send the same requests as independent calls, as many at once as the generator
   actually had conversations in flight (its real concurrency: with fewer conversations than the KV bound allows,
   the bound would give the plain client more parallelism than the generator ever had), each forced to its
   recorded length (``ignore_eos`` + ``max_tokens``).
4. Print tokens/s of both and their ratio (the generator's target: >= 0.90 of the plain client) and the hit rates
   (target for multi-turn information exchange: >= 0.85 over turns 2..N).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.benchlib import add_model_args, shown
from optima.agents.conversation import ConversationRunner, GenerationSettings
from optima.agents.generation import GenerationHooks, generate_conversations
from optima.config import InferenceRecipe, load_recipe
from optima.environments import resolve_env
from optima.logging_utils import setup_logging
from optima.paths import RunPaths
from optima.serving.kv_monitor import CacheCounters, fetch_metrics
from optima.serving.vllm_server import serve
from optima.tasks import TASKS


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


@dataclass(frozen=True)
class SentRequest:
    """One request the generator sent: its chat, its vLLM extensions and how many tokens the reply had."""

    messages: list[dict]
    extra_body: dict | None
    tokens: int


def run_plain_client(endpoint: str, recipe, requests: list[SentRequest], threads: int, temperature: float):
    """Send every request independently from ``threads`` threads; return (generated tokens, seconds)."""
    import openai

    client = openai.OpenAI(base_url=endpoint, api_key="EMPTY", timeout=recipe.request_timeout_s, max_retries=0)

    def send(request: SentRequest) -> int:
        response = client.chat.completions.create(
            model=recipe.served_model_name,
            messages=request.messages,
            temperature=temperature,
            max_tokens=request.tokens,
            extra_body=(request.extra_body or {}) | {"ignore_eos": True},
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


class GeneratorLog:
    """What the generator did, recorded by ``TurnRecordingRunner``: requests, per-turn cache reads, concurrency."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: list[SentRequest] = []
        self.turns: list[tuple[int, int, int]] = []  # (turn, prompt tokens, cached tokens), 1 = Alice's first
        self.prefills: list[tuple[int, int]] = []  # (prompt tokens, cached tokens) of each prefill request
        self.in_flight = 0
        self.peak_in_flight = 0

    def enter(self) -> None:
        with self.lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


class _TurnRecordingPool:
    """The generator's replica pool, recording every reply into a ``GeneratorLog``.

    A conversation's own thread knows its turn (``local.turn``); a request from any other thread is a prefill.
    """

    def __init__(self, pool, log: GeneratorLog, local: threading.local):
        self._pool, self._log, self._local = pool, log, local

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def chat(self, replica, messages, sampling):
        reply = self._pool.chat(replica, messages, sampling)
        usage = (reply.prompt_tokens or 0, reply.cached_tokens or 0)
        with self._log.lock:
            if getattr(self._local, "turn", None) is None:
                self._log.prefills.append(usage)
                return reply
            self._local.turn += 1
            self._log.turns.append((self._local.turn, *usage))
            tokens = reply.completion_tokens or 0
            self._log.requests.append(SentRequest(list(messages), sampling.extra_body, tokens))
        return reply


class TurnRecordingRunner(ConversationRunner):
    """``ConversationRunner`` whose requests and concurrency go into the class's ``GeneratorLog``."""

    log = GeneratorLog()

    def __init__(self, recipe, generation, pool):
        self._local = threading.local()
        super().__init__(recipe, generation, _TurnRecordingPool(pool, self.log, self._local))

    def run(self, job):
        self._local.turn = 0
        self.log.enter()
        try:
            return super().run(job)
        finally:
            self.log.leave()


def plain_client_threads(log: GeneratorLog, kv_in_flight: int | None, threads: int) -> int:
    """The plain client's concurrency: the conversations the generator actually had in flight at once.

    Not the KV bound (``kv_in_flight``) nor ``--threads``: with 12 conversations and a bound of 43, the generator
    never had more than 12 requests out, and the plain client would compare 43 parallel requests against them.
    Falls back to the bound (then ``threads``) when nothing was recorded.
    """
    return log.peak_in_flight or kv_in_flight or threads


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
    generation = GenerationSettings(iteration=1, temperature=args.temperature, samples=args.samples, stage="bench")
    with serve(recipe, args.model, resolve_env(None, "vllm"), stage) as endpoints:
        run_plain_client(endpoints[0], recipe, [SentRequest([{"role": "user", "content": "Hi"}], None, 8)], 1, 0.0)
        reset_prefix_cache(endpoints[0])
        hooks = GenerationHooks(TurnRecordingRunner)
        stats = generate_conversations(recipe, examples, endpoints, stage.generations, generation, hooks)
        log = TurnRecordingRunner.log
        requests = log.requests
        in_flight = plain_client_threads(log, stats.kv.get("in_flight"), args.threads)
        reset_prefix_cache(endpoints[0])
        before = read_counters(endpoints[0])
        plain_tokens, plain_s = run_plain_client(endpoints[0], recipe, requests, in_flight, args.temperature)
        plain_hit_rate = (read_counters(endpoints[0]) - before).hit_rate
    ours = stats.generated_tokens / stats.elapsed_s
    plain = plain_tokens / plain_s
    turns = hit_rates_by_turn(log.turns)
    print(
        f"model {shown(args.model)} | {args.task} | {len(examples)} questions x {args.samples} | "
        f"{args.threads} threads, KV bound {stats.kv.get('in_flight')}, {in_flight} conversations in flight "
        f"(plain client: {in_flight} threads) | {args.max_turns} turns x {args.max_tokens} tokens | "
        f"{len(requests)} requests | KV cache {stats.kv.get('kv_cache_tokens')} tokens"
    )
    if log.prefills:
        prompt, cached = (sum(column) for column in zip(*log.prefills, strict=True))
        print(f"prefill requests (not compared): {len(log.prefills)}, {prompt} prompt tokens, {cached} from the cache")
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
