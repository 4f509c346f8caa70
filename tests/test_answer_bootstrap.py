"""The answer bootstrap (docs/method.md#answer-bootstrap): the answering turns' constraint, its requests, its records.

The patterns are checked with Python's `re` (what xgrammar reads of them is checked against the real vLLM server in
tests/test_smollm2_generation.py); the requests against a scripted server.
"""

from __future__ import annotations

import logging
import re

import pytest

from optima.agents.conversation import GenerationSettings
from optima.agents.generation import generate_conversations, generation_settings
from optima.config import RecipeError
from optima.serving.client import PROBE_REPLY, ConstraintRejected
from optima.store import load_records
from optima.tasks import Example, get_task
from optima.tasks.base import escape, reply_pattern
from tests.fake_openai import FakeOpenAIServer, FakeReply, speaker_of, turn_of
from tests.helpers import arc_examples

ARC = arc_examples(1)[0]  # options A) 3, B) 4, C) 5
GSM8K = Example(id="g0", task="gsm8k", question="2 + 2?", answer="4", score_type="number")
MATH = Example(id="m0", task="math", question="Half of 1?", answer="\\frac{1}{2}", score_type="math")
HOTPOT = Example(
    id="h0",
    task="hotpot_qa",
    question="Where do the Niles meet?",
    answer="Khartoum",
    score_type="f1",
    context_first=("The Blue Nile rises at Lake Tana.",),
    context_second=("The Niles meet at Khartoum.",),
)


def matches(example: Example, reply: str) -> bool:
    return re.fullmatch(reply_pattern(get_task(example.task), example, "Alice"), reply) is not None


@pytest.mark.parametrize(
    ("example", "reply", "ok"),
    [
        (ARC, "Alice: <A>B) 4</A> because 2 + 2 = 4.", True),  # one of the question's options, then free text
        (ARC, "<A>C) 5</A>\nAdding one more.\n\nTwice.", True),  # ... on more lines too
        (ARC, "<A>C) 5</A>" + " word" * 30, True),  # ... thirty words at most
        (ARC, "<A>C) 5</A>" + " word" * 31, False),
        (ARC, "<A>C) 5</A> " + "x" * 33, False),
        (ARC, "<A>B) 4</A> because 2 + 2 = 4. Bob: I agree", False),  # no turn of another speaker after it
        (ARC, "<A>B) 4</A> because 2 + 2 = 4.\nAlice: and so", False),  # ... nor a second turn of its own
        (ARC, "Bob: <A>B) 4</A>", False),  # the name prefix is the speaker's own
        (ARC, "C: <A>B) 4</A>", False),
        (ARC, "I think <A>B) 4</A>", False),  # the prompt asks for the answer first, as the pre-fill put it
        (ARC, "<A>{letter}) {option text}</A>", False),  # the placeholder
        (ARC, "<A>X) option text</A>", False),
        (ARC, "<A>D) 6</A>", False),  # not an option of this question
        (ARC, "<A>B</A>", False),  # a label alone: the prompt asks for the label and the text
        (ARC, "The answer is B.", False),  # no answer in the tag
        (ARC, "<A>A) 3</A> or <A>B) 4</A>", False),  # one answer tag only
        (HOTPOT, "Alice:<A>Khartoum</A> where the Niles meet", True),
        (HOTPOT, "<A>{your answer}</A>", False),
        (HOTPOT, "<A>[your answer]</A>", False),
        (HOTPOT, "<A><your answer></A>", False),
        (HOTPOT, "<A></A>", False),
        (HOTPOT, "<A> </A>", False),
        (HOTPOT, "<A>Khar\ntoum</A>", False),
        (HOTPOT, "<A>the city where the Blue Nile meets the White Nile</A>", True),  # ten words at most
        (HOTPOT, "<A>the city where the Blue Nile meets the White Nile river</A>", False),
        (GSM8K, "2 + 2 = 4, so \\boxed{4}", True),
        (GSM8K, "2 + 2\n= 4\n\\boxed{-1.5}", True),  # lines of reasoning, then the box
        (GSM8K, "2+2=4:\\boxed{4}", True),
        (GSM8K, "w " * 80 + "w\\boxed{4}", True),  # eighty words of reasoning at most (and one on the box)
        (GSM8K, "w " * 81 + "\\boxed{4}", False),
        (GSM8K, "1440." * 6 + "\\boxed{4}", True),  # a word of 30 characters
        (GSM8K, "1440." * 7 + "\\boxed{4}", False),  # one word never goes on instead of the box
        (GSM8K, "1440 " + " " * 5 + "\\boxed{4}", False),  # nor the space between words
        (GSM8K, "\\boxed{{number}}", False),
        (GSM8K, "\\boxed{4} and more", False),  # the prompts ask to end with the box
        (GSM8K, "\\boxed{3} so \\boxed{4}", False),  # one box
        (MATH, "Half: \\frac{1}{2}, so \\boxed{\\frac{1}{2}}", True),  # LaTeX in the reasoning and the box
        (MATH, "\\boxed{}", False),
    ],
)
def test_the_reply_pattern_admits_free_text_around_one_well_formed_answer(example, reply, ok):
    assert matches(example, reply) is ok


