"""Per-agent loss masks: the trained tokens of a row are exactly the agent's own utterances + end-of-turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from optima.agents.prompts import Utterance, build_agent_messages
from optima.lm_loss import MaskError
from optima.tasks import Example
from optima.training.masking import IGNORE_INDEX, decode_trained, tokenize_with_mask
from tests._task_fixtures import LLAMA3_CHAT_TEMPLATE

transformers = pytest.importorskip("transformers")
SMOLLM2 = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(), reason="run `make setup` first")

EXAMPLE = Example(
    id="q1",
    task="hotpot_qa",
    question="Who wrote Hamlet?",
    answer="Shakespeare",
    score_type="f1",
    context_first=("Hamlet is a play.",),
    context_second=("Shakespeare wrote plays.",),
)
CONVERSATION = [
    Utterance("Alice", "I know: Hamlet = play. Author?"),
    Utterance("Bob", "Shakespeare wrote plays. <A>Shakespeare</A>"),
    Utterance("Alice", "<A>Shakespeare</A>"),
    Utterance("Bob", "agreed <A>Shakespeare</A>"),
]


@pytest.fixture(scope="module")
def chatml():
    return transformers.AutoTokenizer.from_pretrained(SMOLLM2)


@pytest.fixture(scope="module")
def llama3():
    """SmolLM2's vocabulary with Llama-3's special tokens and chat template."""
    tok = transformers.AutoTokenizer.from_pretrained(SMOLLM2)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tok.eos_token = "<|eot_id|>"
    tok.chat_template = LLAMA3_CHAT_TEMPLATE
    return tok


@pytest.mark.parametrize("template", ["chatml", "llama3"])
@pytest.mark.parametrize("speaker", ["Alice", "Bob"])
def test_trained_tokens_are_the_agents_own_utterances(template, speaker, request):
    tokenizer = request.getfixturevalue(template)
    messages = build_agent_messages(EXAMPLE, speaker, CONVERSATION)
    row = tokenize_with_mask(tokenizer, messages)
    own = [f"{u.speaker}: {u.text}{tokenizer.eos_token}" for u in CONVERSATION if u.speaker == speaker]
    assert decode_trained(tokenizer, row) == own
    # The system prompt, the task with the private information and the partner's turns are never trained.
    trained_text = "".join(decode_trained(tokenizer, row))
    assert "Hamlet is a play" not in trained_text and "Rules" not in trained_text


def test_truncation_keeps_the_start(chatml):
    messages = build_agent_messages(EXAMPLE, "Alice", CONVERSATION)
    full = tokenize_with_mask(chatml, messages)
    short = tokenize_with_mask(chatml, messages, max_length=50)
    assert short["input_ids"] == full["input_ids"][:50] and len(short["labels"]) == 50


def test_a_view_without_own_turns_trains_nothing(chatml):
    messages = build_agent_messages(EXAMPLE, "Alice", [Utterance("Bob", "hello")])
    assert set(tokenize_with_mask(chatml, messages)["labels"]) == {IGNORE_INDEX}


def test_templates_that_do_not_render_in_order_are_rejected(chatml):
    tok = transformers.AutoTokenizer.from_pretrained(SMOLLM2)
    # A template that prints the messages newest first: a conversation prefix is not a text prefix.
    tok.chat_template = "{% for m in messages|reverse %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
    with pytest.raises(MaskError, match="does not render message"):
        tokenize_with_mask(tok, build_agent_messages(EXAMPLE, "Alice", CONVERSATION))
