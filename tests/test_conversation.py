"""The turn loop with a scripted ``generate``: stop rule, turn cap, statuses, prefixes, token accounting."""

from __future__ import annotations

import pytest

from optima.agents.conversation import AgentPrompts, TurnLimits, build_agent_prompts, run_conversation
from optima.agents.prompts import build_system_prompt
from optima.serving.client import ChatReply, RequestFailed
from optima.tasks import Example

ARC = Example(id="q", task="arc", question="2 + 2?", answer="B", score_type="choice", options=(("A", "3"), ("B", "4")))
GSM = Example(id="g", task="gsm8k", question="2 + 2?", answer="4", score_type="number")
HOTPOT = Example("h", "hotpot_qa", "Where do the Niles meet?", "Khartoum", "f1", ("Lake Tana.",), ("Khartoum.",))
LIMITS = TurnLimits(max_turns=6, max_tokens=20)


def prompts(example: Example) -> tuple[str, str]:
    return build_system_prompt(example.task, "Alice"), build_system_prompt(example.task, "Bob")


class Scripted:
    """``generate`` that plays replies in order and records what each agent saw."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.seen: list[tuple[str, list[dict]]] = []

    def __call__(self, messages: list[dict], speaker: str) -> ChatReply:
        self.seen.append((speaker, messages))
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        if isinstance(reply, str):
            return ChatReply(reply, "stop", len(reply.split()), replica=0)
        return reply


def run(example: Example, generate, limits: TurnLimits = LIMITS, count_tokens=None, **agents):
    return run_conversation(example, AgentPrompts(prompts(example), **agents), generate, limits, count_tokens)


def test_same_answer_twice_stops_skipping_answerless_turns():
    generate = Scripted("Alice: 4 <A>B</A>", "Bob: correct", "Alice: so <A>B</A>", "never sent")
    result = run(ARC, generate)
    assert (result.status, result.stop_reason, result.final_answer) == ("ok", "same_answer", "B")
    assert [u.speaker for u in result.utterances] == ["Alice", "Bob", "Alice"]
    assert [u.text for u in result.utterances] == ["4 <A>B</A>", "correct", "so <A>B</A>"]  # prefixes stripped
    assert result.tokens == [3, 2, 3] and result.token_count == 8
    assert result.agent_tokens() == {"Alice": 6, "Bob": 2}


def test_a_changed_answer_does_not_stop():
    generate = Scripted("<A>A</A>", "Bob: wrong", "<A>B</A>", "Bob: ok", "<A>B</A>")
    result = run(ARC, generate)
    assert len(result.utterances) == 5 and result.final_answer == "B" and result.stop_reason == "same_answer"


def test_turn_cap_without_answers():
    result = run(GSM, Scripted(*["thinking"] * 4), TurnLimits(max_turns=4, max_tokens=20))
    assert (result.status, result.stop_reason, result.final_answer) == ("ok", "max_turns", "")
    assert len(result.utterances) == 4


def test_boxed_answers_for_math_tasks():
    result = run(GSM, Scripted("Alice: \\boxed{4}", "Bob: fine", "Alice: \\boxed{4}"))
    assert result.final_answer == "4" and result.stop_reason == "same_answer"


@pytest.mark.parametrize(
    "overlong", [ChatReply("cut", "length", 20, 0), ChatReply("all twenty", "stop", 20, 0)], ids=["length", "tokens"]
)
def test_overlong_utterance_ends_as_too_long_without_a_fake_utterance(overlong):
    result = run(ARC, Scripted("Alice: <A>A</A>", overlong))
    assert (result.status, result.stop_reason, result.final_answer) == ("too_long", "too_long", "A")
    assert [u.text for u in result.utterances] == ["<A>A</A>"]
    # One token rule: the cut reply's 20 tokens count (they were generated), in the total and for its agent.
    assert result.token_count == 22 and result.cut_replies == 1
    assert result.agent_tokens() == {"Alice": 2, "Bob": 20}


def test_a_finished_conversation_has_no_cut_reply():
    result = run(ARC, Scripted("Alice: <A>A</A>", "Bob: <A>A</A>"))
    assert result.status == "ok" and result.cut_replies == 0 and result.token_count == sum(result.tokens)


def test_failed_request_ends_as_error_without_a_fake_utterance():
    result = run(ARC, Scripted("Alice: hmm", RequestFailed("replica 0: 400 prompt too long")))
    assert (result.status, result.stop_reason) == ("error", "error")
    assert "prompt too long" in result.error
    assert [u.text for u in result.utterances] == ["hmm"]


def test_first_request_failing_records_nothing():
    result = run(ARC, Scripted(RequestFailed("down")))
    assert result.status == "error" and result.utterances == [] and result.token_count == 0


def test_each_agent_sees_its_own_view():
    generate = Scripted("Alice: 4 <A>B</A>", "Bob: correct", "Alice: <A>B</A>")
    run(ARC, generate)
    (first, alice_view), (second, bob_view), (_, alice_again) = generate.seen
    assert (first, second) == ("Alice", "Bob")
    assert alice_view[0]["content"] == prompts(ARC)[0] and bob_view[0]["content"] == prompts(ARC)[1]
    assert [m["role"] for m in alice_view] == ["system", "user"]
    assert "Alice: 4 <A>B</A>" in bob_view[-1]["content"] and bob_view[-1]["role"] == "user"
    assert alice_again[-2] == {"role": "assistant", "content": "Alice: 4 <A>B</A>"}


def test_token_counter_fills_in_missing_usage():
    generate = Scripted(ChatReply("Alice: <A>B</A>", "stop", None, 0), ChatReply("Bob: ok", "stop", None, 1))
    seen = []

    def count(text: str, speaker: str) -> int:
        seen.append(speaker)
        return 7

    result = run(ARC, generate, TurnLimits(max_turns=2, max_tokens=20), count_tokens=count)
    assert result.tokens == [7, 7] and seen == ["Alice", "Bob"] and result.replica == 1


def test_answer_openings_are_prefilled_and_kept():
    """Format bootstrapping: Alice's replies continue a pre-filled "<A>"; Bob (critic) is not pre-filled."""
    generate = Scripted("B) 4</A> since 2+2=4", "Bob: right", "B) 4</A>")
    result = run(ARC, generate, openings=("<A>", ""))
    assert [u.text for u in result.utterances] == ["<A>B) 4</A> since 2+2=4", "right", "<A>B) 4</A>"]
    assert result.final_answer == "B) 4" and result.stop_reason == "same_answer"
    (_, alice_messages), (_, bob_messages) = generate.seen[0], generate.seen[1]
    assert alice_messages[-1] == {"role": "assistant", "content": "<A>"}
    assert bob_messages[-1]["role"] == "user"