def test_options_are_matched_literally_whatever_their_characters():
    options = (("A", "x^2 + 1 (approx.) [1]"), ("B", "$5 | 10*2?"), ("C", "a\\b {c}"))
    example = Example(id="s", task="arc", question="?", answer="A", score_type="choice", options=options)
    for label, text in options:
        assert matches(example, f"<A>{label}) {text}</A>")
    assert not matches(example, "<A>A) x^2 + 1 (approx.) 1</A>")
    assert escape("a.b-c d#e") == "a\\.b-c d#e"  # only regex specials: xgrammar need not read `\-`, `\ `, `\#`


def test_a_choice_question_without_options_is_an_error():
    example = Example(id="q9", task="arc", question="?", answer="A", score_type="choice")
    with pytest.raises(ValueError, match="q9.*without options"):
        reply_pattern(get_task("arc"), example, "Alice")


def constrained_reply(body: dict) -> FakeReply:
    """Alice answers B inside the constraint; the probe gets what it asks for; Bob (never constrained) agrees."""
    regex = (body.get("structured_outputs") or {}).get("regex")
    if regex == PROBE_REPLY:
        return FakeReply(PROBE_REPLY)
    if speaker_of(body) == "Alice":
        reply = "Alice: <A>B) 4</A> since 2 + 2 = 4"
        assert regex is not None and re.fullmatch(regex, reply), "Alice's turn is constrained and the reply fits"
        return FakeReply(reply)
    return FakeReply("Bob: right")


def constraints_sent(server: FakeOpenAIServer) -> list[tuple[str, int, str | None]]:
    """(speaker, turn, regex) of each conversation turn's request (the probe and prefix-cache prefills aside)."""
    bodies = [b for b in server.bodies() if (b.get("structured_outputs") or {}).get("regex") != PROBE_REPLY]
    bodies = [b for b in bodies if b["max_tokens"] > 1]
    return [(speaker_of(b), turn_of(b), (b.get("structured_outputs") or {}).get("regex")) for b in bodies]


def test_grammar_constrains_the_answering_turns_and_records_them(make_recipe, tmp_path):
    recipe = make_recipe(max_tokens=256)
    out = tmp_path / "gen.jsonl"
    with FakeOpenAIServer(constrained_reply) as server:
        generation = GenerationSettings(0, 0.3, 1, answer_bootstrap="grammar")
        stats = generate_conversations(recipe, [ARC], [server.base_url], out, generation)
        probe = server.bodies()[0]
        sent = constraints_sent(server)
        bodies = server.bodies()
    assert probe["structured_outputs"] == {"regex": PROBE_REPLY} and probe["max_tokens"] == 16  # checked first
    pattern = reply_pattern(get_task("arc"), ARC, "Alice")
    assert sent == [("Alice", 0, pattern), ("Bob", 1, None), ("Alice", 2, pattern)]  # the solver only, every turn
    assert not any("continue_final_message" in body for body in bodies)  # nothing is pre-filled
    (record,), _ = load_records(out)
    assert stats.statuses == {"ok": 1} and record["final_answer"] == "B) 4"
    assert record["answer_bootstrap"] == "grammar" and record["constrained_turns"] == [0, 2]


