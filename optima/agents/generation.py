"""Many two-agent conversations against the served replicas, written to a resumable JSONL.

See docs/method.md#isft.

``generate_conversations(recipe, examples, endpoints, out_path, generation[, hooks])`` runs ``generation.samples``
conversations per question (docs/method.md, D5 and D6: not one thread per question with its samples in sequence,
nor lost futures):

* ``thread_count`` conversations are in flight at once (``ThreadPoolExecutor`` + ``as_completed``), fewer when
  the servers' KV caches cannot hold that many (``optima.hardware.capacity``); the stage's KV figures and prefix-cache
  hit rate go into its stats (``kv_cache``);
* question ``q`` goes to replica ``q mod n`` (deterministic round-robin); every turn of its conversations stays on
  that replica so vLLM's prefix cache reuses the shared system prompt and history; a dead replica fails over;
* information exchange takes prefill off the critical path (docs/method.md#exact-replies): Bob's opening view
  (system + his half of the context) is sent with ``max_tokens`` 1 beside Alice's first turn (``Prefill``; the
  token is discarded, never stored or counted), and each agent's own replies come back to it exactly as generated;
* one line per conversation, keyed by ``(task_id, sample_index)``, flushed as it completes; a rerun skips what is
  written (``optima.store``), so a killed run resumes with nothing lost or duplicated;
* every random choice is seeded from ``(seed, iteration, task_id, sample_index[, turn])``: the iteration-0 prompt
  pool draw and each request's sampling seed, so a rerun reproduces, whatever the scheduling;
* a failed request ends its conversation with ``status: error`` (retried on the next run); if every replica is
  gone the run stops with ``NoReplicaLeft``.

Temperature and pool follow docs/method.md#sampling-schedule (``generation_settings``); evaluation and tree search
build their own settings.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from optima.agents.conversation import (
    AgentPrompts,
    ConversationResult,
    TurnLimits,
    build_agent_prompts,
    opening_view,
    run_conversation,
)
from optima.agents.footprint import conversation_footprint
from optima.agents.prompts import (
    AGENT_NAMES,
    build_system_prompt,
    draw_pool_prompts,
    load_prompt_pool,
    pool_name,
)
from optima.config.rules import generation_temperature, tokenizer_path, workers
from optima.methods import SFT
from optima.serving.client import (
    NoReplicaLeft,
    ReplicaPool,
    RequestFailed,
    Sampling,
    check_structured_outputs,
    regex_constraint,
)
from optima.serving.kv_monitor import KVMonitor
from optima.store import JsonlWriter, prepare_resume
from optima.tasks import Example, Task, get_task
from optima.tasks.answers import PARSER_VERSION
from optima.tasks.constraints import reply_pattern
from optima.tasks.contexts import stable_rng
from optima.tasks.reparse import PARSER_VERSION_KEY

if TYPE_CHECKING:
    from optima.config.types import LoopRecipe, Recipe, RunFields

logger = logging.getLogger(__name__)

CONTINUE_REPLY = {"continue_final_message": True, "add_generation_prompt": False}
PREFILL_TOKENS = 1  # a prefill request generates one token, discarded


@dataclass(frozen=True)
class GenerationSettings:
    """How one generation stage samples.

    Args:
        iteration: Iteration number (recorded, and part of every seed).
        temperature: Sampling temperature.
        samples: Conversations per question.
        use_prompt_pool: Draw format-diverse system prompts (docs/method.md#prompt-pool).
        stage: Label of the stage (``sft``, ``probe``, ``eval``, ...): logs and seeds.
        answer_bootstrap: ``grammar``: constrain answering turns to a well-formed answer; ``prefill``: start them
            with the role's answer opening; ``off`` (docs/method.md#answer-bootstrap).
    """

    iteration: int
    temperature: float
    samples: int
    use_prompt_pool: bool = False
    stage: str = SFT
    answer_bootstrap: str = "off"

    @property
    def prefill_answer(self) -> bool:
        """Whether answering turns start with the role's answer opening."""
        return self.answer_bootstrap == "prefill"


def generation_settings(recipe: LoopRecipe, iteration: int, stage: str = SFT) -> GenerationSettings:
    """SFT data generation: ``explore_count`` samples; the pool and the low temperature at iteration 0, the answer
    bootstrap in the first ``answer_bootstrap_iterations``.

    The one rule of the generate stage's sampling: the stage runs these settings, ``--dry-run`` prints them and
    the stage's key reads its prompt pool (``optima.plan``, ``optima.stage_identity``).
    See docs/method.md#sampling-schedule.
    """
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
    """What a generation run did (``to_dict`` goes into metrics.json)."""

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
class Job:
    """One conversation to run: the question's position (routing), the question, the sample index."""

    position: int
    example: Example
    sample_index: int


class TokenCounter:
    """Fallback token counts with the agents' tokenizers, loaded on first use (servers normally send usage)."""

    def __init__(self, recipe: RunFields):
        self._paths = {
            AGENT_NAMES[0]: tokenizer_path(recipe, 0),
            AGENT_NAMES[1]: tokenizer_path(recipe, 1),
        }
        self._tokenizers: dict[str, object] = {}
        self._lock = threading.Lock()

    def __call__(self, text: str, speaker: str) -> int:
        with self._lock:
            if speaker not in self._tokenizers:
                from transformers import AutoTokenizer

                self._tokenizers[speaker] = AutoTokenizer.from_pretrained(self._paths[speaker])
        return len(self._tokenizers[speaker].tokenize(text))


class Prefill:
    """An agent's opening view sent with ``max_tokens`` 1 from a background thread, to fill the prefix cache.

    A context manager around the conversation: leaving it waits for the request, so none outlives its
    conversation. The reply is discarded. A failed request only costs the cache hit (logged at debug level); any
    other error (a bug) is raised in the conversation's thread, by ``wait`` or on leaving. ``messages`` None: nothing
    is sent (the conversation needs no prefill).
    """

    def __init__(self, pool: ReplicaPool, replica: int, messages: list[dict] | None):
        self._pool, self._replica, self._messages = pool, replica, messages
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._send, name="prefill", daemon=True) if messages else None
        if self._thread is not None:
            self._thread.start()

    def _send(self) -> None:
        try:
            self._pool.chat(self._replica, self._messages, Sampling(0.0, PREFILL_TOKENS))
        except (RequestFailed, NoReplicaLeft) as exc:
            logger.debug("prefill on replica %d failed: %s", self._replica, exc)
        except BaseException as exc:  # noqa: BLE001 (a bug: raised in the conversation's thread)
            self._error = exc

    def wait(self) -> None:
        """Wait for the request to end; raise what it raised unless it was a failed request."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def __enter__(self) -> Prefill:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self._thread is not None:
            self._thread.join()
        if exc_type is None:
            self.wait()  # a bug in the prefill surfaces even when its agent never spoke


class ConversationRunner:
    """Runs one ``Job`` against the replica pool and turns the result into a JSONL record."""

    def __init__(self, recipe: Recipe, generation: GenerationSettings, pool: ReplicaPool):
        self.recipe, self.generation, self.pool = recipe, generation, pool
        self.limits = TurnLimits(recipe.max_turns, recipe.max_tokens)
        self.count_tokens = TokenCounter(recipe)
        self._pools: dict[str, tuple[str, ...]] = {}
        self._pool_lock = threading.Lock()

    def system_prompts(self, task: Task, job: Job) -> tuple[str, str]:
        """Base prompts, or (iteration-0 SFT data) a seeded draw from the task's format pool."""
        if not self.generation.use_prompt_pool:
            return build_system_prompt(task, AGENT_NAMES[0]), build_system_prompt(task, AGENT_NAMES[1])
        generation = self.generation
        rng = stable_rng(
            self.recipe.seed, "pool", generation.stage, generation.iteration, job.example.id, job.sample_index
        )
        return draw_pool_prompts(self._pool_for(task), task, rng)

    def _pool_for(self, task: Task) -> tuple[str, ...]:
        with self._pool_lock:
            if task.name not in self._pools:
                custom = self.recipe.prompt_pool_path
                self._pools[task.name] = (
                    load_prompt_pool(Path(custom).stem, Path(custom).parent)
                    if custom
                    else load_prompt_pool(pool_name(task))
                )
            return self._pools[task.name]

    def run(self, job: Job) -> tuple[dict, int]:
        """Run the conversation; return its record and the tokens it generated."""
        task = get_task(job.example.task)
        agents = self.agent_prompts(task, job)
        replica = self.pool.route(job.position)
        turns = iter(range(self.recipe.max_turns))
        constrained: list[int] = []  # the turns sent with the answer constraint
        seed_parts = (
            self.recipe.seed,
            "turn",
            self.generation.stage,
            self.generation.iteration,
            job.example.id,
            job.sample_index,
        )
        prefill = self.start_prefill(job, task, agents, replica)

        def generate(messages: list[dict], speaker: str):
            nonlocal replica
            if speaker != AGENT_NAMES[0]:
                prefill.wait()  # Bob's first prompt then starts with the prefix the server just cached
            turn = next(turns)
            seed = stable_rng(*seed_parts, turn).randrange(2**31)
            # A pre-filled reply (last message from the assistant) is continued, not answered.
            extra = CONTINUE_REPLY if messages[-1]["role"] == "assistant" else None
            if agents.constraint(turn):
                extra = (extra or {}) | regex_constraint(agents.constraint(turn))
                constrained.append(turn)
            sampling = Sampling(self.generation.temperature, self.recipe.max_tokens, seed, extra)
            reply = self.pool.chat(replica, messages, sampling)
            replica = reply.replica  # after a failover the rest of the conversation stays on the new replica
            return reply

        with prefill:
            result = run_conversation(job.example, agents, generate, self.limits, self.count_tokens, task)
        if result.replica is None:
            result.replica = replica
        return self.build_record(job, agents.system, result) | {"constrained_turns": constrained}, result.token_count

    def agent_prompts(self, task: Task, job: Job) -> AgentPrompts:
        """The agents' prompts of one job, with the settings' answer bootstrap (pre-fill, or the answer constraint)."""
        grammar = self.generation.answer_bootstrap == "grammar"
        patterns = [reply_pattern(task, job.example, name) if grammar else "" for name in AGENT_NAMES]
        return build_agent_prompts(task, self.system_prompts(task, job), self.generation.prefill_answer, patterns)

    def start_prefill(self, job: Job, task: Task, agents: AgentPrompts, replica: int) -> Prefill:
        """Information exchange: send Bob's opening view with ``max_tokens`` 1 beside Alice's first turn.

        Bob's first prompt holds his half of the context (about half of the context window); computed while Alice
        writes her first reply, it waits in the server's prefix cache for his real first turn, off the
        conversation's critical path. Its one-token reply is discarded (never stored nor counted).
        """
        wanted = task.family == "qa" and self.recipe.max_turns >= 2
        return Prefill(self.pool, replica, opening_view(job.example, agents, task) if wanted else None)

    def build_record(self, job: Job, prompts: Sequence[str], result: ConversationResult) -> dict:
        """The JSONL line of one conversation (everything reward and selection need to re-render it)."""
        example = job.example
        return {
            "task_id": example.id,
            "sample_index": job.sample_index,
            "task": example.task,
            "question": example.question,
            "answer": list(example.answer) if isinstance(example.answer, tuple) else example.answer,
            "utterances": [
                {"speaker": u.speaker, "text": u.text, "tokens": n}
                for u, n in zip(result.utterances, result.tokens, strict=True)
            ],
            "token_count": result.token_count,  # every generated token, cut replies included
            "cut_replies": result.cut_replies,
            "agent_tokens": result.agent_tokens(),
            "final_answer": result.final_answer,
            PARSER_VERSION_KEY: PARSER_VERSION,
            "status": result.status,
            "stop_reason": result.stop_reason,
            "error": result.error,
            "system_prompts": dict(zip(AGENT_NAMES, prompts, strict=True)),
            "prompt_pool": self.generation.use_prompt_pool,
            "answer_bootstrap": self.generation.answer_bootstrap,
            "iteration": self.generation.iteration,
            "stage": self.generation.stage,
            "temperature": self.generation.temperature,
            "replica": result.replica,
            "example": example.to_dict(),
        }


