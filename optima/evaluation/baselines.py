"""The baselines of the paper's comparison table (docs/method.md#baselines), each written as conversation records
(same parsers, scorers, token counts and resume as Optima's own), and the table of methods an evaluation runs.

* CoT: one agent, the whole question (both context halves), reasons briefly and answers in the task's format;
  CoT-SC is the majority vote over sampled CoT answers. The prompts' wording is ours.
* MAD (Du et al. 2023): ``agents`` debaters answer alone, then revise for ``rounds`` rounds after reading the
  others' latest answers; the verdict is the last round's majority (``metrics.majority_answer``). A reply cut at
  ``max_tokens`` stays in the debate but states no answer that round (docs/method.md#cut-replies).
* AutoForm (Chen et al. 2024): Optima's conversation with one more rule in both system prompts: a compact
  non-natural-language format; nothing is trained.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from optima.agents.conversation import (
    AgentPrompts,
    ConversationResult,
    ConversationRunner,
    CountTokens,
    GenerationSettings,
    Job,
    TurnLimits,
    reply_tokens,
    run_conversation,
)
from optima.agents.generation import GenerationHooks, GenerationStats, generate_conversations
from optima.agents.prompts import (
    AGENT_NAMES,
    CHOICE_SLOT,
    GSM8K_SLOT,
    MATH_SLOT,
    QA_SLOT,
    Utterance,
    build_system_prompt,
    render_information,
)
from optima.config import InferenceRecipe, RecipeError
from optima.evaluation.metrics import AnswerMatcher, settle_debate
from optima.evaluation.runs import GenerationJob, conversation_prompts
from optima.evaluation.tables import LABELS
from optima.serving.client import ChatReply, RequestFailed, Sampling
from optima.tasks import Example, Task, get_task
from optima.tasks.sampling import stable_rng

BASELINES = ("cot", "cot_sc", "mad", "autoform")
MAD_CONTEXTS = ("whole", "split")
DebateGenerate = Callable[[list[dict], int, int], ChatReply]  # (messages, agent, round) -> reply; RequestFailed


@dataclass(frozen=True)
class CoTPrompt:
    """System prompt and closing line (answer format) of the single agent for one prompt set."""

    system: str
    reminder: str


COT_PROMPTS: dict[str, CoTPrompt] = {
    "qa": CoTPrompt(
        "You answer questions from the information you are given. Think it through step by step, briefly, and "
        f"finish with the answer between <A> and </A>, like this: {{your reasoning}} {QA_SLOT}",
        f"Think step by step, briefly, then write the answer as {QA_SLOT}.",
    ),
    "choice": CoTPrompt(
        "You answer multiple-choice questions. Think it through step by step, briefly, and finish with the "
        f"chosen option between <A> and </A>, its letter and its text, like this: {CHOICE_SLOT}",
        f"Think step by step, briefly, then write the chosen option as {CHOICE_SLOT}.",
    ),
    "gsm8k": CoTPrompt(
        "You solve math word problems. Work step by step, one short line per calculation, and finish with the "
        f"final number in \\boxed{{}}, like this: {{your calculation}} {GSM8K_SLOT}",
        f"Calculate step by step, then write the final number as {GSM8K_SLOT}.",
    ),
    "math": CoTPrompt(
        "You solve competition mathematics problems. Work step by step, concisely, and finish with the final "
        f"answer in \\boxed{{}}, simplified and in LaTeX, like this: {{your steps}} {MATH_SLOT}",
        f"Solve step by step, then write the final answer as {MATH_SLOT}.",
    ),
}
AUTOFORM_RULE = (
    "Do not write in natural language. Pick the most compact format that carries what ${partner} needs, for "
    "example key: value pairs, JSON, symbols and arrows, logic or math notation, or code, and keep to it. "
    "The rules above about the answer still apply."
)


def build_cot_messages(example: Example, task: Task | None = None, half: int | None = None) -> list[dict[str, str]]:
    """The single agent's chat: system prompt, the question (with all of the context, or only ``half`` 0/1 of it,
    as a debater holds it under ``mad_context: split``) and the format line."""
    task = task or get_task(example.task)
    prompt = COT_PROMPTS[task.prompt_set]
    if task.family == "qa":
        pieces = (*example.context_first, *example.context_second) if half is None else example.context_for(half)
        information = render_information(pieces) or "none"
        body = f"Question: {example.question}\n\nInformation:\n{information}"
    else:
        body = f"Problem:\n{example.question}"
    return [{"role": "system", "content": prompt.system}, {"role": "user", "content": f"{body}\n\n{prompt.reminder}"}]


class CoTRunner(ConversationRunner):
    """One CoT answer as a one-turn conversation (seeded per question and sample), recorded with Alice speaking."""

    def run(self, job: Job) -> tuple[dict, int]:
        task = get_task(job.example.task)
        messages = build_cot_messages(job.example, task)
        replica = self.pool.route(job.position)
        generation = self.generation
        seed = stable_rng(
            self.recipe.seed, "turn", generation.stage, generation.iteration, job.example.id, job.sample_index, 0
        )
        sampling = Sampling(generation.temperature, self.recipe.max_tokens, seed.randrange(2**31))

        def generate(_agent_view: list[dict], _speaker: str):
            # The loop renders Alice's two-agent view; the baseline sends its own single-agent chat instead.
            return self.pool.chat(replica, messages, sampling)

        prompts = (messages[0]["content"], "")
        limits = TurnLimits(max_turns=1, max_tokens=self.recipe.max_tokens)
        result = run_conversation(job.example, AgentPrompts(prompts), generate, limits, self.count_tokens, task)
        if result.replica is None:
            result.replica = replica
        return self.build_record(job, prompts, result), result.token_count


@dataclass(frozen=True)
class DebateSettings:
    """Shape of a debate: ``agents`` (>= 2; Du et al.'s 3), revision ``rounds`` after the first answers (>= 1),
    and on information-exchange tasks the ``context`` each agent reads (``whole``, or ``split``: agent i half i mod
    2, as Optima's two agents hold it)."""

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
    """Run one debate; its utterances are every agent's reply, round by round, and ``token_count`` sums the
    replies' ``completion_tokens`` (``count_tokens`` where a reply has none). ``error`` when a request failed."""
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


class DebateRunner(ConversationRunner):
    """One debate against the replica pool (agents sample at the temperature, seeded per question, sample, agent
    and round), recorded like a conversation plus a ``debate`` field."""

    def __init__(self, recipe: InferenceRecipe, generation: GenerationSettings, pool, settings: DebateSettings):
        super().__init__(recipe, generation, pool)
        self.settings = settings

    def run(self, job: Job) -> tuple[dict, int]:
        task = get_task(job.example.task)
        replica = self.pool.route(job.position)
        generation = self.generation
        seed_parts = (self.recipe.seed, "turn", generation.stage, generation.iteration, job.example.id)

        def generate(messages: list[dict], agent: int, round_index: int) -> ChatReply:
            nonlocal replica
            seed = stable_rng(*seed_parts, job.sample_index, agent, round_index).randrange(2**31)
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


def autoform_prompts(task: Task | str) -> tuple[str, str]:
    """(Alice's, Bob's) system prompts: the base role prompts plus the non-natural-language format rule."""
    return tuple(build_system_prompt(task, name, AUTOFORM_RULE) for name in AGENT_NAMES)


def autoform_request_texts(example: Example) -> list:
    """The texts an AutoForm conversation sends for ``example`` (its prompt version)."""
    return conversation_prompts(example, autoform_prompts(example.task))


class AutoFormRunner(ConversationRunner):
    """The conversation runner with the AutoForm system prompts (never the iteration-0 pool)."""

    def system_prompts(self, task: Task, job: Job) -> tuple[str, str]:
        return autoform_prompts(task)


def generate_with(runner) -> Callable[..., GenerationStats]:
    """A ``generate_conversations`` that runs each job with ``runner`` (same arguments, same resume)."""

    def generate(recipe: InferenceRecipe, examples: Sequence[Example], endpoints, out_path: Path, generation):
        return generate_conversations(recipe, examples, endpoints, out_path, generation, GenerationHooks(runner))

    return generate


generate_cot_answers = generate_with(CoTRunner)
generate_autoform = generate_with(AutoFormRunner)


def generate_debates(
    recipe: InferenceRecipe, examples, endpoints, out_path: Path, generation, settings=DebateSettings()
):
    """``generation.samples`` debates per example into ``out_path`` (resuming what is there)."""
    runner = functools.partial(DebateRunner, settings=settings)
    return generate_with(runner)(recipe, examples, endpoints, out_path, generation)


@dataclass(frozen=True)
class BaselineSettings:
    """How the sampled methods sample: ``samples`` per question (CoT-SC, AutoForm SC, Optima SC; the paper's
    CoT-SC: 8), their and the debaters' ``temperature``, and MAD's shape."""

    samples: int = 8
    temperature: float = 0.5
    debate: DebateSettings = dataclasses.field(default_factory=DebateSettings)

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise RecipeError("samples", f"must be >= 1, got {self.samples}")
        if not 0 <= self.temperature <= 2:
            raise RecipeError("temperature", f"must be in [0, 2], got {self.temperature}")


def method_job(method: str, out_root: Path, name: str, settings: BaselineSettings, iteration: int = -1):
    """The result file ``<out_root>/<name>.<method>.jsonl`` of ``method`` (a key of ``LABELS``) on the model called
    ``name``; ``iteration`` is part of every seed."""
    path, t = out_root / f"{name}.{method}.jsonl", settings.temperature
    cot = {"generate": generate_cot_answers, "prompts": build_cot_messages}
    autoform = {"generate": generate_autoform, "prompts": autoform_request_texts}
    jobs = {
        "optima": (GenerationSettings(iteration, 0.0, 1, stage="eval"), {}),
        "optima_sc": (GenerationSettings(iteration, t, settings.samples, stage="sc"), {}),
        "cot": (GenerationSettings(iteration, 0.0, 1, stage="cot"), cot),
        "cot_sc": (GenerationSettings(iteration, t, settings.samples, stage="cot_sc"), cot),
        "autoform": (GenerationSettings(iteration, 0.0, 1, stage="autoform"), autoform),
        "autoform_sc": (GenerationSettings(iteration, t, settings.samples, stage="autoform_sc"), autoform),
    }
    if method == "mad":
        debate = functools.partial(generate_debates, settings=settings.debate)
        shape = {"agents": settings.debate.agents, "rounds": settings.debate.rounds}  # the context: in the prompts
        prompts = functools.partial(debate_prompts, settings=settings.debate)
        generation = GenerationSettings(iteration, t, 1, stage="mad")
        return GenerationJob(method, path, generation, debate, shape, prompts, reads=("cluster_f1",))  # the vote
    if method not in jobs:
        raise RecipeError("methods", f"unknown method {method!r}; choose from {tuple(LABELS)}")
    generation, parts = jobs[method]
    return GenerationJob(method, path, generation, **parts)
