"""Tests for prompts, the chat renderer and the format pool (optima/agents/prompts.py;
docs/method.md#conversations)."""

from __future__ import annotations

import json
import random
import re

import pytest

from optima.agents.prompts import (
    AGENT_NAMES,
    CRITIC_PROMPT,
    POOL_DIR,
    ROLE_PROMPTS,
    Utterance,
    build_agent_messages,
    build_system_prompt,
    draw_pool_prompts,
    is_impersonation,
    load_prompt_pool,
    partner_of,
    pool_name,
    render_information,
    render_task_turn,
    role_prompt,
    strip_speaker_prefix,
)
from optima.tasks import TASKS, Example, get_task
from optima.tasks.answers import ANSWER_PARSERS, parse_boxed, parse_tag
from tests._task_fixtures import SMOLLM2_DIR, build_llama3_tokenizer

QA_EXAMPLE = Example(
    id="q1",
    task="hotpot_qa",
    question="Which city is the capital?",
    answer="Paris",
    score_type="f1",
    context_first=("France: Paris is the capital of France.", "Seine: A river."),
    context_second=("Louvre: A museum in Paris.",),
)
DEBATE_EXAMPLE = Example(id="g1", task="gsm8k", question="What is 3 + 4?", answer="7", score_type="number")
CLOSED_BOOK = Example(id="t1", task="trival_qa", question="Who?", answer=("Bacall",), score_type="f1")

CONVERSATION = [
    Utterance("Alice", "France -> Paris capital."),
    ("Bob", "Louvre in Paris. <A>Paris</A>"),
    {"speaker": "Alice", "text": "<A>Paris</A>"},
]


def roles(messages):
    return [message["role"] for message in messages]


# ---------------------------------------------------------------- message building


def test_alice_first_turn_has_a_user_turn_with_her_information():
    messages = build_agent_messages(QA_EXAMPLE, "Alice", [])
    assert roles(messages) == ["system", "user"]
    assert messages[0]["content"] == build_system_prompt("hotpot_qa", "Alice")
    user = messages[1]["content"]
    assert "Which city is the capital?" in user and "France: Paris is the capital of France.\nSeine: A river." in user
    assert "Louvre" not in user and "['" not in user


@pytest.mark.parametrize(
    ("speaker", "history", "expected_roles"),
    [
        ("Bob", 1, ["system", "user"]),
        ("Alice", 2, ["system", "user", "assistant", "user"]),
        ("Bob", 3, ["system", "user", "assistant", "user"]),
        ("Alice", 3, ["system", "user", "assistant", "user", "assistant"]),
    ],
)
def test_views_alternate_roles_and_prefix_names(speaker, history, expected_roles):
    messages = build_agent_messages(QA_EXAMPLE, speaker, CONVERSATION[:history])
    assert roles(messages) == expected_roles
    own = [m["content"] for m in messages if m["role"] == "assistant"]
    assert all(content.startswith(f"{speaker}: ") for content in own)
    assert (f"{partner_of(speaker)}: " in messages[1]["content"]) == (speaker == "Bob")


def test_partner_turns_are_merged_when_consecutive():
    history = [("Alice", "one"), ("Alice", "two"), ("Bob", "three")]
    messages = build_agent_messages(QA_EXAMPLE, "Bob", history)
    assert roles(messages) == ["system", "user", "assistant"]
    assert messages[1]["content"].endswith("Alice: one\n\nAlice: two")


def test_debate_view_has_no_information_and_custom_system_prompt():
    messages = build_agent_messages(DEBATE_EXAMPLE, "Bob", [("Alice", "3 + 4 = 7. \\boxed{7}")], system_prompt="S")
    assert messages[0] == {"role": "system", "content": "S"}
    assert messages[1]["content"] == (
        "Problem:\nWhat is 3 + 4?\n\nCheck Alice's answer in a few words; never give the answer yourself."
        "\n\nAlice: 3 + 4 = 7. \\boxed{7}"
    )


