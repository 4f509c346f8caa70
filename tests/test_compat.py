"""``compat: original``: each switch of docs/method.md#where-we-differ-from-the-original, and nothing else.

The score switches (F1, multiple choice, numbers) are tested with the scorers (tests/test_scoring.py); here: the
list-repr information and the MATH prompt of training rows, the tree search's stop rule and turn cap, and the
promise the ``compat`` help makes.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from optima.agents.prompts import (
    DEFAULT_STYLE,
    GSM8K_SOLVER_PROMPT,
    MATH_SOLVER_PROMPT,
    Utterance,
    build_agent_messages,
    build_system_prompt,
    compat_style,
)
from optima.config import DPORecipe, SFTRecipe, load_recipe
from optima.selection.dpo import candidate_pairs
from optima.selection.mcts import SearchTree
from optima.selection.sft import conversation_rows, split_rows
from optima.selection.tree import Reply, SearchSettings
from optima.tasks import Example
from tests.helpers import arc_examples
from tests.test_prompts import QA_EXAMPLE

REPO = Path(__file__).resolve().parent.parent
MATH = Example(id="m1", task="math", question="Solve x^2 = 9/16, x > 0.", answer="\\frac{3}{4}", score_type="math")
ARC = arc_examples(1)[0]


def record(example: Example, *texts: str) -> dict:
    speakers = ("Alice", "Bob")
    utterances = [{"speaker": speakers[i % 2], "text": text} for i, text in enumerate(texts)]
    return {"example": example.to_dict(), "utterances": utterances}


class Script:
    """A scripted ``generate`` (ok replies of 5 tokens) that records the views it was given."""

    def __init__(self, replies):
        self.replies, self.calls = list(replies), []

    def __call__(self, messages, speaker):
        self.calls.append(messages)
        return Reply(self.replies.pop(0), 5)


def tree_for(example: Example, compat: str, max_turns: int = 10) -> SearchTree:
    settings = SearchSettings(selections=1, rollouts=1, max_turns=max_turns, compat=compat)
    return SearchTree(example, settings, random.Random(0))


# ---------------------------------------------------------------- rendering (D11, D12)


def test_default_rendering_is_untouched_by_compat_default():
    assert compat_style("default", "hotpot_qa") is DEFAULT_STYLE
    assert compat_style("default", "math", sft_rows=True) is DEFAULT_STYLE
    plain = build_agent_messages(QA_EXAMPLE, "Alice", [])
    assert build_agent_messages(QA_EXAMPLE, "Alice", [], style=compat_style("default", "hotpot_qa")) == plain
    assert "France: Paris is the capital of France.\nSeine: A river." in plain[1]["content"]
    assert "['" not in plain[1]["content"]


def test_original_renders_private_information_as_the_list_repr():
    messages = build_agent_messages(QA_EXAMPLE, "Bob", [], style=compat_style("original", "hotpot_qa"))
    assert "['Louvre: A museum in Paris.']" in messages[1]["content"]
    assert messages[0] == build_agent_messages(QA_EXAMPLE, "Bob", [])[0]  # the system prompt is the same


def test_original_trains_math_rows_under_the_gsm8k_solver_prompt():
    conversation = record(MATH, "x = 3/4. \\boxed{\\frac{3}{4}}", "Correct.", "\\boxed{\\frac{3}{4}}")
    default = {row["speaker"]: row["messages"] for row in conversation_rows(conversation)}
    original = {row["speaker"]: row["messages"] for row in conversation_rows(conversation, "original")}
    assert default["Alice"][0]["content"] == MATH_SOLVER_PROMPT.render("Alice", "Bob")
    assert original["Alice"][0]["content"] == GSM8K_SOLVER_PROMPT.render("Alice", "Bob")
    assert original["Bob"][0] == default["Bob"][0]  # the critic is the same either way
    assert original["Alice"][2:] == default["Alice"][2:]  # only the prompts differ, not the utterances
    # Generation and the tree search keep the MATH prompt: the original generated with it.
    assert compat_style("original", "math").prompt_set is None
    assert build_system_prompt("math", "Alice") == MATH_SOLVER_PROMPT.render("Alice", "Bob")


def test_split_rows_passes_compat_to_every_row():
    kept = [record(QA_EXAMPLE, "Paris is the capital.", "Agreed. <A>Paris</A>")] * 4
    for compat, expected in (("default", False), ("original", True)):
        splits = split_rows(kept, 0.5, 42, 0, compat)
        rows = splits["train"] + splits["test"]
        assert rows and all(("['" in row["messages"][1]["content"]) is expected for row in rows)


def test_original_dpo_pairs_render_the_list_repr():
    nodes = [
        {"id": 0, "parent": None, "depth": 0, "speaker": None, "text": None, "value": 0.5, "minable": True},
        {"id": 1, "parent": 0, "depth": 1, "speaker": "Alice", "text": "<A>Paris</A>", "value": 0.9},
        {"id": 2, "parent": 0, "depth": 1, "speaker": "Alice", "text": "no idea", "value": 0.1},
    ]
    line = {"example": QA_EXAMPLE.to_dict(), "nodes": nodes}
    recipe = SimpleNamespace(initial_dpo_epsilon=0.4, initial_dpo_min_value=0.2, compat="default")
    (default,) = candidate_pairs(line, recipe)
    (original,) = candidate_pairs(line, SimpleNamespace(**vars(recipe) | {"compat": "original"}))
    assert "['France" not in default["prompt"][1]["content"]
    assert "['France: Paris is the capital of France.', 'Seine: A river.']" in original["prompt"][1]["content"]
    assert (original["chosen"], original["rejected"]) == (default["chosen"], default["rejected"])


# ---------------------------------------------------------------- tree search (D25, D26, D11)


@pytest.mark.parametrize(("compat", "final"), [("default", "C"), ("original", "")])
def test_a_rollout_at_max_turns_keeps_its_answer_unless_original(compat, final):
    seen = []
    tree = tree_for(ARC, compat, max_turns=3)
    script = Script(["<A>B</A>", "Check step 2.", "<A>C</A>"])
    record_ = tree.run_rollout(tree.root, script, lambda rollout: seen.append(rollout) or 0.0)
    assert record_["stop_reason"] == "max_turns" and len(record_["utterances"]) == 3
    assert seen[0].final_answer == record_["final_answer"] == final


def test_a_rollout_that_stops_keeps_its_answer_in_both_modes():
    for compat in ("default", "original"):
        tree = tree_for(ARC, compat)
        record_ = tree.run_rollout(tree.root, Script(["<A>B</A>", "Looks right.", "<A>B</A>"]), lambda r: 1.0)
        assert (record_["stop_reason"], record_["final_answer"]) == ("same_answer", "B")


@pytest.mark.parametrize(("compat", "length"), [("default", 3), ("original", 5)])
def test_the_stop_rule_sees_the_whole_path_unless_original(compat, length):
    tree = tree_for(ARC, compat)
    answer = tree.attach(tree.root, Utterance("Alice", "<A>B</A>"), 3)
    critique = tree.attach(answer, Utterance("Bob", "Step 2 is fine."), 3)
    # Alice restates B: the same answer twice in a row counting the path; the original only knew Bob's utterance.
    script = Script(["<A>B</A>", "Agreed.", "<A>B</A>", "never used"])
    record_ = tree.run_rollout(critique, script, lambda r: 1.0)
    assert record_["stop_reason"] == "same_answer" and len(record_["utterances"]) == length


def test_original_tree_search_requests_render_the_list_repr():
    for compat, expected in (("default", False), ("original", True)):
        script = Script(["<A>Paris</A>", "<A>Paris</A>"])
        tree = tree_for(QA_EXAMPLE, compat)
        tree.run_rollout(tree.root, script, lambda r: 1.0)
        assert [("['" in call[1]["content"]) for call in script.calls] == [expected, expected]


def test_search_settings_read_compat_from_the_recipe():
    recipe = load_recipe(DPORecipe, REPO / "train/dpo_recipes/arc.yaml", {"compat": "original"}, check_paths=False)
    assert SearchSettings.from_recipe(recipe).compat == "original"


# ---------------------------------------------------------------- the promise


def test_the_compat_help_lists_exactly_what_it_switches():
    help_text = next(f for f in SFTRecipe.__dataclass_fields__.values() if f.name == "compat").metadata["help"]
    for switch in (
        "F1",
        "multiple choice",
        "gsm8k",
        "list repr",
        "MATH",
        "max_turns",
        "stop rule",
        "cut at max_tokens",
    ):
        assert switch in help_text, switch
    method = (REPO / "docs/method.md").read_text()
    table = method[method.index("**`compat: original` switches exactly these**") :]
    table = table[: table.index("\n\n", table.index("|"))]
    assert len([line for line in table.splitlines() if line.startswith("| ") and "default" not in line]) == 8
