"""One conversation of a generation stage: the stage's sampling settings and the runner of one conversation.

``GenerationSettings`` says how a stage samples (iteration, temperature, samples per question, prompt pool,
answer bootstrap; ``generation_settings`` is the rule of the iSFT generate stage, docs/method.md#sampling-schedule).
``ConversationRunner`` runs one ``Job`` against the replica pool: the question's replica for every turn, seeds from
``(seed, iteration, task_id, sample_index, turn)``, the prompt pool draw, the answer bootstrap, and for information
exchange the ``Prefill`` of Bob's opening view (docs/method.md#exact-replies); it returns the conversation's JSONL
record. ``optima.agents.generation`` runs many of them at once; the baselines of ``optima.evaluation`` bring their
own runners.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
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
from optima.agents.prompts import (
    AGENT_NAMES,
    build_system_prompt,
    draw_pool_prompts,
    load_prompt_pool,
    pool_name,
)
from optima.config.rules import generation_temperature, tokenizer_path
from optima.methods import SFT
from optima.serving.client import NoReplicaLeft, ReplicaPool, RequestFailed, Sampling, regex_constraint
from optima.tasks import Example, Task, get_task
from optima.tasks.answers import PARSER_VERSION
from optima.tasks.constraints import reply_pattern
from optima.tasks.contexts import stable_rng
from optima.tasks.reparse import PARSER_VERSION_KEY

if TYPE_CHECKING:
    from optima.config import LoopRecipe, Recipe

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


@dataclass(frozen=True)
class Job:
    """One conversation to run: the question's position (routing), the question, the sample index."""

    position: int
    example: Example
    sample_index: int


class TokenCounter:
    """Fallback token counts with the agents' tokenizers, loaded on first use (servers normally send usage)."""

    def __init__(self, recipe: Recipe):
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