@pytest.mark.parametrize(
    ("task", "speaker", "fragment"),
    [
        ("arc", "Alice", "<A>{letter}) {option text}</A>"),
        ("gsm8k", "Alice", "\\boxed{{number}}"),
        ("math", "Alice", "\\boxed{{your answer}}"),
        ("arc", "Bob", "never give the answer"),
        ("hotpot_qa", "Bob", "<A>{your answer}</A>"),
    ],
)
def test_first_user_turn_ends_with_the_answer_format(task, speaker, fragment):
    example = QA_EXAMPLE if task == "hotpot_qa" else DEBATE_EXAMPLE
    turn = render_task_turn(example, speaker, get_task(task))
    assert fragment in turn.splitlines()[-1]


def test_closed_book_and_information_rendering():
    assert "Your information:\nnone" in render_task_turn(CLOSED_BOOK, "Bob")
    assert render_information([" a ", "", "b"]) == "a\nb"


def test_unknown_speaker_is_rejected():
    with pytest.raises(ValueError, match="speaker"):
        build_agent_messages(QA_EXAMPLE, "Carol", [])
    with pytest.raises(ValueError, match="speaker"):
        build_agent_messages(QA_EXAMPLE, "Alice", [("Carol", "hi")])


# ---------------------------------------------------------------- prefixes and impersonation


@pytest.mark.parametrize(
    ("text", "name", "expected"),
    [
        ("Alice: hi", "Alice", "hi"),
        ("  Alice:hi", "Alice", "hi"),
        ("**Alice:** hi", "Alice", "hi"),
        ("**Alice**: hi", "Alice", "hi"),
        ("Alice : hi", "Alice", "hi"),
        ("Alice: ice cream", "Alice", "ice cream"),  # str.strip("Alice:") would eat "ice"
        ("Alice: Alice: twice", "Alice", "Alice: twice"),
        ("Alice:\nline", "Alice", "\nline"),
        ("Alice said hi", "Alice", "Alice said hi"),
        ("Alicea: x", "Alice", "Alicea: x"),
        ("Bob: hi", "Alice", "Bob: hi"),
        ("", "Bob", ""),
    ],
)
def test_strip_speaker_prefix(text, name, expected):
    assert strip_speaker_prefix(text, name) == expected


@pytest.mark.parametrize(
    ("utterance", "expected"),
    [
        ("Alice: facts. <A>x</A>", False),
        ("Alice: facts. Bob: I agree", True),
        ("Alice: one. Alice: two", True),
        ("Bob: a Bob: b", True),
        ("no prefix at all", False),
        (Utterance("Alice", "facts"), False),
        (Utterance("Alice", "facts\nBob: sure"), True),
        (Utterance("Bob", "Bob: again"), True),
    ],
)
def test_is_impersonation(utterance, expected):
    assert is_impersonation(utterance) is expected


# ---------------------------------------------------------------- prompts per task


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_has_both_prompts_with_the_answer_protocol(name):
    task = get_task(name)
    alice, bob = (build_system_prompt(task, speaker) for speaker in AGENT_NAMES)
    marker = "<A>" if task.answer_style == "tag" else "\\boxed{"
    assert marker in alice and "You are Alice" in alice and "You are Bob" in bob
    assert "${" not in alice + bob
    solver_example = alice.rsplit("\n", 1)[-1]
    # The example shows the answer format with its placeholder: the format is there, the answer is not.
    assert solver_example.startswith("Alice: ") and ANSWER_PARSERS[task.answer_style](solver_example)
    assert task.parse_answer(solver_example) is None
    if task.family == "debate":
        assert bob == CRITIC_PROMPT.render("Bob", "Alice") and "Never state the final answer" in bob
        critic_example = bob.rsplit("\n", 1)[-1]
        assert parse_tag(critic_example) is None and parse_boxed(critic_example) is None
    else:
        assert bob == alice.replace("Alice", "@").replace("Bob", "Alice").replace("@", "Bob")


def test_math_has_its_own_solver_prompt():
    assert build_system_prompt("math", "Alice") != build_system_prompt("gsm8k", "Alice")
    assert "only the number" in build_system_prompt("gsm8k", "Alice")
    assert "only the number" not in build_system_prompt("math", "Alice")
    assert set(ROLE_PROMPTS) == {task.prompt_set for task in TASKS.values()}


# ---------------------------------------------------------------- format pool


