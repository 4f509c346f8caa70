"""The tree search's pieces: a reply and a rollout, the search settings, a node of the tree and one question's result.

Plain values with no search logic: ``optima.selection.mcts`` grows the tree out of them (``SearchTree``,
``search_question``), ``optima.selection.dpo`` mines pairs from the result's JSON line, and the scorer of
``optima.selection.rollout_reward`` reads a ``Rollout``. See docs/method.md#tree-search.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from optima.agents.prompts import AGENT_NAMES, Utterance, render_utterance
from optima.config import ORIGINAL_MCTS_SELECTIONS
from optima.tasks import Example

if TYPE_CHECKING:
    from optima.config import DPOLoopRecipe
    from optima.reward import RewardParts

REPLY_STATUSES = ("ok", "too_long", "error")


@dataclass(frozen=True)
class Reply:
    """What the injected ``generate`` returns for one utterance.

    Args:
        text: The generated content (a leading ``Name:`` is removed by the search).
        tokens: Its generated tokens.
        status: ``ok``, ``too_long`` (hit the token cap) or ``error`` (the request failed for good).
        error: The failure message when ``status == "error"``.
    """

    text: str
    tokens: int
    status: str = "ok"
    error: str | None = None

    def __post_init__(self) -> None:
        if self.status not in REPLY_STATUSES:
            raise ValueError(f"Reply.status must be one of {REPLY_STATUSES}, got {self.status!r}")


@dataclass(frozen=True)
class Rollout:
    """One complete conversation produced by a rollout (what ``score`` receives).

    Args:
        utterances: The whole conversation, the selected node's path included, oldest first.
        tokens: Tokens of each utterance.
        final_answer: Last stated answer ("" if none).
        status: ``ok``, ``too_long`` or ``error``.
        stop_reason: ``same_answer``, ``max_turns``, ``too_long`` or ``error``.
        cut_tokens: Tokens of the reply that hit ``max_tokens`` and was not added (0 when none was cut).
    """

    utterances: tuple[Utterance, ...]
    tokens: tuple[int, ...]
    final_answer: str
    status: str
    stop_reason: str
    cut_tokens: int = 0

    @property
    def token_count(self) -> int:
        """Every generated token of the conversation, a cut reply's included (docs/method.md#token-count)."""
        return sum(self.tokens) + self.cut_tokens

    def to_dict(self) -> dict:
        return {
            "utterances": [{"speaker": u.speaker, "text": u.text} for u in self.utterances],
            "tokens": list(self.tokens),
            "token_count": self.token_count,
            "cut_replies": int(self.status == "too_long"),
            "final_answer": self.final_answer,
            "status": self.status,
            "stop_reason": self.stop_reason,
        }


Generate = Callable[[list[dict], str], Reply]  # (speaker's chat view, speaker) -> Reply
Score = Callable[[Rollout], "float | RewardParts"]


@dataclass(frozen=True)
class SearchSettings:
    """Search sizes and thresholds: recipe fields ``mcts_*``, ``*_threshold``, ``max_turns`` (see docs/method.md)."""

    selections: int = ORIGINAL_MCTS_SELECTIONS
    rollouts: int = 3
    top_k: int = 10
    diversity_threshold: float = 0.25
    merge_threshold: float = 0.1
    max_turns: int = 10
    compat: str = "default"

    @classmethod
    def from_recipe(cls, recipe: DPOLoopRecipe) -> SearchSettings:
        """Read the settings from a validated DPO or SFT-DPO recipe (its ``mcts_selections`` is set)."""
        return cls(
            selections=recipe.mcts_selections,
            rollouts=recipe.mcts_rollouts,
            top_k=recipe.mcts_top_k,
            diversity_threshold=recipe.diversity_threshold,
            merge_threshold=recipe.merge_threshold,
            max_turns=recipe.max_turns,
            compat=recipe.compat,
        )


@dataclass(eq=False)
class TreeNode:
    """One utterance of the tree (the root holds none).

    Args:
        node_id: Creation index (the root is 0).
        utterance: The utterance, None for the root.
        parent: The parent node, None for the root.
        depth: Utterances from the root to this node included.
        tokens: Tokens of the utterance.
    """

    node_id: int
    utterance: Utterance | None
    parent: TreeNode | None
    depth: int
    tokens: int = 0
    children: list[TreeNode] = field(default_factory=list)
    value: float = 0.0
    visits: int = 0

    @property
    def next_speaker(self) -> int:
        """Index of the agent who speaks after this node (``depth % 2``: 0 Alice, 1 Bob)."""
        return self.depth % 2

    @property
    def content(self) -> str:
        """The rendered utterance (``"Alice: text"``) compared by the edit-distance rules; "" for the root."""
        return render_utterance(self.utterance) if self.utterance is not None else ""

    def path(self) -> list[TreeNode]:
        """Nodes from the root's first child down to this node (empty for the root)."""
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def to_dict(self) -> dict:
        return {
            "id": self.node_id,
            "parent": None if self.parent is None else self.parent.node_id,
            "depth": self.depth,
            "speaker": None if self.utterance is None else self.utterance.speaker,
            "text": None if self.utterance is None else self.utterance.text,
            "tokens": self.tokens,
            "next_speaker": AGENT_NAMES[self.next_speaker],
            "value": self.value,
            "visits": self.visits,
        }


def ranked_children(node: TreeNode) -> list[TreeNode]:
    """Children by current value, best first (ties: older first). Mining uses the ends of this list."""
    return sorted(node.children, key=lambda child: -child.value)


@dataclass
class SearchResult:
    """One question's search: the tree (plain dicts), every rollout, and the order of selections."""

    example: Example
    nodes: list[dict]
    rollouts: list[dict]
    selections: list[int]

    def to_dict(self) -> dict:
        """The JSON line of this question (what ``optima.selection.dpo`` reads)."""
        return {
            "task_id": self.example.id,
            "example": self.example.to_dict(),
            "nodes": self.nodes,
            "rollouts": self.rollouts,
            "selections": self.selections,
        }
