"""The multi-agent debate baseline (MAD, Du et al. 2023; a row of the paper's comparison table).

``agents`` copies of the served model (default 3, as Du et al.) each answer the question alone, with the
single-agent CoT prompt (``optima.evaluation.cot``). On information-exchange tasks ``context`` decides what each
agent reads: ``whole`` gives every agent the whole context (the default: MAD as a reasoning method), ``split``
gives agent i the half ``i mod 2`` (Alice's or Bob's), as AutoForm and Optima split it between their two agents, so
the debate must carry the information too (docs/method.md#baselines). Then, for ``rounds`` rounds (default 2), each
agent reads the other agents' latest answers and writes a revised one; every agent keeps its own chat (its answers
are ``assistant`` turns, the others' answers arrive in a ``user`` turn). The final answer is the majority of the
agents' last-round answers, clustered as the self-consistency vote does (``optima.evaluation.voting``: the same
matching rules, ties to the earliest agent); agents whose last answer states none do not vote.

Answer parsing, scoring and token counting are the conversations': each reply is parsed by the task's parser, the
record is the same JSONL line (``status``, ``token_count``, ``final_answer``, ``utterances``), scored by the same
scorer, and ``token_count`` sums the server's ``completion_tokens`` of every reply of every agent and round (the
prompts are not counted). A reply cut at ``max_tokens`` stays in the debate (the others read it) and counts its
tokens (``cut_replies`` counts such replies), but states no answer that round (docs/method.md#cut-replies).
Status: ``error`` when a request failed for good, ``too_long`` when no last-round answer was parsed and a
last-round reply was cut, else ``ok``. Agents sample at the settings' temperature
(identical greedy agents would agree from the start), seeded per (question, sample, agent, round).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from optima.agents.conversation import ConversationResult, CountTokens, reply_tokens
from optima.agents.generation import GenerationHooks, GenerationStats, generate_conversations
from optima.agents.prompts import Utterance
from optima.agents.runner import ConversationRunner, GenerationSettings, Job
from optima.config import RecipeError
from optima.evaluation.cot import COT_PROMPTS, build_cot_messages
from optima.evaluation.voting import AnswerMatcher, cluster_answers
from optima.serving.client import ChatReply, RequestFailed, Sampling
from optima.tasks import Example, Task, get_task
from optima.tasks.answers import PARSER_VERSION
from optima.tasks.contexts import stable_rng
from optima.tasks.reparse import PARSER_VERSION_KEY, is_current

if TYPE_CHECKING:
    from optima.config import InferenceRecipe

MAD_CONTEXTS = ("whole", "split")
# (messages, agent index, round) -> the reply; raises RequestFailed.
DebateGenerate = Callable[[list[dict], int, int], ChatReply]


@dataclass(frozen=True)
class DebateSettings:
    """Shape of a debate.

    Args:
        agents: Debating agents (>= 2; the paper's setting, after Du et al., is 3).
        rounds: Revision rounds after the first answers (>= 1).
        context: Information-exchange tasks: ``whole`` (every agent reads the whole context) or ``split``
            (agent i reads half ``i mod 2``, as Optima's two agents do). Other tasks have no context to split.
    """

    agents: int = 3
    rounds: int = 2
    context: Literal["whole", "split"] = "whole"

    def __post_init__(self) -> None:
        if self.context not in MAD_CONTEXTS:
            raise RecipeError("mad_context", f"must be one of {MAD_CONTEXTS}, got {self.context!r}")
        if self.agents < 2:
            raise RecipeError("mad_agents", f"a debate needs at least 2 agents, got {self.agents}")
        if self.rounds < 1:
            raise RecipeError("mad_rounds", f"must be >= 1, got {self.rounds}")


def agent_name(index: int) -> str:
    """The recorded speaker of agent ``index`` (0-based): ``Agent 1``, ``Agent 2``, ..."""
    return f"Agent {index + 1}"


def revision_turn(others: Sequence[tuple[int, str]], reminder: str) -> str:
    """The user turn that shows an agent the other agents' latest answers and asks for a revised one."""
    shown = "\n\n".join(f"{agent_name(i)}: {text.strip() or '(no answer)'}" for i, text in others)
    return (
        f"The other agents answered:\n\n{shown}\n\nWeigh their reasoning against yours, fix any mistake you find, "
        f"and give your updated answer. {reminder}"
    )


def debater_messages(example: Example, task: Task, settings: DebateSettings, agent: int) -> list[dict[str, str]]:
    """An agent's first chat: the CoT prompt with the whole context, or its half under ``context: split``."""
    split = settings.context == "split" and task.family == "qa"
    return build_cot_messages(example, task, agent % 2 if split else None)


def debate_prompts(example: Example, settings: DebateSettings) -> list:
    """The texts a debate sends for ``example`` (each agent's first chat, a revision turn): its prompt version."""
    task = get_task(example.task)
    chats = [debater_messages(example, task, settings, agent) for agent in range(settings.agents)]
    return [*chats, revision_turn([(1, "...")], COT_PROMPTS[task.prompt_set].reminder)]


def majority_answer(answers: Sequence[str | None], matcher: AnswerMatcher) -> str:
    """The answer of the largest vote cluster (the earliest cluster on ties); "" when nobody answered."""
    clusters = cluster_answers(answers, matcher)[-1] if answers else []
    if not clusters:
        return ""
    winner = max(clusters, key=len)
    return answers[winner[0]] or ""


@dataclass
class DebateResult(ConversationResult):
    """A debate's result: a conversation's, and which replies of the last round were cut (they state no answer)."""

    final_cut: list[bool] = dataclasses.field(default_factory=list)


def run_debate(
    example: Example,
    generate: DebateGenerate,
    settings: DebateSettings,
    max_tokens: int,
    matcher: AnswerMatcher,
    count_tokens: CountTokens | None = None,
) -> ConversationResult:
    """Run one debate; its utterances are every agent's reply, round by round.

    Args:
        example: The question.
        generate: Sends one agent's chat and returns the reply.
        settings: Agents and rounds.
        max_tokens: Tokens per reply at most (a reply reaching it is cut: no answer that round).
        matcher: Whether two answers vote together.
        count_tokens: ``(text, speaker) -> tokens``, used when a reply carries no ``completion_tokens``.
    """
    task = get_task(example.task)
    reminder = COT_PROMPTS[task.prompt_set].reminder
    chats = [debater_messages(example, task, settings, agent) for agent in range(settings.agents)]
    result = DebateResult(stop_reason="majority")
    latest: list[str] = [""] * settings.agents
    answers: list[str | None] = [None] * settings.agents
    cut = [False] * settings.agents
    for round_index in range(settings.rounds + 1):
        if round_index:
            for agent, chat in enumerate(chats):
                others = [(i, latest[i]) for i in range(settings.agents) if i != agent]
                chat.append({"role": "user", "content": revision_turn(others, reminder)})
        replies = []
        for agent, chat in enumerate(chats):
            try:
                reply = generate(list(chat), agent, round_index)
            except RequestFailed as exc:
                result.status, result.stop_reason, result.error = "error", "error", str(exc)
                return result
            replies.append(reply)
            result.replica = reply.replica
        for agent, reply in enumerate(replies):  # every agent answered this round before anyone revises
            tokens = reply_tokens(reply, "Alice", count_tokens)  # the agents share one model and tokenizer
            cut[agent] = reply.finish_reason == "length" or tokens >= max_tokens
            result.cut_replies += cut[agent]
            latest[agent] = reply.text.strip()
            answers[agent] = None if cut[agent] else task.parse_answer(latest[agent])
            chats[agent].append({"role": "assistant", "content": latest[agent]})
            result.utterances.append(Utterance(agent_name(agent), latest[agent]))
            result.tokens.append(tokens)
    result.final_cut = cut
    return settle_debate(result, answers, cut, matcher)


def settle_debate(
    result: ConversationResult, answers: Sequence[str | None], cut: Sequence[bool], matcher: AnswerMatcher
) -> ConversationResult:
    """Set the final answer (the last round's majority) and the status of a debate that ran to its end."""
    result.final_answer = majority_answer(answers, matcher)
    too_long = not result.final_answer and any(cut)
    result.status, result.stop_reason = ("too_long", "too_long") if too_long else ("ok", "majority")
    return result


def reparsed_debate(record: dict, cluster_f1: float) -> dict:
    """A debate row with its answer as the current parser reads its last round (``optima.tasks.reparse``).

    The last round's replies are parsed again (those recorded as cut state none) and voted on again; a failed
    debate keeps its record.

    Args:
        record: A row of ``generate_debates`` (``debate``: its shape and the last round's cut replies).
        cluster_f1: The vote's F1 threshold (the recipe's, as at generation).
    """
    if is_current(record) or record.get("status") == "error":
        return record
    agents = record["debate"]["agents"]
    last_round = [u["text"] for u in record["utterances"][-agents:]]
    cut = record["debate"].get("final_cut") or [False] * agents  # rows written before it was recorded: none
    task = get_task(record.get("task") or record["example"]["task"])
    answers = [None if was_cut else task.parse_answer(text) for text, was_cut in zip(last_round, cut, strict=True)]
    result = settle_debate(
        ConversationResult(), answers, cut, AnswerMatcher(Example.from_dict(record["example"]), cluster_f1)
    )
    fresh = {"final_answer": result.final_answer, "status": result.status, "stop_reason": result.stop_reason}
    return record | fresh | {PARSER_VERSION_KEY: PARSER_VERSION}


class DebateRunner(ConversationRunner):
    """Runs one debate against the replica pool and records it like a conversation (plus a ``debate`` field)."""

    def __init__(
        self,
        recipe: InferenceRecipe,
        generation: GenerationSettings,
        pool,
        settings: DebateSettings = DebateSettings(),
    ):
        super().__init__(recipe, generation, pool)
        self.settings = settings

    def run(self, job: Job) -> tuple[dict, int]:
        task = get_task(job.example.task)
        replica = self.pool.route(job.position)
        generation = self.generation
        seed_parts = (
            self.recipe.seed,
            "turn",
            generation.stage,
            generation.iteration,
            job.example.id,
            job.sample_index,
        )

        def generate(messages: list[dict], agent: int, round_index: int) -> ChatReply:
            nonlocal replica
            seed = stable_rng(*seed_parts, agent, round_index).randrange(2**31)
            reply = self.pool.chat(replica, messages, Sampling(generation.temperature, self.recipe.max_tokens, seed))
            replica = reply.replica
            return reply

        matcher = AnswerMatcher(job.example, getattr(self.recipe, "cluster_f1", 0.9))
        result = run_debate(job.example, generate, self.settings, self.recipe.max_tokens, matcher, self.count_tokens)
        if result.replica is None:
            result.replica = replica
        record = self.build_record(job, (build_cot_messages(job.example, task)[0]["content"], ""), result)
        record["debate"] = dataclasses.asdict(self.settings) | {"final_cut": getattr(result, "final_cut", [])}
        return record, result.token_count


def generate_debates(
    recipe: InferenceRecipe,
    examples: Sequence[Example],
    endpoints: Sequence[str],
    out_path: Path,
    generation: GenerationSettings,
    settings: DebateSettings = DebateSettings(),
) -> GenerationStats:
    """``generation.samples`` debates per example into ``out_path`` (resuming what is there).

    Same contract as ``optima.agents.generation.generate_conversations``, which it runs with the debate runner.
    """
    runner = functools.partial(DebateRunner, settings=settings)
    return generate_conversations(recipe, examples, endpoints, out_path, generation, GenerationHooks(runner))
