"""Tree search: edit distance, token quantile, selection, expansion, backpropagation, rollout reward.

See docs/method.md#tree-search.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from optima.agents.prompts import Utterance, build_agent_messages, build_system_prompt
from optima.config import DPORecipe, load_recipe
from optima.reward import Conversation, build_rollout_scorer, first_impersonation, score_rollout_parts, token_quantile
from optima.selection.dpo import candidate_pairs
from optima.selection.mcts import (
    ERROR_RETRIES,
    SearchTree,
    levenshtein,
    merge_distance,
    reply_from_chat,
    search_question,
    selection_distance,
)
from optima.selection.tree import Reply, Rollout, SearchSettings
from tests.helpers import arc_examples

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = arc_examples(1)[0]  # debate task: Alice solves, Bob critiques; the answer is B


class Script:
    """A scripted ``generate``: replies in order (str -> ok reply of 5 tokens), every call recorded."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.calls: list[tuple[list[dict], str]] = []

    def __call__(self, messages, speaker):
        self.calls.append((messages, speaker))
        reply = self.replies.pop(0)
        return reply if isinstance(reply, Reply) else Reply(reply, 5)


def rewards(*values):
    """A ``score`` returning ``values`` in order."""
    queue = list(values)
    return lambda rollout: queue.pop(0)


def settings(**overrides) -> SearchSettings:
    return SearchSettings(**({"selections": 1, "rollouts": 1, "max_turns": 10} | overrides))


def new_tree(**overrides) -> SearchTree:
    return SearchTree(EXAMPLE, settings(**overrides), random.Random(0))


def chain(tree: SearchTree, parent, *texts):
    """Attach one utterance per text under ``parent`` (speakers alternate by depth); return the nodes."""
    nodes = []
    for text in texts:
        speaker = ("Alice", "Bob")[parent.next_speaker]
        parent = tree.attach(parent, Utterance(speaker, text), 3)
        nodes.append(parent)
    return nodes


# ---------------------------------------------------------------- edit distance and token quantile


