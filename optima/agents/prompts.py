"""Agent prompts and the single chat renderer used by generation, training data, tree search and evaluation.

The role prompts themselves (our own wording, the paper's roles and protocol) are in ``optima.agents.role_prompts``;
this module renders them into each agent's chat.

Every agent's view is an ordinary chat (`build_agent_messages`), not a transcript of `assistant` turns
(docs/method.md D22): the system prompt holds the role instructions; the first user turn holds the task and
the agent's private information (joined text, not a Python list repr: docs/method.md D11); the agent's own
utterances are `assistant` turns and the partner's are `user` turns (consecutive turns of one role are merged).
Utterances are stored as `Utterance(speaker, text)` without the name prefix and rendered as `"Alice: text"`. During
an information-exchange conversation an utterance may also carry `reply`, what the model wrote, character for
character: the agent's own view then replays it instead of the rendering, so the prompt of its next turn starts
with exactly the tokens the server already holds in its prefix cache (docs/method.md#exact-replies); the partner
always sees the rendering, and stored records, rewards and training rows never see `reply`.

The iteration-0 format pool (docs/method.md#prompt-pool) lives in `prompt_pools/<pool>.jsonl`, one `{"index": k,
"prompt": ...}` per line, each prompt being one extra rule that suggests a compact format. It is used only at iteration
0 of SFT data generation and never in training data (which always uses the base prompts).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from optima.agents.role_prompts import ROLE_PROMPTS, RolePrompt
from optima.tasks import TASKS, Example, Task, get_task

AGENT_NAMES = ("Alice", "Bob")
POOL_DIR = Path(__file__).with_name("prompt_pools")
# prompt set of a task -> the format pool drawn from at iteration 0.
POOL_FOR_PROMPT_SET = {"qa": "qa", "choice": "debate", "gsm8k": "math", "math": "math"}
_TURN_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Utterance:
    """One message of a conversation, stored without its name prefix.

    Parameters:
        speaker (`str`): "Alice" or "Bob".
        text (`str`): what the agent said (a leading "Name:" written by the model is removed with
            `strip_speaker_prefix` before storing).
        reply (`str`, *optional*): the reply exactly as generated (pre-filled opening included), replayed in the
            speaker's own view; None: rendered from `text`. Not part of equality and never stored.
    """

    speaker: str
    text: str
    reply: str | None = field(default=None, compare=False, repr=False)


def as_utterance(item: Utterance | Sequence[str] | dict) -> Utterance:
    """Accept an `Utterance`, a `(speaker, text)` pair or a `{"speaker", "text"}` dict.

    Args:
        item: the utterance in any of those forms.
    """
    if isinstance(item, Utterance):
        return item
    if isinstance(item, dict):
        return Utterance(item["speaker"], item["text"])
    speaker, text = item
    return Utterance(speaker, text)


def agent_index(speaker: str) -> int:
    """Return 0 for Alice and 1 for Bob.

    Args:
        speaker: an agent name.
    """
    if speaker not in AGENT_NAMES:
        raise ValueError(f"unknown speaker {speaker!r}; expected one of {AGENT_NAMES}")
    return AGENT_NAMES.index(speaker)


def partner_of(speaker: str) -> str:
    """Return the other agent's name.

    Args:
        speaker: "Alice" or "Bob".
    """
    return AGENT_NAMES[1 - agent_index(speaker)]


@dataclass(frozen=True)
class RenderStyle:
    """How a training row or a tree-search request renders an agent's view; ``compat: original`` changes it.

    Parameters:
        list_repr_context (`bool`): private information as the Python list repr of its pieces, the rendering of
            training rows and tree-search prompts under ``compat: original`` (docs/method.md, D11); else joined text.
        prompt_set (`str`, *optional*): role prompts to use instead of the task's own (``compat: original`` trains MATH
            conversations under the GSM8K solver prompt: D12).
    """

    list_repr_context: bool = False
    prompt_set: str | None = None


DEFAULT_STYLE = RenderStyle()


def compat_style(compat: str, task: Task | str, sft_rows: bool = False) -> RenderStyle:
    """The rendering of training rows (``sft_rows``: iSFT rows) and tree-search views under recipe ``compat``.

    Generation and evaluation always use the default rendering (joined text), whatever ``compat`` says.
    """
    if compat != "original":
        return DEFAULT_STYLE
    original_math = sft_rows and _resolve(task).prompt_set == "math"
    return RenderStyle(list_repr_context=True, prompt_set="gsm8k" if original_math else None)


def _resolve(task: Task | str) -> Task:
    return get_task(task) if isinstance(task, str) else task


def build_system_prompt(task: Task | str, speaker: str, extra_rule: str | None = None) -> str:
    """Return the base system prompt of `speaker` for `task` (what training data always uses).

    Args:
        task: a `Task` or its name.
        speaker: "Alice" or "Bob".
        extra_rule: an optional format rule (iteration-0 pool entry).
    """
    return role_prompt(task, speaker).render(speaker, partner_of(speaker), extra_rule)


def role_prompt(task: Task | str, speaker: str, style: RenderStyle = DEFAULT_STYLE) -> RolePrompt:
    """The role prompt of `speaker` for `task` (solver/critic in debate, the same for both in qa).

    Args:
        task: a `Task` or its name.
        speaker: "Alice" or "Bob".
        style: may name another prompt set (`compat: original` MATH rows).
    """
    return ROLE_PROMPTS[style.prompt_set or _resolve(task).prompt_set][agent_index(speaker)]


def render_information(paragraphs: Iterable[str]) -> str:
    """Join an agent's private paragraphs into one text block (one paragraph per line).

    Args:
        paragraphs: the agent's context.
    """
    return "\n".join(paragraph.strip() for paragraph in paragraphs if paragraph.strip())


def render_task_turn(
    example: Example, speaker: str, task: Task | None = None, style: RenderStyle = DEFAULT_STYLE
) -> str:
    """Return the first user turn: the question and, for information exchange, the agent's private information.

    Args:
        example: the question.
        speaker: whose view this is.
        task: the example's task (looked up from `example.task` when None).
        style: list-repr information and another prompt set's reminder under `compat: original`.
    """
    task = task or get_task(example.task)
    role = role_prompt(task, speaker, style)
    reminder = Template(role.reminder).safe_substitute(name=speaker, partner=partner_of(speaker))
    if task.family != "qa":
        body = f"Problem:\n{example.question}"
    else:
        pieces = example.context_for(agent_index(speaker))
        information = str(list(pieces)) if style.list_repr_context else render_information(pieces)
        if not information:
            information = "none (answer from what you know and what your partner tells you)"
        body = f"Question: {example.question}{_TURN_SEPARATOR}Your information:\n{information}"
    return f"{body}{_TURN_SEPARATOR}{reminder}" if reminder else body


def render_utterance(utterance: Utterance | Sequence[str] | dict) -> str:
    """Return an utterance as it appears in a chat: `"Name: text"`.

    Args:
        utterance: the utterance.
    """
    utterance = as_utterance(utterance)
    return f"{utterance.speaker}: {utterance.text}"


def build_agent_messages(
    example: Example,
    speaker: str,
    utterances: Iterable[Utterance | Sequence[str] | dict],
    system_prompt: str | None = None,
    task: Task | None = None,
    style: RenderStyle = DEFAULT_STYLE,
) -> list[dict[str, str]]:
    """Build `speaker`'s chat view of a conversation: system, task turn, then user/assistant turns.

    Own utterances become `assistant` turns (an utterance's exact `reply` when it carries one), the partner's
    become `user` turns, each prefixed with its speaker's name; consecutive turns of one role are merged (so the
    partner's first message joins the task turn). The list always starts with system + user, so it renders with
    ChatML (SmolLM2) and Llama-3 templates alike.

    Args:
        example: the question.
        speaker: "Alice" or "Bob".
        utterances: the conversation so far, oldest first.
        system_prompt: a rendered system prompt (e.g. from `draw_pool_prompts`); the base prompt when None.
        task: the example's task (looked up from `example.task` when None).
        style: the rendering (`compat_style`); generation and evaluation use the default.
    """
    task = task or get_task(example.task)
    if system_prompt is None:
        system_prompt = role_prompt(task, speaker, style).render(speaker, partner_of(speaker))
    messages = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": render_task_turn(example, speaker, task, style)},
    ]
    for item in utterances:
        utterance = as_utterance(item)
        agent_index(utterance.speaker)  # validates the name
        own = utterance.speaker == speaker
        role = "assistant" if own else "user"
        content = utterance.reply if own and utterance.reply is not None else render_utterance(utterance)
        if messages[-1]["role"] == role:
            messages[-1] = {"role": role, "content": messages[-1]["content"] + _TURN_SEPARATOR + content}
        else:
            messages.append({"role": role, "content": content})
    return messages


def strip_speaker_prefix(text: str, name: str) -> str:
    """Remove one leading `"Name:"` (also `**Name:**`, `**Name**:`) that the model wrote itself (docs/method.md D15).

    Args:
        text: the generated message.
        name: the speaker's name.
    """
    pattern = rf"\s*(?:\*\*)?{re.escape(name)}(?:\*\*)?\s*:(?:\*\*)?[ \t]*"
    match = re.match(pattern, text)
    return text[match.end() :] if match else text


def is_impersonation(utterance: Utterance | str) -> bool:
    """Whether an utterance speaks for both agents: both `Alice:` and `Bob:`, or one of them twice.

    See docs/method.md#impersonation.

    Args:
        utterance: an `Utterance` (checked with its name prefix, as it is rendered) or prefixed text.
    """
    text = render_utterance(utterance) if isinstance(utterance, Utterance) else utterance
    counts = [text.count(f"{name}:") for name in AGENT_NAMES]
    return all(count >= 1 for count in counts) or any(count >= 2 for count in counts)


def load_prompt_pool(pool: str, pool_dir: Path = POOL_DIR) -> tuple[str, ...]:
    """Load a format pool (`qa`, `debate`, `math`): the `prompt` of each JSONL line, ordered by `index`.

    Args:
        pool: the pool name (file stem).
        pool_dir: the folder of pool files.

    Raises:
        ValueError: on a missing file, a malformed line, or duplicate indices.
    """
    path = pool_dir / f"{pool}.jsonl"
    if not path.is_file():
        available = sorted(p.stem for p in pool_dir.glob("*.jsonl"))
        raise ValueError(f"prompt pool {pool!r} not found at {path}; available: {available}")
    entries: dict[int, str] = {}
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        index, prompt = record.get("index"), record.get("prompt")
        if not isinstance(index, int) or not isinstance(prompt, str) or not prompt.strip() or index in entries:
            raise ValueError(f"{path}:{line_number}: need a unique integer 'index' and a non-empty 'prompt'")
        entries[index] = prompt.strip()
    if not entries:
        raise ValueError(f"prompt pool {path} is empty")
    return tuple(entries[index] for index in sorted(entries))


def pool_name(task: Task | str) -> str:
    """Return the name of the format pool a task draws from at iteration 0.

    Args:
        task: a `Task` or its name.
    """
    return POOL_FOR_PROMPT_SET[_resolve(task).prompt_set]


def draw_pool_prompts(pool: Sequence[str], task: Task | str, rng: random.Random) -> tuple[str, str]:
    """Draw iteration-0 system prompts for one conversation: (Alice's, Bob's) (docs/method.md#prompt-pool).

    qa: one pool rule for both agents; debate: one pool rule for Alice, Bob keeps the base critic prompt.

    Args:
        pool: the pool's rules (from `load_prompt_pool(pool_name(task))`).
        task: a `Task` or its name.
        rng: the caller's seeded RNG (one draw per conversation).
    """
    task = _resolve(task)
    rule = rng.choice(list(pool))
    alice = build_system_prompt(task, AGENT_NAMES[0], extra_rule=rule)
    bob_rule = rule if task.family == "qa" else None
    return alice, build_system_prompt(task, AGENT_NAMES[1], extra_rule=bob_rule)


def templates_identity() -> str:
    """A hash of the role prompts in code and of the chats rendered from them (stage keys, result fingerprints).

    One question of each prompt set, rendered for both agents after one partner message: a change to a role prompt,
    a reminder, an answer opening or the renderer changes it.
    """
    probes: list = [repr(ROLE_PROMPTS)]
    tasks: dict[str, Task] = {}
    for task in TASKS.values():
        tasks.setdefault(task.prompt_set, task)  # the first task of each prompt set
    for prompt_set, task in sorted(tasks.items()):
        example = Example("probe", task.name, "Question?", "answer", task.score_type, ("first",), ("second",))
        for speaker in AGENT_NAMES:
            chat = build_agent_messages(example, speaker, [Utterance(partner_of(speaker), "...")], task=task)
            probes.append([prompt_set, chat])
    return "sha256:" + hashlib.sha256(json.dumps(probes, sort_keys=True).encode()).hexdigest()[:32]
