"""The agents' prompts and the one chat renderer of generation, training rows, tree search and evaluation.

The role prompts are our own wording of the paper's roles and protocol (docs/method.md#roles-and-prompts): in
information exchange both agents share what matters and answer `<A>{your answer}</A>`; in debate Alice solves and
Bob critiques without ever giving the answer. Each prompt ends with an example message whose answer slot is a
placeholder no task would answer, never a worked answer: with the answer pre-fill a small model copies what it
sees. An agent's view is an ordinary chat: the role in the system prompt, the task and its private information in
the first user turn, its own utterances as `assistant` turns, the partner's as `user` turns.
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

from optima.tasks import TASKS, Example, Task, get_task
from optima.tasks.answers import ANSWER_PLACEHOLDERS, render_answer

AGENT_NAMES = ("Alice", "Bob")
POOL_DIR = Path(__file__).with_name("prompt_pools")
# prompt set of a task -> the format pool drawn from at iteration 0.
POOL_FOR_PROMPT_SET = {"qa": "qa", "choice": "debate", "gsm8k": "math", "math": "math"}
_TURN_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class RolePrompt:
    """A role's system prompt: an intro, numbered rules and an example message (`${name}`, `${partner}` slots).

    `reminder` closes the first user turn with the answer format in one line (docs/method.md#roles-and-prompts).
    `answer_opening` starts a pre-filled reply (`answer_bootstrap: prefill`) from conversation turn
    `answer_from_turn` on (information exchange waits until both agents have shared their information once).
    `states_answer`: the role answers (not the critic), so the answer bootstrap touches its replies.
    """

    intro: str
    rules: tuple[str, ...]
    example: str
    reminder: str = ""
    answer_opening: str = ""
    answer_from_turn: int = 0
    states_answer: bool = True

    def render(self, name: str, partner: str, extra_rule: str | None = None) -> str:
        """The system prompt of agent `name`, with `extra_rule` (a format-pool entry) after the others."""
        rules = [*self.rules, extra_rule] if extra_rule else list(self.rules)
        lines = [self.intro, "Rules:", *(f"{i}. {rule}" for i, rule in enumerate(rules, start=1))]
        lines += ["Example of a message:", self.example]
        return Template("\n".join(lines)).safe_substitute(name=name, partner=partner)


_PREFIX_RULE = 'Begin each message with "${name}:".'
# The answer slot of each prompt set's examples and format lines: a placeholder, never a worked answer.
QA_SLOT = render_answer(ANSWER_PLACEHOLDERS["qa"][0], "tag")  # <A>{your answer}</A>
CHOICE_SLOT = render_answer(ANSWER_PLACEHOLDERS["choice"][0], "tag")  # <A>{letter}) {option text}</A>
GSM8K_SLOT = render_answer(ANSWER_PLACEHOLDERS["gsm8k"][0], "boxed")  # \boxed{{number}}
MATH_SLOT = render_answer(ANSWER_PLACEHOLDERS["math"][0], "boxed")  # \boxed{{your answer}}

QA_PROMPT = RolePrompt(
    intro=(
        "You are ${name}. You and ${partner} answer a question together. Each of you holds different information "
        "and neither can answer alone, so you must exchange what matters."
    ),
    rules=(
        "Share only the facts from your information that help answer the question, or ask ${partner} for what "
        "you are missing. Be as brief as possible: no greetings, no full sentences needed.",
        "Use only your information and what ${partner} tells you.",
        "When you know the answer, end your message with it between <A> and </A>. The conversation ends when "
        "you both give the same answer.",
        _PREFIX_RULE,
    ),
    example=f"${{name}}: {{the facts ${{partner}} needs, briefly}} {QA_SLOT}",
    reminder=f"Share what helps, briefly. Once you know the answer, write it as {QA_SLOT}.",
    answer_opening="<A>",
    answer_from_turn=2,
)

CHOICE_SOLVER_PROMPT = RolePrompt(
    intro="You are ${name}. You solve a multiple-choice question; ${partner} checks your reasoning.",
    rules=(
        "Reason step by step, briefly.",
        "If ${partner} finds a mistake, fix it; otherwise keep your answer.",
        "End every message with the chosen option between <A> and </A>: its letter and its text.",
        _PREFIX_RULE,
    ),
    example=f"${{name}}: {{one short reason}} {CHOICE_SLOT}",
    reminder=f"Reply as: {CHOICE_SLOT} then one short reason.",
    answer_opening="<A>",
)

GSM8K_SOLVER_PROMPT = RolePrompt(
    intro="You are ${name}, good at mathematics. You solve a word problem; ${partner} checks your work.",
    rules=(
        "Think step by step, one short line per calculation.",
        "If ${partner} finds a mistake, correct it; otherwise keep your answer.",
        "End every message with the final answer in \\boxed{}; put only the number inside the box.",
        _PREFIX_RULE,
    ),
    example=f"${{name}}: {{one short line per calculation}} {GSM8K_SLOT}",
    reminder=f"Calculate briefly, then write the final number as {GSM8K_SLOT}.",
)

MATH_SOLVER_PROMPT = RolePrompt(
    intro="You are ${name}, good at mathematics. You solve a competition problem; ${partner} checks your work.",
    rules=(
        "Think step by step, concisely.",
        "If ${partner} finds a mistake, correct it; otherwise keep your answer.",
        "End every message with the final answer in \\boxed{}, simplified and written in LaTeX "
        "(a number, a fraction, an expression, an interval, ...).",
        _PREFIX_RULE,
    ),
    example=f"${{name}}: {{the key steps}} {MATH_SLOT}",
    reminder=f"Solve briefly, then write the final answer as {MATH_SLOT}.",
)

CRITIC_PROMPT = RolePrompt(
    intro="You are ${name}. ${partner} is solving a problem and you check the work.",
    rules=(
        "Check each step of ${partner}'s latest message. Point out any error and how to fix it, briefly.",
        "If everything is right, say so in a few words.",
        "Never state the final answer yourself: do not write <A> tags or a box.",
        _PREFIX_RULE,
    ),
    example="${name}: Step 2 is wrong: 12 - 5 is 7, not 8. Redo the last step.",
    reminder="Check ${partner}'s answer in a few words; never give the answer yourself.",
    states_answer=False,
)

# prompt set -> (Alice's role prompt, Bob's role prompt); a task chooses by its `prompt_set`.
ROLE_PROMPTS: dict[str, tuple[RolePrompt, RolePrompt]] = {
    "qa": (QA_PROMPT, QA_PROMPT),
    "choice": (CHOICE_SOLVER_PROMPT, CRITIC_PROMPT),
    "gsm8k": (GSM8K_SOLVER_PROMPT, CRITIC_PROMPT),
    "math": (MATH_SOLVER_PROMPT, CRITIC_PROMPT),
}


@dataclass(frozen=True)
class Utterance:
    """One message, stored without its name prefix and rendered `"Alice: text"`.

    `reply`: the reply exactly as generated (pre-filled opening included), replayed in the speaker's own view so that
    its next prompt extends the one the server cached (docs/method.md#exact-replies); never stored or compared.
    """

    speaker: str
    text: str
    reply: str | None = field(default=None, compare=False, repr=False)


def as_utterance(item: Utterance | Sequence[str] | dict) -> Utterance:
    """An `Utterance` from itself, a `(speaker, text)` pair or a `{"speaker", "text"}` dict."""
    if isinstance(item, Utterance):
        return item
    if isinstance(item, dict):
        return Utterance(item["speaker"], item["text"])
    speaker, text = item
    return Utterance(speaker, text)


def agent_index(speaker: str) -> int:
    """0 for Alice, 1 for Bob."""
    if speaker not in AGENT_NAMES:
        raise ValueError(f"unknown speaker {speaker!r}; expected one of {AGENT_NAMES}")
    return AGENT_NAMES.index(speaker)


def partner_of(speaker: str) -> str:
    """The other agent's name."""
    return AGENT_NAMES[1 - agent_index(speaker)]


@dataclass(frozen=True)
class RenderStyle:
    """How a training row or a tree-search request renders a view: under `compat: original` the private
    information as the Python list repr of its pieces (docs/method.md, D11), and MATH rows under the GSM8K solver
    prompt (`prompt_set`, D12)."""

    list_repr_context: bool = False
    prompt_set: str | None = None


DEFAULT_STYLE = RenderStyle()


def compat_style(compat: str, task: Task | str, sft_rows: bool = False) -> RenderStyle:
    """The rendering of training rows (`sft_rows`: iSFT's) and tree-search views under recipe `compat`
    (generation and evaluation always render the default)."""
    if compat != "original":
        return DEFAULT_STYLE
    original_math = sft_rows and _resolve(task).prompt_set == "math"
    return RenderStyle(list_repr_context=True, prompt_set="gsm8k" if original_math else None)


def _resolve(task: Task | str) -> Task:
    return get_task(task) if isinstance(task, str) else task


def build_system_prompt(task: Task | str, speaker: str, extra_rule: str | None = None) -> str:
    """The base system prompt of `speaker` (training rows always carry it), with an optional pool rule."""
    return role_prompt(task, speaker).render(speaker, partner_of(speaker), extra_rule)


def role_prompt(task: Task | str, speaker: str, style: RenderStyle = DEFAULT_STYLE) -> RolePrompt:
    """The role prompt of `speaker` for `task` (or for `style.prompt_set`)."""
    return ROLE_PROMPTS[style.prompt_set or _resolve(task).prompt_set][agent_index(speaker)]


def render_information(paragraphs: Iterable[str]) -> str:
    """An agent's private paragraphs as one text, one per line (not a list repr: docs/method.md, D11)."""
    return "\n".join(paragraph.strip() for paragraph in paragraphs if paragraph.strip())


def render_task_turn(
    example: Example, speaker: str, task: Task | None = None, style: RenderStyle = DEFAULT_STYLE
) -> str:
    """The first user turn: the question, the agent's private information (information exchange), the reminder."""
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
    """An utterance as a chat shows it: `"Name: text"`."""
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
    """`speaker`'s chat view of a conversation: system, task turn, then the utterances so far.

    Own utterances are `assistant` turns (their exact `reply` when they carry one), the partner's `user` turns;
    consecutive turns of one role are merged, so the list starts with system + user under any chat template.

    Args:
        system_prompt: a rendered system prompt (a pool draw); the base prompt when None.
        task: the example's task (looked up from `example.task` when None).
        style: the rendering (`compat_style`).
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
    """`text` without one leading `"Name:"` (or `**Name:**`, `**Name**:`) the model wrote itself."""
    pattern = rf"\s*(?:\*\*)?{re.escape(name)}(?:\*\*)?\s*:(?:\*\*)?[ \t]*"
    match = re.match(pattern, text)
    return text[match.end() :] if match else text


def is_impersonation(utterance: Utterance | str) -> bool:
    """Whether an utterance (rendered with its prefix) speaks for both agents: both names, or one of them twice."""
    text = render_utterance(utterance) if isinstance(utterance, Utterance) else utterance
    counts = [text.count(f"{name}:") for name in AGENT_NAMES]
    return all(count >= 1 for count in counts) or any(count >= 2 for count in counts)


def load_prompt_pool(pool: str, pool_dir: Path = POOL_DIR) -> tuple[str, ...]:
    """A format pool (`qa`, `debate`, `math`): the `prompt` of each `{"index", "prompt"}` line, by index.

    Raises:
        ValueError: a missing file, a malformed line, or a repeated index.
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
    """The format pool a task draws from at iteration 0."""
    return POOL_FOR_PROMPT_SET[_resolve(task).prompt_set]


def draw_pool_prompts(pool: Sequence[str], task: Task | str, rng: random.Random) -> tuple[str, str]:
    """(Alice's, Bob's) iteration-0 system prompts (docs/method.md#prompt-pool): one pool rule for both agents in
    information exchange, for Alice only in debate (the critic keeps its prompt); one `rng` draw."""
    task = _resolve(task)
    rule = rng.choice(list(pool))
    alice = build_system_prompt(task, AGENT_NAMES[0], extra_rule=rule)
    bob_rule = rule if task.family == "qa" else None
    return alice, build_system_prompt(task, AGENT_NAMES[1], extra_rule=bob_rule)


def templates_identity() -> str:
    """A hash of the role prompts and of chats rendered from them (one question per prompt set, both views): the
    stage keys and result fingerprints change with a prompt, a reminder, an answer opening or the renderer."""
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