def _dp_levenshtein(a: str, b: str) -> int:
    """The textbook dynamic programme: the reference distance."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb))
        previous = current
    return previous[-1]


def test_levenshtein_matches_the_textbook_dynamic_programme():
    rng = random.Random(3)
    for _ in range(500):
        a = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 30)))
        b = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 90)))
        assert levenshtein(a, b) == _dp_levenshtein(a, b) == levenshtein(b, a)
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3


def _bit_parallel_levenshtein(a: str, b: str) -> int:
    """The bit-parallel distance (Myers/Hyyro) ``levenshtein`` computed before ``rapidfuzz``: the reference here."""
    if a == b:
        return 0
    if len(a) < len(b):
        a, b = b, a
    m = len(b)
    if m == 0:
        return len(a)
    peq: dict[str, int] = {}
    for i, char in enumerate(b):
        peq[char] = peq.get(char, 0) | (1 << i)
    full, top = (1 << m) - 1, 1 << (m - 1)
    plus, minus, score = full, 0, m
    for char in a:
        eq = peq.get(char, 0)
        xv = eq | minus
        xh = (((eq & plus) + plus) ^ plus) | eq
        hplus = minus | ~(xh | plus)
        hminus = plus & xh
        if hplus & top:
            score += 1
        elif hminus & top:
            score -= 1
        hplus = (hplus << 1) | 1
        hminus <<= 1
        plus = (hminus | ~(xv | hplus)) & full
        minus = hplus & xv & full
    return score


def test_levenshtein_gives_what_the_bit_parallel_implementation_gave():
    rng = random.Random(5)
    alphabet = "ab cdé漢🙂\n"  # accents, CJK, an emoji (outside the BMP) and a newline: characters, not bytes
    for _ in range(300):
        a = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))
        b = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
        assert levenshtein(a, b) == _bit_parallel_levenshtein(a, b)
    long_a = "".join(rng.choice("abcdefgh ") for _ in range(3000))
    long_b = long_a[500:] + "tail" + long_a[:700]
    assert levenshtein(long_a, long_b) == _bit_parallel_levenshtein(long_a, long_b)


def test_normalised_distances_use_the_originals_denominators():
    assert selection_distance("abcd", "abcf") == pytest.approx(1 / 5)
    assert selection_distance("", "") == 0.0
    assert merge_distance("abcdef", "abc") == pytest.approx(3 / 4)  # divided by the reply's length + 1


@pytest.mark.parametrize(
    ("counts", "q", "expected"),
    [([10], 0.85, 11), ([1, 2, 3, 4, 5], 0.5, 4), ([0, 100], 0.85, 86), ([7, 1, 3], 1.0, 8), ([5, 9], 0.0, 6)],
)
def test_token_quantile_is_int_of_the_linear_quantile_plus_one(counts, q, expected):
    assert token_quantile(counts, q) == expected


def test_token_quantile_matches_numpy_and_rejects_bad_input():
    numpy = pytest.importorskip("numpy")
    counts = [random.Random(1).randint(20, 900) for _ in range(37)]
    assert token_quantile(counts, 0.85) == int(numpy.quantile(counts, 0.85)) + 1
    with pytest.raises(ValueError, match="at least one"):
        token_quantile([], 0.85)
    with pytest.raises(ValueError, match="quantile"):
        token_quantile([1], 1.5)


# ---------------------------------------------------------------- expansion: stop rule, depth, failures, merge


def test_rollout_stops_when_the_same_answer_is_stated_twice_in_a_row():
    tree = new_tree()
    script = Script(["<A>B</A>", "Looks right.", "Alice: <A>B</A>", "never used"])
    record = tree.run_rollout(tree.root, script, rewards(1.0))
    assert [u["text"] for u in record["utterances"]] == ["<A>B</A>", "Looks right.", "<A>B</A>"]
    assert (record["stop_reason"], record["status"], record["final_answer"]) == ("same_answer", "ok", "B")
    assert [speaker for _, speaker in script.calls] == ["Alice", "Bob", "Alice"]
    assert record["token_count"] == 15 and record["end_node"] == 3


def test_rollout_stops_at_the_depth_limit():
    tree = new_tree(max_turns=3)
    script = Script(["thinking", "still", "more", "never used"])
    record = tree.run_rollout(tree.root, script, rewards(0.0))
    assert len(record["utterances"]) == 3 and record["stop_reason"] == "max_turns"
    assert len(script.calls) == 3 and len(tree.nodes) == 4


def test_a_cut_reply_ends_the_rollout_without_a_node():
    tree = new_tree()
    seen = []
    script = Script(["<A>C</A>", Reply("x" * 50, 2000, "too_long")])
    record = tree.run_rollout(tree.root, script, lambda rollout: seen.append(rollout) or -1.0)
    assert (record["status"], record["stop_reason"], len(record["utterances"])) == ("too_long", "too_long", 1)
    assert seen[0].status == "too_long" and seen[0].final_answer == "C"
    # One token rule: the cut reply's tokens count although the reply is not added to the tree.
    assert record["token_count"] == seen[0].tokens[0] + 2000
    assert record["cut_replies"] == 1 and record["failed_requests"] == 0
    assert len(tree.nodes) == 2 and tree.nodes[1].visits == 1 and tree.root.value == -1.0


FAILED = Reply("", 0, "error", "HTTP 400")


def test_a_failed_request_is_sent_again_and_the_rollout_goes_on():
    tree = new_tree()
    script = Script(["<A>B</A>", FAILED, FAILED, "Looks right.", "<A>B</A>"])
    record = tree.run_rollout(tree.root, script, rewards(1.0))
    assert (record["status"], record["failed_requests"], len(record["utterances"])) == ("ok", 2, 3)
    assert [speaker for _, speaker in script.calls] == ["Alice", "Bob", "Bob", "Bob", "Alice"]
    assert script.calls[1][0] == script.calls[2][0] == script.calls[3][0]  # the same request sent again
    assert tree.root.visits == 1 and tree.root.value == 1.0


def test_a_rollout_whose_request_fails_for_good_is_left_out_of_the_tree():
    tree = new_tree(rollouts=2)
    tree.run_rollout(tree.root, Script(["<A>B</A>", "Agreed.", "<A>B</A>"]), rewards(0.5))
    seen = []
    script = Script(["Surely it is option C: <A>C</A>", "Why C?", *[FAILED] * (ERROR_RETRIES + 1)])
    record = tree.run_rollout(tree.root, script, lambda rollout: seen.append(rollout) or -1.0)
    assert not seen  # never scored: a server error says nothing about the utterances
    assert (record["status"], record["reward"], record["reward_parts"]) == ("error", None, None)
    assert record["failed_requests"] == ERROR_RETRIES + 1 and record["error"] == "HTTP 400"
    assert len(record["utterances"]) == 2 and record["end_node"] == 0
    # Its two new nodes are gone; the first rollout's value is untouched.
    assert [n.node_id for n in tree.nodes] == [0, 1, 2, 3] and len(tree.root.children) == 1
    assert (tree.root.visits, tree.root.value) == (1, 0.5) and tree.nodes[1].visits == 1
    assert tree.result().rollouts[-1] == record and len(tree.pool) == 4


def test_near_identical_replies_merge_and_different_ones_branch():
    tree = new_tree(max_turns=2)
    tree.run_rollout(tree.root, Script(["I pick <A>B</A> because ice melts.", "<A>B</A>"]), rewards(1.0))
    # Same text after the model's own name prefix is stripped, then a one-character typo (< 0.1 of the length).
    tree.run_rollout(tree.root, Script(["Alice: I pick <A>B</A> because ice melts.", "fine"]), rewards(0.0))
    tree.run_rollout(tree.root, Script(["I pick <A>B</A> because ice melt.", "ok"]), rewards(0.5))
    tree.run_rollout(tree.root, Script(["Totally different: <A>C</A>", "ok"]), rewards(0.0))
    first, second = tree.root.children
    assert first.utterance.text == "I pick <A>B</A> because ice melts." and first.visits == 3
    assert second.utterance.text == "Totally different: <A>C</A>"
    assert [c.utterance.text for c in first.children] == ["<A>B</A>", "fine", "ok"]  # far apart: three children


def test_the_rollout_keeps_the_text_it_generated_after_a_merge():
    tree = new_tree()
    tree.run_rollout(tree.root, Script(["I pick <A>B</A> because ice melts.", "<A>B</A>"]), rewards(1.0))
    record = tree.run_rollout(tree.root, Script(["I pick <A>B</A> because ice melt.", "<A>B</A>"]), rewards(1.0))
    assert record["utterances"][0]["text"] == "I pick <A>B</A> because ice melt."
    assert tree.nodes[1].utterance.text == "I pick <A>B</A> because ice melts."


def test_answers_already_on_the_path_count_for_the_stop_rule():
    tree = new_tree()
    _, critique = chain(tree, tree.root, "<A>B</A>", "Step 2 is fine.")
    record = tree.run_rollout(critique, Script(["<A>B</A>"]), rewards(1.0))
    assert record["stop_reason"] == "same_answer" and len(record["utterances"]) == 3
    assert record["start_node"] == critique.node_id


# ---------------------------------------------------------------- backpropagation


def test_backpropagation_keeps_running_means_and_visit_counts_up_to_the_root():
    tree = new_tree()
    tree.run_rollout(tree.root, Script(["<A>B</A>", "<A>B</A>"]), rewards(1.0))
    tree.run_rollout(tree.root, Script(["Maybe C, so <A>C</A>", "Yes <A>C</A>"]), rewards(0.0))
    tree.run_rollout(tree.root, Script(["<A>B</A>", "<A>B</A>"]), rewards(0.5))
    b, c = tree.root.children
    assert (tree.root.visits, tree.root.value) == (3, pytest.approx(0.5))
    assert (b.visits, b.value, c.visits, c.value) == (2, pytest.approx(0.75), 1, 0.0)
    assert (b.children[0].visits, b.children[0].value) == (2, pytest.approx(0.75))


def test_stale_best_and_worst_regression():
    """The original compared min/max pointers only when a child was updated, so a best child whose value later
    fell stayed "best". Pairs must come from the children's current values (docs/method.md D14)."""
    tree = new_tree()
    a, b = (chain(tree, tree.root, text)[0] for text in ("I pick <A>A</A>", "I pick <A>B</A> for sure"))
    tree.backpropagate(a, 1.0)  # a is best
    tree.backpropagate(b, 0.5)
    tree.backpropagate(a, -1.0)  # a falls below b: the original's pointers now say max = min = a
    tree.backpropagate(a, -1.0)
    assert a.value == pytest.approx(-1 / 3)
    assert sorted(tree.root.children, key=lambda child: -child.value) == [b, a]
    recipe = SimpleNamespace(initial_dpo_epsilon=0.4, initial_dpo_min_value=0.2, compat="default")
    (pair,) = candidate_pairs(tree.result().to_dict(), recipe)
    assert pair["chosen"][0]["content"] == "Alice: I pick <A>B</A> for sure"
    assert pair["rejected"][0]["content"] == "Alice: I pick <A>A</A>"
    assert (pair["chosen_value"], pair["rejected_value"]) == (0.5, pytest.approx(-1 / 3))


