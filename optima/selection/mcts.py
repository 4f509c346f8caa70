"""MCTS-inspired search for DPO pairs: one tree of utterances per question.

See docs/method.md#tree-search; the paper's iDPO.

Pure tree logic: the model call and the reward are injected callables, randomness is the caller's seeded
``random.Random``, and nothing is shared between questions, so the pipeline may search many questions at once in a
``ThreadPoolExecutor`` (one ``search_question`` call, one tree, one RNG per question).

* **Tree.** A node is one utterance (speaker + text). The root is the empty conversation. ``next_speaker`` is the
  index of the agent who speaks next from a node: 0 at the root, alternating down.
* **Selection** (``SearchTree.select``). Candidates are the root and every node whose first child has children.
  A candidate whose content is within ``selection_distance < diversity_threshold`` of an already selected node is
  skipped and leaves the candidate pool for good (so a node is selected at most once and its near-duplicates are
  neither selected nor mined). Among the ``top_k`` best values one is drawn with ``softmax(value)``; with no
  candidate left the root is taken again.
* **Expansion** (``SearchTree.run_rollout``, ``rollouts`` times per selection). From the selected node the two
  agents talk to the end with generation's rules (``optima.agents.conversation``): each agent sees its own chat
  view (``build_agent_messages`` with the speaker's own base system prompt: docs/method.md D13), the rollout
  stops when the same answer is stated twice in a row (answers on the path count), after ``max_turns`` utterances,
  or on a failed / too long reply (that reply is not added). Each new utterance merges into an existing child when
  ``merge_distance(child, reply) < merge_threshold``, else becomes a new child; the rollout itself keeps the text
  that was actually generated. Token counts follow generation's rule (``optima.agents.conversation.reply_tokens``:
  the server's usage, else the agent's tokenizer).
* **Failed requests.** A request that failed for good is sent again up to ``ERROR_RETRIES`` times; a rollout whose
  request still fails is left out: not scored, its new nodes removed, nothing backpropagated (a server error is no
  evidence about the utterances). Its record keeps status ``error``, ``reward`` None and the ``failed_requests``
  count that the search statistics add up.
* **Backpropagation.** The rollout's reward (``score(rollout)``) updates the running mean value and the visit count
  of every node from the last one reached up to the root. Pair mining (``optima.selection.dpo``) reads the
  children's *current* values, so there are no stale best/worst pointers (docs/method.md D14).

Deliberate differences (docs/method.md D25, D26; ``compat: original`` restores both): a rollout that reaches
``max_turns`` keeps its last stated answer (``stop_reason "max_turns"``), as in generation, instead of
scoring no answer (task score 0); and the stop rule sees every answer stated on the path, not only the answer of
the selected node's own utterance. ``compat: original`` also renders the agents' private information as a Python
list repr (``compat_style``, D11).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

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
from optima.selection.edit_distance import merge_distance, selection_distance
from optima.selection.tree import Generate, Reply, Rollout, Score, SearchResult, SearchSettings, TreeNode
from optima.tasks import Example, Task, get_task
from optima.tasks.scoring import AnswerTracker

if TYPE_CHECKING:
    from optima.config import DPOLoopRecipe

logger = logging.getLogger(__name__)

# A request that failed for good (the client has retried transient errors already) is sent again this many times
# before its rollout is given up and left out of the tree.
ERROR_RETRIES = 2


class SearchTree:
    """The tree of one question and the three MCTS steps on it.

    Args:
        example: The question.
        settings: Search sizes and thresholds.
        rng: This question's seeded RNG (selection sampling only).
        task: The example's task (looked up from ``example.task`` when None).
    """

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
        """The root (while in the pool) and every pooled node whose first child has children."""
        return [n for n in self.pool if n is self.root or (n.children and n.children[0].children)]

    def near_selected(self, node: TreeNode) -> bool:
        """Whether ``node`` is within the diversity threshold of a node selected before (itself included)."""
        threshold = self.settings.diversity_threshold
        return any(selection_distance(node.content, chosen.content) < threshold for chosen in self.selected)

    def select(self) -> TreeNode:
        """Pick the node to expand next (diversity filter, top-k, softmax sampling; root as fallback)."""
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
        """The child of ``node`` for a new utterance: a near-identical existing child, or a new one."""
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
        """Add one visit with ``reward`` to ``node`` and every ancestor (running mean value)."""
        while node is not None:
            node.visits += 1
            node.value += (reward - node.value) / node.visits
            node = node.parent

    def run_rollout(self, start: TreeNode, generate: Generate, score: Score) -> dict:
        """Talk from ``start`` to the end of the conversation, grow the tree, score, backpropagate.

        A failed request is sent again up to ``ERROR_RETRIES`` times; a rollout whose request still fails is left
        out of the tree: it is not scored, its new nodes are removed and no value is backpropagated (its record
        keeps the status ``error`` and ``reward`` None, and every failed request is counted).

        Args:
            start: The selected node.
            generate: Returns the reply of ``speaker`` given that speaker's chat view.
            score: The reward of a finished rollout (a float or ``RewardParts``).
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
        """Remove the nodes created since ``len(self.nodes)`` was ``first`` (a failed rollout's); return the deepest
        ancestor of ``node`` that stays."""
        for new in reversed(self.nodes[first:]):
            new.parent.children.remove(new)
            self.pool.remove(new)
        del self.nodes[first:]
        while node.node_id >= first:
            node = node.parent
        return node

    def minable(self) -> list[TreeNode]:
        """Nodes pair mining may use: still pooled or selected (``pool`` ∪ ``selected``)."""
        keep = {id(n) for n in self.pool} | {id(n) for n in self.selected}
        return [n for n in self.nodes if id(n) in keep]

    def result(self) -> SearchResult:
        """The tree as plain dicts (with a ``minable`` flag per node) plus the rollout records."""
        minable = {n.node_id for n in self.minable()}
        nodes = [n.to_dict() | {"minable": n.node_id in minable} for n in self.nodes]
        return SearchResult(self.example, nodes, list(self.rollouts), list(self.selections))


def reward_of(outcome: float | RewardParts) -> float:
    """The reward of a ``score`` outcome (a float, or ``RewardParts``)."""
    return outcome.reward if isinstance(outcome, RewardParts) else float(outcome)


def request_with_retries(generate: Generate, messages: list[dict], speaker: str) -> tuple[Reply, int]:
    """``generate``'s reply, a failed one (``error``) sent again up to ``ERROR_RETRIES`` times; and the failures."""
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
    """Run the whole tree search of one question: ``selections`` × (select, ``rollouts`` rollouts).

    Thread-safe as long as ``generate`` and ``score`` are: the tree and ``rng`` belong to this call.

    Args:
        example: The question.
        generate: ``(messages, speaker) -> Reply``; ``messages`` is that speaker's chat view.
        score: ``(Rollout) -> float | RewardParts`` (``optima.selection.rollout_reward.build_rollout_scorer``).
        recipe: A DPO / SFT-DPO recipe, or a ``SearchSettings``.
        rng: This question's seeded RNG.
        task: The example's task (looked up from ``example.task`` when None).
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
    """Adapt a generation-style ``(messages, speaker) -> ChatReply`` callable to the search's ``Generate``.

    Args:
        chat_generate: Returns an object with ``text``, ``finish_reason`` and ``completion_tokens`` (``ChatReply``).
        max_tokens: Token cap of one utterance; a reply cut by it is ``too_long``.
        failures: Exception types meaning "this request failed for good" (e.g. ``RequestFailed``); others propagate.
        count_tokens: ``(text, speaker) -> tokens`` when the server sent no usage.
    """

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
