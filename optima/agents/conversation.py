"""One two-agent conversation: the turn loop over an injected `generate`, and its runner against the replicas.

Alice speaks first and the agents alternate for at most `max_turns` utterances; after each, the task's parser reads
the answer it states, and the conversation stops when the same answer is stated twice in a row
(docs/method.md#turn-loop). It ends with a status, never a fake utterance: `ok`, `too_long` (a reply hit
`max_tokens`: not stored, its tokens counted) or `error` (a request failed for good); every generated token counts
(docs/method.md#token-count). `ConversationRunner` runs one `Job` on its question's replica with seeded sampling,
the iteration-0 pool draw, the answer bootstrap and, for information exchange, exact replies and the prefill of
Bob's opening view (docs/method.md#exact-replies), and returns the conversation's JSONL record.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from optima.agents.prompts import (
    AGENT_NAMES,
    Utterance,
    agent_index,
    build_agent_messages,
    build_system_prompt,
    draw_pool_prompts,
    load_prompt_pool,
    pool_name,
    role_prompt,
    strip_speaker_prefix,
)
from optima.config.rules import tokenizer_path
from optima.methods import SFT
from optima.serving.client import ChatReply, NoReplicaLeft, ReplicaPool, RequestFailed, Sampling, regex_constraint
from optima.tasks import Example, Task, get_task
from optima.tasks.answers import PARSER_VERSION, PARSER_VERSION_KEY, AnswerTracker
from optima.tasks.base import reply_pattern
from optima.tasks.sampling import stable_rng

if TYPE_CHECKING:
    from optima.config import Recipe

logger = logging.getLogger(__name__)

Generate = Callable[[list[dict], str], ChatReply]
CountTokens = Callable[[str, str], int]  # (text, speaker) -> tokens


@dataclass
class ConversationResult:
    """What one conversation produced: its stored utterances and their tokens, the (speaker, tokens) of replies
    cut at `max_tokens` and not stored (`unstored`), the last stated answer, status and stop reason
    (`same_answer`, `max_turns`, `too_long`, `error`), and the replica that served its last request."""

    utterances: list[Utterance] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    unstored: list[tuple[str, int]] = field(default_factory=list)
    cut_replies: int = 0
    final_answer: str = ""
    status: str = "ok"
    stop_reason: str = "max_turns"
    error: str | None = None
    replica: int | None = None

    @property
    def token_count(self) -> int:
        """The paper's #Tok of this conversation: every token generated, cut replies included."""
        return sum(self.tokens) + sum(count for _, count in self.unstored)

    def agent_tokens(self) -> dict[str, int]:
        """Tokens per agent (cut replies included)."""
        totals = dict.fromkeys(AGENT_NAMES, 0)
        pairs = [*((u.speaker, n) for u, n in zip(self.utterances, self.tokens, strict=True)), *self.unstored]
        for speaker, count in pairs:
            totals[speaker] = totals.get(speaker, 0) + count  # debates name N agents
        return totals


@dataclass(frozen=True)
class TurnLimits:
    """Recipe fields `max_turns` (utterances) and `max_tokens` (per utterance)."""

    max_turns: int
    max_tokens: int


@dataclass(frozen=True)
class AgentPrompts:
    """What each agent is given, (Alice's, Bob's): system prompts, reply openings to pre-fill and answer
    constraints ("" for none), both from turn `answer_from_turn` on (0-based, over both agents); and whether its
    own earlier replies come back to it exactly as generated (`replay_replies`) or rendered as training rows are."""

    system: tuple[str, str]
    openings: tuple[str, str] = ("", "")
    answer_from_turn: int = 0
    replay_replies: bool = False
    constraints: tuple[str, str] = ("", "")

    def opening(self, turn: int) -> str:
        """The pre-filled start of the reply at `turn` ("" for none)."""
        return self.openings[turn % 2] if turn >= self.answer_from_turn else ""

    def constraint(self, turn: int) -> str:
        """The regular expression the reply at `turn` must match ("" for a free reply)."""
        return self.constraints[turn % 2] if turn >= self.answer_from_turn else ""


def build_agent_prompts(
    task: Task, system: Sequence[str], prefill_answer: bool = False, answer_patterns: Sequence[str] = ("", "")
) -> AgentPrompts:
    """The agents' prompts for `task`: the roles' answer openings (`prefill_answer`) or constraints
    (`answer_patterns`, for the roles that state an answer), exact replies for information exchange (its long
    contexts make every re-rendered token a prefill cost; debate keeps the rendering of its training rows)."""
    roles = [role_prompt(task, name) for name in AGENT_NAMES]
    openings = tuple(role.answer_opening if prefill_answer else "" for role in roles)
    constraints = tuple(p if role.states_answer else "" for role, p in zip(roles, answer_patterns, strict=True))
    from_turn = min((role.answer_from_turn for role in roles if role.states_answer), default=0)
    return AgentPrompts(tuple(system), openings, from_turn, task.family == "qa", constraints)


