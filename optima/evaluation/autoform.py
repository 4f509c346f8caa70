"""The AutoForm baseline (Chen et al. 2024; a row of the paper's comparison table).

Optima's own two-agent conversation (the same turn loop, stop rule, parsing, scoring and token counting) with one
more rule in both system prompts: write in a compact format of the agent's choosing that is not natural language.
Nothing is trained; the row shows what prompting alone buys against what Optima's training buys. The rule is added
the way the iteration-0 format pool adds its entries (``RolePrompt.render(extra_rule=...)``); the wording is ours.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from optima.agents.generation import GenerationHooks, GenerationStats, generate_conversations
from optima.agents.prompts import AGENT_NAMES, build_system_prompt
from optima.agents.runner import ConversationRunner, GenerationSettings, Job
from optima.evaluation.fingerprint import conversation_prompts
from optima.tasks import Example, Task

if TYPE_CHECKING:
    from optima.config import InferenceRecipe

AUTOFORM_RULE = (
    "Do not write in natural language. Pick the most compact format that carries what ${partner} needs, for "
    "example key: value pairs, JSON, symbols and arrows, logic or math notation, or code, and keep to it. "
    "The rules above about the answer still apply."
)


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


def generate_autoform(
    recipe: InferenceRecipe,
    examples: Sequence[Example],
    endpoints: Sequence[str],
    out_path: Path,
    generation: GenerationSettings,
) -> GenerationStats:
    """``generation.samples`` AutoForm conversations per example into ``out_path`` (resuming what is there)."""
    return generate_conversations(recipe, examples, endpoints, out_path, generation, GenerationHooks(AutoFormRunner))
