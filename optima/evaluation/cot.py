"""The single-agent chain-of-thought baseline (paper Table 1 rows CoT and SC): one agent, one message.

The agent gets the whole question (for information-exchange tasks both halves of the context, since nobody else
holds them), reasons briefly and states its answer in the task's format (``<A>..</A>`` or ``\\boxed{}``), so the
same parsers and scorers apply as for Optima's conversations. CoT is one greedy sample per question; CoT-SC is
the self-consistency analysis (``optima.evaluation.voting``) over k sampled answers.

The machinery is the conversation's: each answer is a one-turn conversation (``run_conversation`` with
``max_turns=1``) whose single request carries the single-agent chat, sent through the same replica pool (routing,
retries, failover), seeded per (question, sample), and written as the same JSONL record (``status`` ``ok`` /
``too_long`` / ``error``, ``token_count``, ``final_answer``), resumable in the same way. The speaker is recorded
as Alice. The wording of the prompts is our own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from optima.agents.conversation import AgentPrompts, TurnLimits, run_conversation
from optima.agents.generation import GenerationHooks, GenerationStats, generate_conversations
from optima.agents.prompts import render_information
from optima.agents.role_prompts import CHOICE_SLOT, GSM8K_SLOT, MATH_SLOT, QA_SLOT
from optima.agents.runner import ConversationRunner, GenerationSettings, Job
from optima.serving.client import Sampling
from optima.tasks import Example, Task, get_task
from optima.tasks.contexts import stable_rng

if TYPE_CHECKING:
    from optima.config import InferenceRecipe

logger = logging.getLogger(__name__)


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


def build_cot_messages(example: Example, task: Task | None = None, half: int | None = None) -> list[dict[str, str]]:
    """The single agent's chat: system prompt, then the question (with all of the context) and the format line.

    Args:
        example: The question.
        task: Its task (looked up from ``example.task`` when None).
        half: Information-exchange tasks: only this half of the context (0: Alice's, 1: Bob's), as a debater
            holds it under ``mad_context: split``; None: the whole context.
    """
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
    """Runs one CoT answer as a one-turn conversation and records it like a conversation."""

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


def generate_cot_answers(
    recipe: InferenceRecipe,
    examples: Sequence[Example],
    endpoints: Sequence[str],
    out_path: Path,
    generation: GenerationSettings,
) -> GenerationStats:
    """``generation.samples`` single-agent answers per example into ``out_path`` (resuming what is there).

    Same contract as ``optima.agents.generation.generate_conversations``, which it runs with the CoT runner.
    """
    return generate_conversations(recipe, examples, endpoints, out_path, generation, GenerationHooks(CoTRunner))