def opening_view(example: Example, agents: AgentPrompts, task: Task, speaker: str = AGENT_NAMES[1]) -> list[dict]:
    """`speaker`'s view before anyone spoke (system + task turn): the prefix of its first prompt."""
    return build_agent_messages(example, speaker, [], agents.system[agent_index(speaker)], task)


def reply_tokens(reply: ChatReply, speaker: str, count_tokens: CountTokens | None = None) -> int:
    """The tokens of a reply: the server's `usage.completion_tokens`, else `count_tokens(text, speaker)`, else 0
    (the token rule of generation and the tree search)."""
    if reply.completion_tokens is not None:
        return reply.completion_tokens
    return count_tokens(reply.text, speaker) if count_tokens else 0


def is_cut_reply(reply: ChatReply, tokens: int, max_tokens: int) -> bool:
    """Whether a reply hit the token cap: finish reason `length`, or as many tokens as allowed."""
    return reply.finish_reason == "length" or tokens >= max_tokens


def run_conversation(
    example: Example,
    agents: AgentPrompts,
    generate: Generate,
    limits: TurnLimits,
    count_tokens: CountTokens | None = None,
    task: Task | None = None,
) -> ConversationResult:
    """Run one two-agent conversation; `generate(messages, speaker)` raises `RequestFailed` for a failed request."""
    task = task or get_task(example.task)
    result, tracker = ConversationResult(), AnswerTracker()
    for turn in range(limits.max_turns):
        speaker, opening = AGENT_NAMES[turn % 2], agents.opening(turn)
        messages = build_agent_messages(example, speaker, result.utterances, agents.system[turn % 2], task)
        if opening:
            messages.append({"role": "assistant", "content": opening})
        try:
            reply = generate(messages, speaker)
        except RequestFailed as exc:
            return _finish(result, tracker, "error", error=str(exc))
        result.replica = reply.replica
        tokens = reply_tokens(reply, speaker, count_tokens)
        if is_cut_reply(reply, tokens, limits.max_tokens):
            result.unstored.append((speaker, tokens))
            result.cut_replies += 1
            return _finish(result, tracker, "too_long")
        result.utterances.append(_utterance(speaker, opening, reply.text, agents.replay_replies))
        result.tokens.append(tokens)
        if tracker.update(task.parse_answer(result.utterances[-1].text)):
            return _finish(result, tracker, "ok", stop_reason="same_answer")
    return _finish(result, tracker, "ok", stop_reason="max_turns")


def _utterance(speaker: str, opening: str, generated: str, replay: bool) -> Utterance:
    """The stored utterance of a reply (no name prefix or outer whitespace), with the exact reply if replayed."""
    text = (opening + generated).strip() if opening else strip_speaker_prefix(generated, speaker).strip()
    return Utterance(speaker, text, reply=opening + generated if replay else None)


def _finish(
    result: ConversationResult,
    tracker: AnswerTracker,
    status: str,
    stop_reason: str | None = None,
    error: str | None = None,
) -> ConversationResult:
    result.status = status
    result.stop_reason = stop_reason or status
    result.error = error
    result.final_answer = tracker.final_answer
    return result


CONTINUE_REPLY = {"continue_final_message": True, "add_generation_prompt": False}
PREFILL_TOKENS = 1  # a prefill request generates one token, discarded


@dataclass(frozen=True)
class GenerationSettings:
    """How one generation stage samples: its iteration and stage label (both in every seed), temperature,
    conversations per question, the iteration-0 prompt pool, and the answer bootstrap (`grammar`, `prefill` or
    `off`: docs/method.md#answer-bootstrap)."""

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
    """An agent's opening view sent with `max_tokens` 1 from a thread, to fill the server's prefix cache.

    A context manager around the conversation (leaving it waits for the request); the reply is discarded. A failed
    request only costs the cache hit; any other error (a bug) is raised in the conversation's thread.
    `messages` None sends nothing.
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
    """Runs one `Job` against the replica pool and turns the result into a JSONL record."""

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
        """Information exchange: Bob's opening view (his half of the context) sent beside Alice's first turn, so
        that its prefill is off the conversation's critical path; the one-token reply is never stored nor counted."""
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