# ---------------------------------------------------------------- selection


def test_selection_skips_selected_nodes_and_their_near_duplicates_then_falls_back_to_the_root():
    tree = new_tree(top_k=1)
    a, _, _ = chain(tree, tree.root, "first idea is good <A>B</A>", "check", "<A>B</A>")
    near, _, _ = chain(tree, tree.root, "first idea is fine <A>B</A>", "check", "<A>B</A>")
    assert 0.1 <= merge_distance(a.content, near.content) and selection_distance(a.content, near.content) < 0.25
    a.value, near.value = 1.0, 0.9
    assert tree.select() is a  # top-1 by value
    assert tree.select() is tree.root  # a (selected) and its near-duplicate leave the pool; the root is left
    assert a not in tree.pool and near not in tree.pool
    assert tree.select() is tree.root  # no candidate at all: fallback
    assert tree.selections == [a.node_id, 0, 0]
    minable = {n["id"]: n["minable"] for n in tree.result().nodes}
    assert minable[a.node_id] and minable[0] and not minable[near.node_id]


def test_only_the_root_and_nodes_whose_first_child_has_children_are_candidates():
    tree = new_tree()
    a, b, _ = chain(tree, tree.root, "x <A>B</A>", "y", "z")
    leafy = chain(tree, tree.root, "w")[0]
    assert tree.candidates() == [tree.root, a]
    assert b not in tree.candidates() and leafy not in tree.candidates()