def test_information_exchange_is_constrained_from_the_third_turn_for_both_agents(make_recipe, tmp_path):
    def respond(body: dict) -> FakeReply:
        regex = (body.get("structured_outputs") or {}).get("regex")
        if regex == PROBE_REPLY or body["max_tokens"] == 1:  # the probe, and Bob's prefix-cache prefill
            return FakeReply(PROBE_REPLY)
        return FakeReply("<A>Khartoum</A>" if regex else f"{speaker_of(body)}: a fact")

    out = tmp_path / "gen.jsonl"
    with FakeOpenAIServer(respond) as server:
        generation = GenerationSettings(0, 0.3, 1, answer_bootstrap="grammar")
        generate_conversations(make_recipe(max_tokens=256), [HOTPOT], [server.base_url], out, generation)
        sent = constraints_sent(server)
    patterns = {name: reply_pattern(get_task("hotpot_qa"), HOTPOT, name) for name in ("Alice", "Bob")}
    assert patterns["Bob"].startswith("(Bob: ?)?<A>")  # each agent's own name prefix
    assert sent == [("Alice", 0, None), ("Bob", 1, None), ("Alice", 2, patterns["Alice"]), ("Bob", 3, patterns["Bob"])]
    (record,), _ = load_records(out)
    assert record["constrained_turns"] == [2, 3] and record["final_answer"] == "Khartoum"


@pytest.mark.parametrize("mode", ["prefill", "off"])
def test_other_bootstraps_send_no_constraint(make_recipe, fake_server, tmp_path, mode):
    out = tmp_path / "gen.jsonl"
    generation = GenerationSettings(0, 0.3, 1, answer_bootstrap=mode)
    generate_conversations(make_recipe(max_tokens=256), [ARC], [fake_server.base_url], out, generation)
    assert not any("structured_outputs" in body for body in fake_server.bodies())
    assert any("continue_final_message" in body for body in fake_server.bodies()) is (mode == "prefill")
    (record,), _ = load_records(out)
    assert record["constrained_turns"] == [] and record["answer_bootstrap"] == mode


@pytest.mark.parametrize(
    ("reply", "said"),
    [(FakeReply(status=400), "rejected the answer constraint"), (FakeReply("sure: ok"), "ignored the answer")],
)
def test_a_server_without_the_constraint_stops_the_run_naming_the_endpoint(make_recipe, tmp_path, reply, said):
    out = tmp_path / "gen.jsonl"
    with FakeOpenAIServer(lambda body: reply) as server:
        generation = GenerationSettings(0, 0.3, 1, answer_bootstrap="grammar")
        with pytest.raises(ConstraintRejected, match=rf"{re.escape(server.base_url)} {said}.*answer_bootstrap"):
            generate_conversations(make_recipe(max_tokens=256), [ARC], [server.base_url], out, generation)
        assert len(server.bodies()) == 1  # the probe only: no conversation ran
    assert load_records(out)[0] == []


def test_the_bootstrap_runs_in_the_first_iterations_only(make_recipe):
    recipe = make_recipe(answer_bootstrap="grammar", answer_bootstrap_iterations=2)
    assert [generation_settings(recipe, i).answer_bootstrap for i in range(3)] == ["grammar", "grammar", "off"]
    assert generation_settings(make_recipe(), 0).answer_bootstrap == "off"  # off unless asked for


def test_the_legacy_prefill_switch_reads_as_the_bootstrap(make_recipe, caplog):
    with caplog.at_level(logging.WARNING):
        assert make_recipe(prefill_answer_iteration0=True).answer_bootstrap == "prefill"
        assert make_recipe(prefill_answer_iteration0=0).answer_bootstrap == "off"
    assert "prefill_answer_iteration0=True is a legacy switch; read as answer_bootstrap='prefill'" in caplog.text
    with pytest.raises(RecipeError, match="keep 'answer_bootstrap'"):
        make_recipe(prefill_answer_iteration0=True, answer_bootstrap="grammar")
    with pytest.raises(RecipeError, match="prefill_answer_iteration0"):
        make_recipe(prefill_answer_iteration0="yes")
    with pytest.raises(RecipeError, match="answer_bootstrap"):
        make_recipe(answer_bootstrap="regex")