def test_information_exchange_prefills_answers_only_after_both_agents_shared():
    """QA pre-fill: turns 0 and 1 exchange information freely; from turn 2 both agents' replies open with <A>."""
    from optima.agents.prompts import AGENT_NAMES, role_prompt

    roles = [role_prompt("hotpot_qa", name) for name in AGENT_NAMES]
    assert [(r.answer_opening, r.answer_from_turn) for r in roles] == [("<A>", 2), ("<A>", 2)]
    generate = Scripted("Alice: Tana feeds the Blue Nile", "Bob: it meets the White Nile at Khartoum",
                        "Khartoum</A>", "Khartoum</A> agreed")  # fmt: skip
    result = run(HOTPOT, generate, openings=("<A>", "<A>"), answer_from_turn=2)
    assert [u.text for u in result.utterances][2:] == ["<A>Khartoum</A>", "<A>Khartoum</A> agreed"]
    assert [messages[-1]["role"] for _, messages in generate.seen] == ["user", "user", "assistant", "assistant"]
    assert result.final_answer == "Khartoum" and result.stop_reason == "same_answer"


def test_a_copied_placeholder_is_no_answer_and_does_not_stop_the_conversation():
    generate = Scripted("Alice: <A>{your answer}</A>", "Bob: <A>{your answer}</A>", "Alice: <A>Khartoum</A>",
                        "Bob: <A>Khartoum</A>")  # fmt: skip
    result = run(HOTPOT, generate)
    assert result.final_answer == "Khartoum" and len(result.utterances) == 4 and result.stop_reason == "same_answer"


def test_information_exchange_replays_each_agents_own_replies_exactly():
    """Own replies come back token for token (prefix cache); the partner, the record and the answer see the text."""
    first = " Alice:Tana feeds the Blue Nile.  \n"
    generate = Scripted(first, "Bob: it meets the White Nile at Khartoum", "Khartoum</A>\n", "Khartoum</A>")
    result = run(HOTPOT, generate, openings=("<A>", "<A>"), answer_from_turn=2, replay_replies=True)
    (_, alice_first), (_, bob_first), (_, alice_second), (_, bob_second) = generate.seen
    assert alice_second[2] == {"role": "assistant", "content": first}  # byte for byte, odd prefix and spaces too
    assert alice_second[:2] == alice_first  # and the earlier prompt is a prefix of the later one
    assert bob_first[-1]["content"].endswith("\n\nAlice: Tana feeds the Blue Nile.")  # the partner: the rendering
    assert bob_second[2] == {"role": "assistant", "content": "Bob: it meets the White Nile at Khartoum"}
    assert bob_second[3]["content"] == "Alice: <A>Khartoum</A>"  # Alice's pre-filled reply, rendered for Bob
    texts = [u.text for u in result.utterances]
    assert texts == ["Tana feeds the Blue Nile.", "it meets the White Nile at Khartoum", "<A>Khartoum</A>",
                     "<A>Khartoum</A>"]  # fmt: skip
    assert result.utterances[2].reply == "<A>Khartoum</A>\n"  # the pre-filled opening is part of the exact reply
    assert result.final_answer == "Khartoum" and result.tokens == [5, 8, 1, 1]


def test_debate_renders_own_replies_from_the_stored_text():
    """Debate (the ARC demo) keeps the rendering its training rows use, whatever the model wrote."""
    generate = Scripted(" Alice:4 <A>B</A>  ", "Bob: correct", "Alice: <A>B</A>")
    result = run(ARC, generate)
    assert generate.seen[2][1][2] == {"role": "assistant", "content": "Alice: 4 <A>B</A>"}
    assert all(u.reply is None for u in result.utterances)


@pytest.mark.parametrize(
    ("task", "replay"), [("hotpot_qa", True), ("trivia_qa", True), ("arc", False), ("gsm8k", False)]
)
def test_agent_prompts_replay_replies_for_information_exchange_only(task, replay):
    from optima.tasks import get_task

    agents = build_agent_prompts(get_task(task), ("a", "b"), prefill_answer=True)
    assert agents.replay_replies is replay and agents.system == ("a", "b")
    assert agents.opening(0) == ("" if replay else "<A>" if task == "arc" else "")
