"""DPO pairs from search trees: the pair rule, keeping the best, the agent's view, split, save.

See docs/method.md#mining-pairs.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from optima.agents.prompts import Utterance, build_agent_messages, build_system_prompt
from optima.selection.dpo import (
    META_COLUMNS,
    OUTSIDE_KEEP_FRACTION,
    PAIR_KEPT,
    best_and_worst,
    candidate_pairs,
    keep_best_pairs,
    passes_pair_rule,
    save_pairs,
    split_pairs,
)
from tests.helpers import arc_examples

EXAMPLES = arc_examples(12)
RECIPE = SimpleNamespace(
    initial_dpo_epsilon=0.4,
    initial_dpo_min_value=0.2,
    dpo_keep_fraction=0.5,
    dpo_train_fraction=0.75,
    seed=42,
    compat="default",
)
SPEAKERS = ("Alice", "Bob")


def tree_line(example, spec, unminable=()):
    """A search-result line from ``{node_id: (parent_id, text, value)}`` (the root, id 0, is implicit)."""
    nodes = [{"id": 0, "parent": None, "depth": 0, "speaker": None, "text": None, "value": 0.0, "minable": True}]
    depth = {0: 0}
    for node_id, (parent, text, value) in sorted(spec.items()):
        depth[node_id] = depth[parent] + 1
        nodes.append(
            {
                "id": node_id,
                "parent": parent,
                "depth": depth[node_id],
                "speaker": SPEAKERS[(depth[node_id] - 1) % 2],
                "text": text,
                "value": value,
                "minable": node_id not in unminable,
            }
        )
    return {"task_id": example.id, "example": example.to_dict(), "nodes": nodes, "rollouts": [], "selections": [0]}


def fan(example, values, parent_text="I pick <A>B</A>"):
    """Root -> one Alice node -> Bob children with ``values`` (a branch at depth 1) plus a root branch."""
    spec = {1: (0, parent_text, 0.9), 2: (0, "I pick <A>C</A> wrongly", 0.0)}
    for offset, value in enumerate(values):
        spec[3 + offset] = (1, f"critique number {offset}", value)
    return tree_line(example, spec)


@pytest.mark.parametrize(
    ("best", "worst", "passes"),
    [(0.9, 0.1, True), (0.4, 0.0, False), (0.41, 0.2, True), (0.41, 0.21, False), (1.0, 0.8, False)],
)
def test_pair_rule_thresholds_are_strict(best, worst, passes):
    assert passes_pair_rule(best, worst, RECIPE) is passes


@pytest.mark.parametrize(("children", "pairs"), [(0, 0), (1, 0), (2, 1), (3, 1)])
def test_only_nodes_with_two_or_more_children_give_pairs(children, pairs):
    values = [1.0, 0.0, 0.5][:children]
    line = tree_line(
        EXAMPLES[0], {1: (0, "only child <A>B</A>", 0.5)} | {2 + i: (1, f"c{i}", v) for i, v in enumerate(values)}
    )
    assert len(candidate_pairs(line, RECIPE)) == pairs


def test_best_and_worst_come_from_current_values_and_ties_keep_the_older_child():
    kids = [{"id": 3, "value": 0.5}, {"id": 4, "value": 0.9}, {"id": 5, "value": 0.1}, {"id": 6, "value": 0.9}]
    best, worst = best_and_worst(kids)
    assert (best["id"], worst["id"]) == (4, 5)
    best, worst = best_and_worst([{"id": 1, "value": 0.3}, {"id": 2, "value": 0.3}])
    assert (best["id"], worst["id"]) == (1, 2)  # two distinct nodes even when all values tie
    with pytest.raises(ValueError, match="two children"):
        best_and_worst(kids[:1])


def test_a_pair_is_the_speaking_agents_view_up_to_the_branch():
    line = fan(EXAMPLES[0], [0.8, 0.1, 0.5])
    bob_pair, alice_pair = sorted(candidate_pairs(line, RECIPE), key=lambda p: -p["depth"])
    path = [Utterance("Alice", "I pick <A>B</A>")]
    assert bob_pair["prompt"] == build_agent_messages(EXAMPLES[0], "Bob", path)
    assert bob_pair["prompt"][0] == {"role": "system", "content": build_system_prompt("arc", "Bob")}
    assert bob_pair["prompt"][-1]["role"] == "user" and "Alice: I pick <A>B</A>" in bob_pair["prompt"][-1]["content"]
    assert bob_pair["chosen"] == [{"role": "assistant", "content": "Bob: critique number 0"}]
    assert bob_pair["rejected"] == [{"role": "assistant", "content": "Bob: critique number 1"}]
    assert [bob_pair[key] for key in ("task_id", "node_id", "depth", "speaker")] == ["q0", 1, 1, "Bob"]
    assert (bob_pair["chosen_value"], bob_pair["rejected_value"]) == (0.8, 0.1)
    assert alice_pair["prompt"] == build_agent_messages(EXAMPLES[0], "Alice", [])  # the root: Alice's first turn
    assert alice_pair["chosen"][0]["content"] == "Alice: I pick <A>B</A>" and alice_pair["speaker"] == "Alice"


def test_deeper_prompts_put_own_turns_as_assistant_and_the_partners_as_user():
    spec = {
        1: (0, "x <A>B</A>", 0.5),
        2: (1, "check it", 0.5),
        3: (2, "good <A>B</A>", 0.9),
        4: (2, "bad <A>D</A>", 0.0),
    }
    (pair,) = candidate_pairs(tree_line(EXAMPLES[0], spec), RECIPE)
    assert [m["role"] for m in pair["prompt"]] == ["system", "user", "assistant", "user"]
    assert pair["prompt"][-1]["content"] == "Bob: check it" and pair["speaker"] == "Alice"


def test_nodes_dropped_by_the_diversity_filter_are_not_mined():
    spec = {1: (0, "x", 0.5), 2: (1, "good", 0.9), 3: (1, "bad", 0.0)}
    assert len(candidate_pairs(tree_line(EXAMPLES[0], spec), RECIPE)) == 1
    assert candidate_pairs(tree_line(EXAMPLES[0], spec, unminable={1}), RECIPE) == []


@pytest.mark.parametrize(("found", "kept"), [(0, 0), (1, 1), (2, 1), (3, 1), (4, 2), (5, 2)])
def test_keep_the_best_half_and_at_least_one(found, kept):
    pairs = [{"chosen_value": v} for v in (0.5, 0.9, 0.7, 0.6, 0.8)[:found]]
    result = keep_best_pairs(pairs, 0.5)
    assert len(result) == kept
    assert [p["chosen_value"] for p in result] == sorted((p["chosen_value"] for p in pairs), reverse=True)[:kept]


def test_a_question_keeps_its_best_pairs_by_chosen_value():
    found = candidate_pairs(fan(EXAMPLES[0], [0.8, 0.1]), RECIPE)  # two pairs found: root (0.9) and node 1 (0.8)
    (kept,) = keep_best_pairs(found, RECIPE.dpo_keep_fraction)
    assert kept["node_id"] == 0 and kept["chosen_value"] == 0.9


def _groups(count):
    return [[{"task_id": f"q{i}", "n": j} for j in range(1 + i % 3)] for i in range(count)]


def test_split_is_seeded_by_question_and_keeps_a_questions_pairs_together():
    groups = _groups(8)
    first = split_pairs(groups, 0.75, seed=1, iteration=0)
    assert first == split_pairs(groups, 0.75, seed=1, iteration=0)
    assert first != split_pairs(groups, 0.75, seed=1, iteration=1)  # a new shuffle per iteration
    test_questions = {p["task_id"] for p in first["test"]}
    assert len(test_questions) == 2 and not test_questions & {p["task_id"] for p in first["train"]}
    assert len(first["train"]) + len(first["test"]) == sum(map(len, groups))
    everything = split_pairs(groups + [[]], 1.0, seed=1, iteration=0)
    assert everything["test"] == [] and len(everything["train"]) == sum(map(len, groups))
    assert len({p["task_id"] for p in split_pairs(_groups(4), 0.9, 1, 0)["test"]}) == 1  # at least one question


def test_save_and_load_round_trip(tmp_path):
    from datasets import load_from_disk

    lines = [fan(example, [0.8, 0.1]) for example in EXAMPLES[:8]]
    lines.append(tree_line(EXAMPLES[8], {1: (0, "alone", 0.2)}))  # no pair
    summary = save_pairs(lines, RECIPE, tmp_path / "dpo", tmp_path / "pairs.jsonl", iteration=0)
    counts = {"questions": 9, "questions_with_pairs": 8, "pairs_found": 16, "pairs_kept": 8}
    assert summary == counts | {"rows": {"train": 6, "test": 2}}
    data = load_from_disk(str(tmp_path / "dpo"))
    train = data["train"]
    assert train.column_names == ["prompt", "chosen", "rejected", *META_COLUMNS]
    row = train[0]
    assert row["prompt"][0]["role"] == "system" and row["chosen"][0]["role"] == "assistant"
    line = lines[int(row["task_id"][1:])]
    assert row == next(p for p in keep_best_pairs(candidate_pairs(line, RECIPE), RECIPE.dpo_keep_fraction))
    records = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in records] == [f"q{i}" for i in range(9)]
    assert [p["kept"] for p in records[0]["pairs"]] == [True, False] and records[8]["pairs"] == []
    assert [p["reason"] for p in records[0]["pairs"]] == [PAIR_KEPT, OUTSIDE_KEEP_FRACTION]
    assert records[0]["branching_nodes"] == 2


def test_nothing_kept_writes_the_record_but_no_dataset(tmp_path):
    line = tree_line(EXAMPLES[0], {1: (0, "a", 0.3), 2: (0, "b", 0.0)})  # best 0.3 is not above epsilon 0.4
    summary = save_pairs([line], RECIPE, tmp_path / "dpo", tmp_path / "pairs.jsonl", iteration=0)
    assert summary["pairs_kept"] == 0 and summary["rows"] == {}
    assert not (tmp_path / "dpo").exists() and (tmp_path / "pairs.jsonl").exists()


def test_the_order_the_search_finished_the_questions_in_changes_nothing():
    groups = _groups(8)
    assert split_pairs(groups[::-1], 0.75, seed=1, iteration=0) == split_pairs(groups, 0.75, seed=1, iteration=0)
