"""The tree search's values: a reply and a rollout, the search settings, a node, one question's result.

Plain values without search logic: `optima.selection.mcts` grows the tree, `optima.selection.dpo` mines pairs from
the result's JSON line, and `optima.reward.build_rollout_scorer` scores a `Rollout`.
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
    """What the injected `generate` returns for one utterance: its text (the search removes a leading `Name:`),
    tokens, status (`ok`, `too_long`: cut at the cap, `error`: failed for good) and the failure's message."""

    text: str
    tokens: int
    status: str = "ok"
    error: str | None = None

    def __post_init__(self) -> None:
        if self.status not in REPLY_STATUSES:
            raise ValueError(f"Reply.status must be one of {REPLY_STATUSES}, got {self.status!r}")


@dataclass(frozen=True)
class Rollout:
    """One whole conversation of a rollout, the selected node's path included (what `score` receives);
    `cut_tokens`: those of a reply cut at `max_tokens` and not added."""

    utterances: tuple[Utterance, ...]
    tokens: tuple[int, ...]
    final_answer: str
    status: str
    stop_reason: str
    cut_tokens: int = 0

    @property
    def token_count(self) -> int:
        """Every generated token, a cut reply's included (docs/method.md#token-count)."""
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
    """Search sizes and thresholds: recipe fields `mcts_*`, `*_threshold`, `max_turns`, `compat`."""

    selections: int = ORIGINAL_MCTS_SELECTIONS
    rollouts: int = 3
    top_k: int = 10
    diversity_threshold: float = 0.25
    merge_threshold: float = 0.1
    max_turns: int = 10
    compat: str = "default"

    @classmethod
    def from_recipe(cls, recipe: DPOLoopRecipe) -> SearchSettings:
        """The settings of a validated DPO or SFT-DPO recipe."""
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
    """One utterance of the tree (the root, id 0, holds none); `depth` counts the utterances down to it."""

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
        """The agent who speaks after this node: 0 Alice, 1 Bob."""
        return self.depth % 2

    @property
    def content(self) -> str:
        """The rendered utterance (`"Alice: text"`) the edit distances compare; "" for the root."""
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


@dataclass
class SearchResult:
    """One question's search: the tree (plain dicts), every rollout, and the order of selections."""

    example: Example
    nodes: list[dict]
    rollouts: list[dict]
    selections: list[int]

    def to_dict(self) -> dict:
        """The JSON line of this question (what `optima.selection.dpo` reads)."""
        return {
            "task_id": self.example.id,
            "example": self.example.to_dict(),
            "nodes": self.nodes,
            "rollouts": self.rollouts,
            "selections": self.selections,
        }