@dataclass(frozen=True)
class GenerationHooks:
    """How a method plugs into ``generate_conversations``.

    Args:
        runner_cls: What runs one job (the CoT, AutoForm and debate baselines bring their own).
        on_record: Called with each record once it is written (LM-loss scoring while generating).
    """

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
    """Generate ``generation.samples`` conversations per example into ``out_path`` (resuming what is there).

    Args:
        recipe: A recipe (serving, generation and ``seed`` fields).
        examples: The questions, in a fixed order (their position picks the replica).
        endpoints: OpenAI base URLs (from ``optima.serving.serve``).
        out_path: The JSONL output (e.g. ``StagePaths.generations``).
        generation: Iteration, temperature, samples per question, prompt pool.
        hooks: The runner of one job and the callback on each written record.

    Raises:
        NoReplicaLeft: every replica died; what was written stays and the next run resumes from it.
    """
    jobs = pending_jobs(examples, out_path, generation)
    stats = GenerationStats(requested=len(examples) * generation.samples)
    stats.already_done = stats.requested - len(jobs)
    _log_start(generation, len(examples), len(endpoints), stats)
    if jobs:
        # Never more conversations in flight than the servers' KV caches hold (else they thrash: see capacity.py).
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
    """The conversations not yet in ``out_path`` (a torn last line is cut first); the file exists afterwards."""
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
