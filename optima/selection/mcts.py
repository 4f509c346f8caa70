"""The MCTS-inspired tree search for DPO pairs: one tree of utterances per question (docs/method.md#tree-search).

Pure tree logic: the model call and the reward are injected callables and randomness is the caller's seeded
`random.Random`, so many questions can be searched at once (one `search_question` call, one tree, one RNG each).
Each of `selections` rounds selects a node (the diversity filter, top-k, softmax of the values), plays `rollouts`
conversations from it to their end with generation's rules, merges each new utterance into a near-identical child,
scores the rollout and backpropagates its reward. `compat: original` restores the original's stop rule (only the
selected node's own answer counts, D26) and scores a rollout that reaches `max_turns` without an answer (D25).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from rapidfuzz.distance import Levenshtein

from optima.agents.conversation import is_cut_reply, reply_tokens
from optima.agents.prompts import (
    AGENT_NAMES,
    Utterance,
    build_agent_messages,
    compat_style,
    render_utterance,
    strip_speaker_prefix,
)
from optima.reward import RewardParts
from optima.selection.tree import Generate, Reply, Rollout, Score, SearchResult, SearchSettings, TreeNode
from optima.tasks import Example, Task, get_task
from optima.tasks.answers import AnswerTracker

if TYPE_CHECKING:
    from optima.config import DPOLoopRecipe

logger = logging.getLogger(__name__)

# A request that failed for good (the client has retried transient errors already) is sent again this many times
# before its rollout is given up and left out of the tree.
ERROR_RETRIES = 2


def levenshtein(a: str, b: str) -> int:
    """Edit distance over characters (unit-cost insert, delete, substitute; rapidfuzz's bit-parallel C++)."""
    return Levenshtein.distance(a, b)


def selection_distance(a: str, b: str) -> float:
    """`ed(a, b) / (max(len a, len b) + 1)`: how different two node contents are (the diversity filter)."""
    return levenshtein(a, b) / (max(len(a), len(b)) + 1)


def merge_distance(existing: str, reply: str) -> float:
    """`ed(existing, reply) / (len(reply) + 1)`: how far a new reply is from an existing child (the merge rule)."""
    return levenshtein(existing, reply) / (len(reply) + 1)


class SearchTree:
    """The tree of one question and the three MCTS steps on it (`rng`: this question's, for selection only)."""

    def __init__(self, example: Example, settings: SearchSettings, rng: random.Random, task: Task | None = None):
        self.example = example
        self.settings = settings
        self.rng = rng
        self.task = task or get_task(example.task)
        self.root = TreeNode(0, None, None, 0)
        self.nodes: list[TreeNode] = [self.root]  # every node, in creation order
        self.pool: list[TreeNode] = [self.root]  # nodes that may still be candidates
        self.selected: list[TreeNode] = []
        self.selections: list[int] = []
        self.rollouts: list[dict] = []

    def candidates(self) -> list[TreeNode]:
        """The root (while pooled) and every pooled node whose first child has children."""
        return [n for n in self.pool if n is self.root or (n.children and n.children[0].children)]

    def near_selected(self, node: TreeNode) -> bool:
        """Whether `node` is within the diversity threshold of a node selected before (itself included)."""
        threshold = self.settings.diversity_threshold
        return any(selection_distance(node.content, chosen.content) < threshold for chosen in self.selected)

    def select(self) -> TreeNode:
        """The node to expand next: near-duplicates of selected nodes leave the pool for good, then one of the
        `top_k` best values is drawn by softmax; the root when no candidate is left."""
        candidates = []
        for node in self.candidates():
            if self.near_selected(node):
                self.pool.remove(node)  # never a candidate again
            else:
                candidates.append(node)
        if candidates:
            ranked = sorted(candidates, key=lambda n: -n.value)[: self.settings.top_k]
            best = ranked[0].value
            weights = [math.exp(n.value - best) for n in ranked]  # softmax(value), shifted for stability
            chosen = self.rng.choices(ranked, weights=weights)[0]
        else:
            chosen = self.root
        if chosen not in self.selected:
            self.selected.append(chosen)
        self.selections.append(chosen.node_id)
        return chosen

    def attach(self, node: TreeNode, utterance: Utterance, tokens: int) -> TreeNode:
        """The child of `node` for a new utterance: an existing one within `merge_threshold`, or a new one."""
        text = render_utterance(utterance)
        for child in node.children:
            if merge_distance(child.content, text) < self.settings.merge_threshold:
                return child
        child = TreeNode(len(self.nodes), utterance, node, node.depth + 1, tokens)
        node.children.append(child)
        self.nodes.append(child)
        self.pool.append(child)
        return child

    @staticmethod
    def backpropagate(node: TreeNode | None, reward: float) -> None:
        """One visit with `reward` for `node` and every ancestor (a running mean value)."""
        while node is not None:
            node.visits += 1
            node.value += (reward - node.value) / node.visits
            node = node.parent

    def run_rollout(self, start: TreeNode, generate: Generate, score: Score) -> dict:
        """Talk from `start` to the end of the conversation, grow the tree, score, backpropagate; return its record.

        A rollout whose request still fails after `ERROR_RETRIES` is left out (a server error is no evidence about
        the utterances): not scored, its new nodes removed, nothing backpropagated; its record keeps `error`.
        """
        path = start.path()
        utterances = [n.utterance for n in path]
        tokens = [n.tokens for n in path]
        original = self.settings.compat == "original"
        style = compat_style(self.settings.compat, self.task)
        tracker = AnswerTracker()
        # Answers already stated on the path count for the stop rule; compat mode knows only the last one (D26).
        for utterance in utterances[-1:] if original else utterances:
            tracker.update(self.task.parse_answer(utterance.text))
        node, status, stop_reason, cut_tokens, failed, error = start, "ok", "max_turns", 0, 0, None
        first_new = len(self.nodes)
        while len(utterances) < self.settings.max_turns:
            speaker = AGENT_NAMES[node.next_speaker]
            messages = build_agent_messages(self.example, speaker, utterances, task=self.task, style=style)
            reply, failures = request_with_retries(generate, messages, speaker)
            failed += failures
            if reply.status != "ok":
                status = stop_reason = reply.status
                cut_tokens = reply.tokens if reply.status == "too_long" else 0
                error = reply.error
                break
            utterance = Utterance(speaker, strip_speaker_prefix(reply.text, speaker).strip())
            node = self.attach(node, utterance, reply.tokens)
            utterances.append(utterance)
            tokens.append(reply.tokens)
            if tracker.update(self.task.parse_answer(utterance.text)):
                stop_reason = "same_answer"
                break
        final_answer = tracker.final_answer
        if original and stop_reason == "max_turns":
            final_answer = ""  # compat mode scores it with no answer: task score 0 (D25)
        rollout = Rollout(tuple(utterances), tuple(tokens), final_answer, status, stop_reason, cut_tokens)
        outcome = None
        if status == "error":
            node = self.drop_nodes_from(first_new, node)
        else:
            outcome = score(rollout)
            self.backpropagate(node, reward_of(outcome))
        record = rollout.to_dict() | {
            "selection": len(self.selections) - 1,
            "start_node": start.node_id,
            "end_node": node.node_id,
            "reward": None if outcome is None else reward_of(outcome),
            "reward_parts": outcome.to_dict() if isinstance(outcome, RewardParts) else None,
            "failed_requests": failed,
        }
        self.rollouts.append(record | ({"error": error} if error else {}))
        return self.rollouts[-1]

    def drop_nodes_from(self, first: int, node: TreeNode) -> TreeNode:
        """Remove the nodes created since `len(self.nodes)` was `first` (a failed rollout's); return the deepest
        ancestor of `node` that stays."""
        for new in reversed(self.nodes[first:]):
            new.parent.children.remove(new)
            self.pool.remove(new)
        del self.nodes[first:]
        while node.node_id >= first:
            node = node.parent
        return node

    def minable(self) -> list[TreeNode]:
        """The nodes pair mining may use: still pooled, or selected."""
        keep = {id(n) for n in self.pool} | {id(n) for n in self.selected}
        return [n for n in self.nodes if id(n) in keep]

    def result(self) -> SearchResult:
        """The tree as plain dicts (with a `minable` flag per node) and the rollout records."""
        minable = {n.node_id for n in self.minable()}
        nodes = [n.to_dict() | {"minable": n.node_id in minable} for n in self.nodes]
        return SearchResult(self.example, nodes, list(self.rollouts), list(self.selections))


def reward_of(outcome: float | RewardParts) -> float:
    """The reward of a `score` outcome (a float, or `RewardParts`)."""
    return outcome.reward if isinstance(outcome, RewardParts) else float(outcome)


def request_with_retries(generate: Generate, messages: list[dict], speaker: str) -> tuple[Reply, int]:
    """`generate`'s reply, a failed one sent again up to `ERROR_RETRIES` times; and the number of failures."""
    failures = 0
    while True:
        reply = generate(messages, speaker)
        if reply.status != "error":
            return reply, failures
        failures += 1
        if failures > ERROR_RETRIES:
            return reply, failures


def search_question(
    example: Example,
    generate: Generate,
    score: Score,
    recipe: SearchSettings | DPOLoopRecipe,
    rng: random.Random,
    task: Task | None = None,
) -> SearchResult:
    """The tree search of one question: `selections` x (select, `rollouts` rollouts); thread-safe when `generate`
    (`(messages, speaker) -> Reply`) and `score` (`Rollout -> float | RewardParts`) are.

    Args:
        recipe: A DPO / SFT-DPO recipe, or its `SearchSettings`.
    """
    settings = recipe if isinstance(recipe, SearchSettings) else SearchSettings.from_recipe(recipe)
    tree = SearchTree(example, settings, rng, task)
    for _ in range(settings.selections):
        node = tree.select()
        for _ in range(settings.rollouts):
            tree.run_rollout(node, generate, score)
    logger.debug(
        "mcts | %s | %d nodes | %d rollouts | root value %.3f", example.id, len(tree.nodes), len(tree.rollouts),
        tree.root.value,
    )  # fmt: skip
    return tree.result()


def reply_from_chat(
    chat_generate: Callable,
    max_tokens: int,
    failures: tuple[type[BaseException], ...] = (),
    count_tokens: Callable[[str, str], int] | None = None,
) -> Generate:
    """A generation-style `(messages, speaker) -> ChatReply` as the search's `Generate`: a reply cut at `max_tokens`
    is `too_long`, an exception of `failures` (`RequestFailed`) an `error`; tokens counted as generation does."""

    def generate(messages: list[dict], speaker: str) -> Reply:
        try:
            chat = chat_generate(messages, speaker)
        except failures as exc:
            return Reply("", 0, "error", str(exc))
        tokens = reply_tokens(chat, speaker, count_tokens)  # generation's token rule
        if is_cut_reply(chat, tokens, max_tokens):
            return Reply(chat.text, tokens, "too_long")
        return Reply(chat.text, tokens)

    return generate