def test_selection_samples_softmax_of_values_among_the_top_k():
    tree = new_tree(top_k=2)
    low, _, _ = chain(tree, tree.root, "low <A>A</A>", "q", "r")
    high, _, _ = chain(tree, tree.root, "high road <A>B</A>", "q", "r")
    low.value, high.value, tree.root.value = 0.0, 1.0, -5.0  # the root falls outside the top 2
    picks = []
    for seed in range(2000):
        tree.rng, tree.selected, tree.pool = random.Random(seed), [], [tree.root, low, high]
        picks.append(tree.select())
    assert tree.root not in picks
    assert picks.count(high) / len(picks) == pytest.approx(math.e / (1 + math.e), abs=0.03)


def test_after_selecting_a_bob_to_speak_node_bob_speaks_with_his_own_view():
    tree = new_tree(top_k=1)
    alice, _, _ = chain(tree, tree.root, "<A>B</A> since heat melts ice", "Correct.", "<A>B</A>")
    alice.value, tree.root.value = 1.0, 0.0
    selected = tree.select()
    assert selected is alice and selected.next_speaker == 1
    script = Script(["Step 1 is right.", "<A>B</A>"])
    record = tree.run_rollout(selected, script, rewards(1.0))
    messages, speaker = script.calls[0]
    assert speaker == "Bob"
    assert messages == build_agent_messages(EXAMPLE, "Bob", [alice.utterance])
    assert messages[0]["content"] == build_system_prompt("arc", "Bob") != build_system_prompt("arc", "Alice")
    assert [u["speaker"] for u in record["utterances"]] == ["Alice", "Bob", "Alice"]


# ---------------------------------------------------------------- the whole search


