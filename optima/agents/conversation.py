"""The two-agent turn loop over an injected ``generate(messages, speaker) -> ChatReply`` callable.

Alice speaks first; the agents alternate for at most ``max_turns`` utterances. Each agent sees its own chat view
of the conversation (``optima.agents.prompts.build_agent_messages``). After every utterance the task's parser
reads the answer it states; the conversation stops when the same answer is stated twice in a row (utterances
without an answer are skipped over: ``AnswerTracker``).

This loop ends a conversation with a status, never a fake utterance such as ``"large"`` (docs/method.md, D5):

* ``ok``: stopped by the same-answer rule or the turn cap;
* ``too_long``: an utterance hit ``max_tokens`` (finish reason ``length``, or as many tokens as allowed); the
  truncated utterance is not stored (the conversation has no answer: docs/method.md#cut-replies), but its tokens
  count;
* ``error``: a request failed for good (``RequestFailed``); the message is kept in ``error``.

Answer pre-fill (``AgentPrompts.openings``, format bootstrapping for small models at iteration 0): the agent's reply is
started with its role's answer opening (``<A>`` for a multiple-choice solver, and for both information-exchange
agents from turn ``answer_from_turn`` = 2 on, once each has shared its information) as a final assistant message
that the server continues; the stored utterance is the opening plus the continuation.

Answer constraint (``AgentPrompts.constraints``, ``answer_bootstrap: grammar``): the answering turns (the same turns
as the pre-fill's, and the GSM8K/MATH solver's) are sent with a regular expression that the reply must match (free
text around one well-formed answer: ``optima.tasks.constraints``); the caller's ``generate`` reads it from
``AgentPrompts.constraint(turn)`` and records which turns it constrained.

Exact replies (``AgentPrompts.replay_replies``, information exchange: docs/method.md#exact-replies): each agent's
own earlier replies come back to it exactly as generated (the pre-filled opening plus the continuation, name prefix
and whitespace as the model wrote them), so each of its prompts extends its previous prompt and reply token for
token and the server reads them from its prefix cache. The stored utterance (what the partner sees, the reward and
the training rows) is unchanged: the text without the name prefix.

Token accounting (docs/method.md#token-count): every generated token counts, a cut reply's included. Each reply
counts the server's ``usage.completion_tokens`` (the model's own tokenizer, the name prefix the model wrote
included), or ``count_tokens(text)`` when the server sent no usage. System prompts and task turns are not counted.
``cut_replies`` says how many replies hit ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from optima.agents.prompts import (
    AGENT_NAMES,
    Utterance,
    agent_index,
    build_agent_messages,
    role_prompt,
    strip_speaker_prefix,
)
from optima.serving.client import ChatReply, RequestFailed
from optima.tasks import Example, Task, get_task
from optima.tasks.scoring import AnswerTracker

Generate = Callable[[list[dict], str], ChatReply]
CountTokens = Callable[[str, str], int]  # (text, speaker) -> tokens
STATUSES = ("ok", "too_long", "error")


@dataclass
class ConversationResult:
    """What one conversation produced.

    Args:
        utterances: Stored utterances (speaker + text without the name prefix).
        tokens: Tokens of each stored utterance.
        unstored: (speaker, tokens) of each generated reply that was not stored (a reply cut at ``max_tokens``).
        cut_replies: Replies that hit ``max_tokens``, stored or not.
        final_answer: Last answer parsed ("" if none).
        status: ``ok``, ``too_long`` or ``error``.
        stop_reason: ``same_answer``, ``max_turns``, ``too_long`` or ``error``.
        error: The failure message when ``status == "error"``.
        replica: Replica that served the last request (None when none answered).
    """

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
    """Length limits of a conversation (recipe fields ``max_turns`` and ``max_tokens``)."""

    max_turns: int
    max_tokens: int


@dataclass(frozen=True)
class AgentPrompts:
    """What each agent is given: its system prompt, its reply opening, and how its own replies come back to it.

    Args:
        system: (Alice's, Bob's) rendered system prompts.
        openings: (Alice's, Bob's) reply openings to pre-fill ("" for none).
        answer_from_turn: The first turn (0-based, over both agents) whose reply is pre-filled.
        replay_replies: Show each agent its own earlier replies exactly as generated (``Utterance.reply``), so its
            next prompt extends the previous one token for token and hits the server's prefix cache; False: as
            rendered from the stored utterances (``"Name: text"``), the rendering of the training rows.
        constraints: (Alice's, Bob's) regular expression for the replies of answering turns ("" for none).
    """

    system: tuple[str, str]
    openings: tuple[str, str] = ("", "")
    answer_from_turn: int = 0
    replay_replies: bool = False
    constraints: tuple[str, str] = ("", "")

    def opening(self, turn: int) -> str:
        """The pre-filled start of the reply at ``turn`` ("" for none)."""
        return self.openings[turn % 2] if turn >= self.answer_from_turn else ""

    def constraint(self, turn: int) -> str:
        """The regular expression the reply at ``turn`` must match ("" for a free reply)."""
        return self.constraints[turn % 2] if turn >= self.answer_from_turn else ""


def build_agent_prompts(
    task: Task, system: Sequence[str], prefill_answer: bool = False, answer_patterns: Sequence[str] = ("", "")
) -> AgentPrompts:
    """The agents' prompts for ``task``: answer openings or constraints, exact replies for information exchange.

    Information exchange replays exact replies (docs/method.md#exact-replies): its prompts carry long private
    contexts, so every token a turn re-renders differently is paid again in prefill. Debate keeps the rendering
    its training rows use.

    Args:
        task: The conversation's task.
        system: (Alice's, Bob's) rendered system prompts.
        prefill_answer: Pre-fill the roles' answer openings (``answer_bootstrap: prefill``).
        answer_patterns: (Alice's, Bob's) regular expression that the answering roles' replies must match
            (``answer_bootstrap: grammar``; ``optima.tasks.constraints.reply_pattern``); "" for none.
    """
    roles = [role_prompt(task, name) for name in AGENT_NAMES]
    openings = tuple(role.answer_opening if prefill_answer else "" for role in roles)
    constraints = tuple(p if role.states_answer else "" for role, p in zip(roles, answer_patterns, strict=True))
    from_turn = min((role.answer_from_turn for role in roles if role.states_answer), default=0)
    return AgentPrompts(tuple(system), openings, from_turn, task.family == "qa", constraints)


def opening_view(example: Example, agents: AgentPrompts, task: Task, speaker: str = AGENT_NAMES[1]) -> list[dict]:
    """``speaker``'s view before anyone spoke (system + task turn): the prefix of that agent's first prompt."""
    return build_agent_messages(example, speaker, [], agents.system[agent_index(speaker)], task)


def reply_tokens(reply: ChatReply, speaker: str, count_tokens: CountTokens | None = None) -> int:
    """Generated tokens of one reply: the server's ``usage.completion_tokens``, else ``count_tokens(text, speaker)``.

    The one token rule of generation and the tree search (docs/method.md#token-count); 0 only when the server sent
    no usage and no counter is given.

    Args:
        reply: The reply (``text`` and ``completion_tokens``, None when the server sent no usage).
        speaker: The agent who wrote it (its tokenizer counts).
        count_tokens: ``(text, speaker) -> tokens``.
    """
    if reply.completion_tokens is not None:
        return reply.completion_tokens
    return count_tokens(reply.text, speaker) if count_tokens else 0


def is_cut_reply(reply: ChatReply, tokens: int, max_tokens: int) -> bool:
    """Whether a reply hit the token cap: finish reason ``length``, or as many tokens as allowed."""
    return reply.finish_reason == "length" or tokens >= max_tokens


def run_conversation(
    example: Example,
    agents: AgentPrompts,
    generate: Generate,
    limits: TurnLimits,
    count_tokens: CountTokens | None = None,
    task: Task | None = None,
) -> ConversationResult:
    """Run one two-agent conversation.

    Args:
        example: The question.
        agents: System prompts, answer openings and the rendering of own replies (``build_agent_prompts``).
        generate: Sends one agent's chat and returns the reply; raises ``RequestFailed`` on a failed request.
        limits: ``max_turns`` utterances, ``max_tokens`` per utterance.
        count_tokens: Token counter used when a reply carries no ``completion_tokens``.
        task: The example's task (looked up from ``example.task`` when None).
    """
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
    """The stored utterance of a reply (name prefix and outer whitespace removed), with the exact reply if replayed."""
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