@pytest.mark.parametrize(("pool", "minimum"), [("qa", 10), ("debate", 10), ("math", 1)])
def test_pools_load_in_index_order(pool, minimum):
    rules = load_prompt_pool(pool)
    assert len(rules) >= minimum and len(set(rules)) == len(rules)
    lines = [json.loads(line) for line in (POOL_DIR / f"{pool}.jsonl").read_text().splitlines()]
    assert [line["index"] for line in lines] == list(range(len(lines)))


def test_bad_pool_files_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_prompt_pool("nope", pool_dir=tmp_path)
    (tmp_path / "dup.jsonl").write_text('{"index": 0, "prompt": "a"}\n{"index": 0, "prompt": "b"}\n')
    with pytest.raises(ValueError, match="unique"):
        load_prompt_pool("dup", pool_dir=tmp_path)


@pytest.mark.parametrize(
    ("task_name", "pool"),
    [("hotpot_qa", "qa"), ("arc", "debate"), ("mmlu", "debate"), ("gsm8k", "math"), ("math", "math")],
)
def test_draw_pool_prompts(task_name, pool):
    assert pool_name(task_name) == pool
    rules = load_prompt_pool(pool)
    draws = [draw_pool_prompts(rules, task_name, random.Random(seed)) for seed in range(20)]
    assert draws == [draw_pool_prompts(rules, task_name, random.Random(seed)) for seed in range(20)]
    for alice, bob in draws:
        rule = next(rule for rule in rules if rule in alice)
        assert alice == build_system_prompt(task_name, "Alice", extra_rule=rule)
        if get_task(task_name).family == "qa":
            assert bob == build_system_prompt(task_name, "Bob", extra_rule=rule)
        else:
            assert bob == build_system_prompt(task_name, "Bob")
    if len(rules) > 1:
        assert len({alice for alice, _ in draws}) > 1


# ---------------------------------------------------------------- real chat templates


def _render_views(tokenizer):
    views = [
        (build_agent_messages(QA_EXAMPLE, "Alice", []), ["system", "user"]),
        (build_agent_messages(QA_EXAMPLE, "Bob", CONVERSATION[:1]), ["system", "user"]),
        (build_agent_messages(QA_EXAMPLE, "Alice", CONVERSATION[:2]), ["system", "user", "assistant", "user"]),
        (
            build_agent_messages(QA_EXAMPLE, "Alice", CONVERSATION),
            ["system", "user", "assistant", "user", "assistant"],
        ),
        (build_agent_messages(DEBATE_EXAMPLE, "Bob", [("Alice", "\\boxed{7}")]), ["system", "user"]),
    ]
    for messages, expected_roles in views:
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert all(message["content"].strip() in prompt for message in messages)
        yield prompt, expected_roles + ["assistant"]
        tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)


def test_views_render_with_smollm2_chatml_template():
    pytest.importorskip("transformers")
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2 folder missing at {SMOLLM2_DIR} (run `python -m optima setup`)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    for prompt, expected_roles in _render_views(tokenizer):
        assert re.findall(r"<\|im_start\|>(\w+)\n", prompt) == expected_roles
        assert prompt.endswith("<|im_start|>assistant\n") and "You are a helpful AI assistant" not in prompt


