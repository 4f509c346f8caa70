"""Many two-agent conversations against the served replicas, written to a resumable JSONL (docs/method.md#isft).

`thread_count` conversations are in flight at once (fewer when the servers' KV caches hold fewer); question `q`
goes to replica `q mod n` for all its turns (vLLM's prefix cache), failing over when it dies; one line per
conversation, keyed by `(task_id, sample_index)`, is flushed as it ends, so a killed run resumes with nothing lost
or repeated; every random choice is seeded from the question and sample, whatever the scheduling; a failed
request ends its conversation with `status: error` (retried on the next run).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from optima.agents.conversation import ConversationRunner, GenerationSettings, Job
from optima.agents.footprint import conversation_footprint
from optima.config.rules import generation_temperature, workers
from optima.methods import SFT
from optima.serving.client import ReplicaPool, check_structured_outputs
from optima.serving.kv_monitor import KVMonitor
from optima.store import JsonlWriter, prepare_resume
from optima.tasks import Example

if TYPE_CHECKING:
    from optima.config import LoopRecipe, Recipe

logger = logging.getLogger(__name__)


def generation_settings(recipe: LoopRecipe, iteration: int, stage: str = SFT) -> GenerationSettings:
    """The iSFT generate stage's sampling (docs/method.md#sampling-schedule): `explore_count` samples; the prompt
    pool and the low temperature at iteration 0, the answer bootstrap in the first `answer_bootstrap_iterations`.
    The stage runs these settings, `--dry-run` prints them and the stage's key reads them."""
    first = iteration == 0
    return GenerationSettings(
        iteration=iteration,
        temperature=generation_temperature(recipe, iteration),
        samples=recipe.explore_count,
        use_prompt_pool=recipe.use_prompt_pool and first,
        stage=stage,
        answer_bootstrap=recipe.answer_bootstrap if iteration < recipe.answer_bootstrap_iterations else "off",
    )


@dataclass
class GenerationStats:
    """What a generation run did (`to_dict` goes into metrics.json)."""

    requested: int = 0
    already_done: int = 0
    written: int = 0
    statuses: Counter = field(default_factory=Counter)
    per_replica: Counter = field(default_factory=Counter)
    generated_tokens: int = 0
    conversation_tokens: int = 0
    elapsed_s: float = 0.0
    kv: dict = field(default_factory=dict)

    def add(self, record: dict, generated_tokens: int) -> None:
        self.written += 1
        self.statuses[record["status"]] += 1
        self.per_replica[record["replica"]] += 1
        self.generated_tokens += generated_tokens
        self.conversation_tokens += record["token_count"]

    @property
    def conversations_per_s(self) -> float:
        return self.written / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def to_dict(self) -> dict:
        return {
            "requested": self.requested,
            "already_done": self.already_done,
            "written": self.written,
            "statuses": dict(self.statuses),
            "per_replica": {str(k): v for k, v in self.per_replica.items()},
            "generated_tokens": self.generated_tokens,
            "conversation_tokens": self.conversation_tokens,
            "elapsed_s": round(self.elapsed_s, 2),
            "conversations_per_s": round(self.conversations_per_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "kv_cache": self.kv,
        }


@dataclass(frozen=True)
class GenerationHooks:
    """How a method plugs into `generate_conversations`: the runner of one job (the baselines bring their own)
    and a callback on each written record (LM-loss scoring while generating)."""

    runner_cls: Callable[..., ConversationRunner] = ConversationRunner
    on_record: Callable[[dict], None] | None = None


def generate_conversations(
    recipe: Recipe,
    examples: Sequence[Example],
    endpoints: Sequence[str],
    out_path: Path,
    generation: GenerationSettings,
    hooks: GenerationHooks = GenerationHooks(),
) -> GenerationStats:
    """`generation.samples` conversations per example (their order picks the replica) into `out_path`, resuming
    what is there.

    Raises:
        NoReplicaLeft: every replica died; what was written stays, and the next run resumes from it.
    """
    jobs = pending_jobs(examples, out_path, generation)
    stats = GenerationStats(requested=len(examples) * generation.samples)
    stats.already_done = stats.requested - len(jobs)
    _log_start(generation, len(examples), len(endpoints), stats)
    if jobs:
        # Never more conversations in flight than the servers' KV caches hold (else they thrash and preempt).
        monitor = KVMonitor(endpoints, recipe.api_key)
        in_flight = workers(recipe)
        if monitor.kv_tokens is not None:
            in_flight = monitor.bound(in_flight, conversation_footprint(recipe, examples, monitor.model))
        pool = ReplicaPool(endpoints, recipe)
        try:
            if generation.answer_bootstrap == "grammar":
                check_structured_outputs(pool)  # a server without the constraint stops the run before it starts
            _run_jobs(hooks.runner_cls(recipe, generation, pool), jobs, out_path, stats, hooks.on_record, in_flight)
        finally:
            pool.close()
        stats.kv = monitor.report()
    logger.info(
        "generate | %d written, statuses %s | %.2f conversations/s, %.1f tokens/s",
        stats.written,
        dict(stats.statuses),
        stats.conversations_per_s,
        stats.tokens_per_s,
    )
    return stats


def pending_jobs(examples: Sequence[Example], out_path: Path, generation: GenerationSettings) -> list[Job]:
    """The conversations not yet in `out_path` (a torn last line is cut first); the file exists afterwards."""
    ids = [example.id for example in examples]
    if len(set(ids)) != len(ids):
        raise ValueError("example ids must be unique (they key the output lines)")
    done = prepare_resume(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.touch()  # the stage's output exists even when there is nothing (left) to generate
    return [
        Job(position, example, k)
        for position, example in enumerate(examples)
        for k in range(generation.samples)
        if (example.id, k) not in done
    ]


def _log_start(generation: GenerationSettings, questions: int, endpoints: int, stats: GenerationStats) -> None:
    logger.info(
        "%sgenerate (%s) | %d questions x %d | %d to do, %d done | %d endpoints | T=%.2f%s",
        f"iteration {generation.iteration} | "
        if generation.iteration >= 0
        else "",  # evaluation runs have no iteration
        generation.stage,
        questions,
        generation.samples,
        stats.requested - stats.already_done,
        stats.already_done,
        endpoints,
        generation.temperature,
        " | prompt pool" if generation.use_prompt_pool else "",
    )


def _run_jobs(
    runner: ConversationRunner, jobs: list[Job], out_path: Path, stats: GenerationStats, on_record, in_flight: int
) -> None:
    from tqdm.auto import tqdm

    started = time.monotonic()
    executor = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="conversation")
    finished = False
    try:
        with JsonlWriter(out_path) as writer, tqdm(total=len(jobs), unit="conv", desc="generate") as bar:
            futures = [executor.submit(runner.run, job) for job in jobs]
            for future in as_completed(futures):
                record, generated = future.result()  # a worker's exception (NoReplicaLeft, a bug) stops the run
                writer.write(record)
                if on_record is not None:
                    on_record(record)
                stats.add(record, generated)
                stats.elapsed_s = time.monotonic() - started
                bar.update()
                bar.set_postfix(conv_s=f"{stats.conversations_per_s:.2f}", tok_s=f"{stats.tokens_per_s:.1f}")
        finished = True
    finally:
        # On an error or Ctrl-C: stop retries and queued conversations at once and do not wait for requests in
        # flight (they end when the servers are stopped by the caller's ``serve`` block).
        runner.pool.stop_event.set()
        executor.shutdown(wait=finished, cancel_futures=True)
        stats.elapsed_s = time.monotonic() - started
