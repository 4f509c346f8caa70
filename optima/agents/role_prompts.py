"""The agents' role prompts: the template of each role's system prompt and the table of roles of each prompt set.

Roles and protocol follow the paper (docs/method.md#roles-and-prompts); the wording is our own (docs/method.md,
D23):
* information exchange ("qa"): both agents get the same role prompt; each holds private paragraphs, shares what
  matters concisely and finishes with `<A>{your answer}</A>`;
* debate: Alice solves (answer in `<A>..</A>` for arc/mmlu, `\\boxed{}` for gsm8k, a MATH-specific solver for math,
  docs/method.md D12) and Bob critiques without ever giving the answer.
Each prompt ends with a one-line example of a message in the answer format, because small models (SmolLM2-135M)
rarely write the answer tag unless they see it. The example and the format lines show the answer slot as a
placeholder that no task would answer (`ANSWER_PLACEHOLDERS`: `{your answer}`, `{letter}) {option text}`,
`{number}`), never a worked answer: with the answer pre-fill a small model copies what it sees, and training would
teach the copy. A copied placeholder is no answer (`Task.parse_answer`).

``optima.agents.prompts`` renders these templates into each agent's chat.
"""

from __future__ import annotations

from dataclasses import dataclass
from string import Template

from optima.tasks.answers import ANSWER_PLACEHOLDERS, render_answer


@dataclass(frozen=True)
class RolePrompt:
    """A role's system prompt: an intro, numbered rules and an example message (`${name}`, `${partner}` slots).

    `reminder` closes the first user turn with the answer format in one line: small models follow the last user
    line far more than the system prompt (SmolLM2-135M wrote no answer tag in 144 replies without it).
    `answer_opening` is what a reply starts with when generation pre-fills the answer (`prefill_answer`), from
    conversation turn `answer_from_turn` on (0: every reply; information exchange waits until both agents have
    shared their information once, so that the pre-filled answers follow an exchange instead of replacing it).
    `states_answer`: the role answers (the solvers, both information-exchange agents; not the critic), so its
    replies are the ones the answer bootstrap constrains (`answer_bootstrap: grammar`), from `answer_from_turn` on.
    """

    intro: str
    rules: tuple[str, ...]
    example: str
    reminder: str = ""
    answer_opening: str = ""
    answer_from_turn: int = 0
    states_answer: bool = True

    def render(self, name: str, partner: str, extra_rule: str | None = None) -> str:
        """Return the system prompt for agent `name`, optionally with one more rule (a format-pool entry).

        Args:
            name: the agent's name.
            partner: the other agent's name.
            extra_rule: a rule appended after the others (iteration-0 format diversity).
        """
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

# prompt set -> (Alice's role prompt, Bob's role prompt). Tasks choose through `Task.prompt_set`.
ROLE_PROMPTS: dict[str, tuple[RolePrompt, RolePrompt]] = {
    "qa": (QA_PROMPT, QA_PROMPT),
    "choice": (CHOICE_SOLVER_PROMPT, CRITIC_PROMPT),
    "gsm8k": (GSM8K_SOLVER_PROMPT, CRITIC_PROMPT),
    "math": (MATH_SOLVER_PROMPT, CRITIC_PROMPT),
}