def test_views_render_with_llama3_template():
    pytest.importorskip("transformers")
    tokenizer = build_llama3_tokenizer()
    for prompt, expected_roles in _render_views(tokenizer):
        assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
        assert re.findall(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>", prompt) == expected_roles
        assert prompt.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


# ---------------------------------------------------------------- no answer in the prompts


def every_prompt_text(task: str) -> list[str]:
    """Every text the agents of ``task`` can be shown: role prompts (with each pool rule), reminders, CoT, AutoForm."""
    from optima.evaluation.baselines import COT_PROMPTS, autoform_prompts

    resolved = get_task(task)
    texts = [build_system_prompt(resolved, name, rule) for name in AGENT_NAMES
             for rule in (None, *load_prompt_pool(pool_name(resolved)))]  # fmt: skip
    texts += [role_prompt(resolved, name).reminder for name in AGENT_NAMES]
    cot = COT_PROMPTS[resolved.prompt_set]
    return [*texts, cot.system, cot.reminder, *autoform_prompts(resolved)]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_no_prompt_states_an_answer(task):
    """A prompt shows the answer format with a placeholder, which the task's parser reads as no answer."""
    for text in every_prompt_text(task):
        assert get_task(task).parse_answer(text) is None, text
        for worked in ("Khartoum", "Nile", "adding heat", "\\boxed{7}", "Ridley Scott", "1937", '"pick": "B"'):
            assert worked not in text


@pytest.mark.parametrize(
    ("task", "text", "expected"),
    [
        ("hotpot_qa", "<A>{your answer}</A>", None),  # the placeholder, copied
        ("hotpot_qa", "<A> Your Answer </A>", None),  # ... without its braces
        ("hotpot_qa", "<A>{year}</A>", None),  # any braced phrase (the format pool's slots)
        ("hotpot_qa", "<A>{you're chosen}</A>", None),  # ... or a small model's variation of the placeholder
        ("hotpot_qa", "<A>Ridley Scott</A>", "Ridley Scott"),
        ("hotpot_qa", "<A>answer</A>", "answer"),  # a word that might be an answer is one
        ("cbt", "<A>{your answer}</A>", None),
        ("arc", "<A>{letter}) {option text}</A>", None),
        ("arc", "<A>letter) option text</A>", None),
        ("arc", "<A>{letter}</A>", None),
        ("arc", "<A>{letter} {option text}</A>", None),  # a variation the demo's SmolLM2 wrote: braced slots only
        ("arc", "<A>{letter}: {option text}.</A>", None),
        ("arc", "<A>{letter}) adding heat</A>", "{letter}) adding heat"),  # words beside a slot: an answer
        ("arc", "<A>B) adding heat</A>", "B) adding heat"),
        ("gsm8k", "so \\boxed{{number}}", None),
        ("gsm8k", "so \\boxed{number}", None),
        ("gsm8k", "so \\boxed{70}", "70"),
        ("math", "\\boxed{{your answer}}", None),
        ("math", "\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # braces of a real answer stay
    ],
)
def test_an_answer_equal_to_a_placeholder_is_no_answer(task, text, expected):
    assert get_task(task).parse_answer(text) == expected


@pytest.mark.parametrize(
    ("task", "text"),
    [
        ("hotpot_qa", "<A>[your answer]</A>"),  # the slot in square brackets
        ("arc", "<A>[your answer]</A>"),
        ("hotpot_qa", "<A><your answer></A>"),  # ... in angle brackets
        ("arc", "<A>X) option text</A>"),  # the slot written plainly, with a placeholder letter
        ("arc", "<A>A) option text</A>"),  # ... or a real letter: the option text is still the slot
        ("arc", "<A>{letter}) {option text}</A>"),  # the format line's placeholder itself
        ("arc", '<A>"pick": "{letter}"</A>'),  # the debate pool's JSON example
        ("gsm8k", "so \\boxed{[number]}"),
        ("gsm8k", "so \\boxed{{answer}}"),
        ("math", "\\boxed{{answer}}"),
        ("math", "\\boxed{<your answer>}"),
        ("hotpot_qa", "<A>born={year}</A>"),  # a copied format-pool example: the value is the slot
        ("hotpot_qa", "<A>FN={full name}</A>"),
    ],
)
def test_placeholder_variants_are_no_answer(task, text):
    """One skeleton rule (slots and punctuation only, or a slot where a value goes) catches each variant."""
    assert get_task(task).parse_answer(text) is None
    assert get_task(task).copies_placeholder(text)


@pytest.mark.parametrize(
    ("task", "text", "expected"),
    [
        ("arc", "<A>B) a letter to a friend</A>", "B) a letter to a friend"),  # a slot word inside an option
        ("arc", "<A>A)</A>", "A)"),  # a label alone names an option
        ("math", "\\boxed{\\frac{ab}{cd}}", "\\frac{ab}{cd}"),  # LaTeX groups are no slots
        ("math", "\\boxed{[a, b]}", "[a,b]"),  # nor is an interval
        ("hotpot_qa", "<A>x < y > z</A>", "x < y > z"),
        ("hotpot_qa", "<A>year=1937</A>", "year=1937"),
    ],
)
def test_answers_that_look_like_slots_stay_answers(task, text, expected):
    assert get_task(task).parse_answer(text) == expected
    assert not get_task(task).copies_placeholder(text)