class RandomScript:
    """A seeded random generator: short replies, sometimes with an answer."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def __call__(self, messages, speaker):
        answer = self.rng.choice(["", "", "<A>A</A>", "<A>B</A>"])
        return Reply(f"{speaker} idea {self.rng.randint(0, 3)} {answer}", self.rng.randint(5, 30))


def test_search_question_is_deterministic_for_a_seed_and_json_ready():
    def run(seed):
        score = lambda rollout: 1.0 if rollout.final_answer == "B" else 0.0  # noqa: E731
        return search_question(
            EXAMPLE, RandomScript(7), score, settings(selections=5, rollouts=3), random.Random(seed)
        )

    first, again = run(11).to_dict(), run(11).to_dict()
    assert first == again
    reloaded = json.loads(json.dumps(first))
    assert (reloaded["nodes"], reloaded["rollouts"]) == (first["nodes"], first["rollouts"])
    assert len(first["rollouts"]) == 15 and len(first["selections"]) == 5 and first["selections"][0] == 0
    root = first["nodes"][0]
    assert root["visits"] == 15 and root["parent"] is None and root["next_speaker"] == "Alice"
    assert root["value"] == pytest.approx(sum(r["reward"] for r in first["rollouts"]) / 15)
    assert all(len(r["utterances"]) <= 10 for r in first["rollouts"])


def test_questions_searched_in_threads_match_a_sequential_run():
    from concurrent.futures import ThreadPoolExecutor

    examples = arc_examples(4)

    def run(index):
        score = lambda rollout: float(rollout.final_answer == "B") - 0.01 * rollout.token_count  # noqa: E731
        rng = random.Random(f"42:mcts:0:{examples[index].id}")
        return search_question(examples[index], RandomScript(index), score, settings(selections=4, rollouts=2), rng)

    sequential = [run(i).to_dict() for i in range(4)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        threaded = [result.to_dict() for result in pool.map(run, range(4))]
    assert threaded == sequential


def test_search_question_reads_its_settings_from_a_recipe():
    recipe = load_recipe(DPORecipe, REPO / "train/dpo_recipes/arc.yaml", {"explore_count": 2}, check_paths=False)
    assert SearchSettings.from_recipe(recipe) == SearchSettings(2, 3, 10, 0.25, 0.1, 10)
    result = search_question(EXAMPLE, RandomScript(0), lambda r: 0.0, recipe, random.Random(0))
    assert len(result.rollouts) == 6


def test_reply_from_chat_adapts_generation_replies_and_failures():
    class Failed(Exception):
        pass

    def chat(messages, speaker):
        text = messages[-1]["content"]
        if text == "fail":
            raise Failed("HTTP 400")
        if text == "boom":
            raise RuntimeError("no replica left")
        finish = "length" if text == "cut" else "stop"
        tokens = None if text == "nousage" else (64 if text == "long" else 7)
        return SimpleNamespace(text="Alice: hi", finish_reason=finish, completion_tokens=tokens)

    generate = reply_from_chat(chat, max_tokens=64, failures=(Failed,), count_tokens=lambda text, s: len(text))
    ask = lambda text: generate([{"role": "user", "content": text}], "Alice")  # noqa: E731
    assert ask("hello") == Reply("Alice: hi", 7)
    assert ask("nousage") == Reply("Alice: hi", 9)
    assert ask("cut").status == ask("long").status == "too_long"
    assert ask("fail") == Reply("", 0, "error", "HTTP 400")
    with pytest.raises(RuntimeError, match="no replica"):
        ask("boom")


# ---------------------------------------------------------------- rollout reward (format rule)


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(DPORecipe, REPO / "train/dpo_recipes/arc.yaml", check_paths=False)  # lambda1 -.4, lambda2 .7


def rollout_of(*texts, tokens=20):
    speakers = ("Alice", "Bob")
    utterances = tuple(Utterance(speakers[i % 2], text) for i, text in enumerate(texts))
    return Rollout(utterances, (tokens,) * len(texts), "B", "ok", "same_answer")


def test_the_rollout_scorer_applies_the_format_rule(recipe):
    scored_texts = []

    def score_texts(texts):
        scored_texts.extend(texts)
        return [0.5] * len(texts)

    score = build_rollout_scorer(EXAMPLE, recipe, t_max=100, score_texts=score_texts)
    clean = score(rollout_of("<A>B</A>", "Right.", "So <A>B</A>"))
    assert clean.to_dict() == pytest.approx(
        {"task_score": 1.0, "token_term": -0.4 * 60 / 100, "loss_term": 0.7 / 0.5, "penalty": 0.0, "reward": 2.16}
    )
    scored_texts.clear()
    bad = score(rollout_of("<A>B</A>", "Bob: fine. Alice: <A>B</A>", "<A>B</A>"))
    assert scored_texts == ["Alice: <A>B</A>"]  # the loss only covers the utterances before the impersonation
    assert (bad.task_score, bad.penalty, bad.loss_term) == (0.0, 0.0, pytest.approx(1.4))


def test_format_rule_edge_cases(recipe):
    utterances = [Utterance("Alice", "Alice: twice Alice: here"), Utterance("Bob", "ok")]
    assert first_impersonation(utterances) == 0
    assert first_impersonation(utterances[1:]) is None
    parts = score_rollout_parts(Conversation(utterances, 60, 1.0, "ok", []), 100, recipe)
    assert parts.task_score == 0.0 and parts.loss_term == recipe.overlong_penalty  # nothing left to read
    failed = score_rollout_parts(Conversation(utterances[1:], 60, 1.0, "too_long", [0.5]), 100, recipe)
    assert failed.token_term == failed.loss_term == recipe.overlong_penalty
    with pytest.raises(ValueError, match="score_texts"):
        build_rollout_scorer(EXAMPLE, recipe, t_max=100)
