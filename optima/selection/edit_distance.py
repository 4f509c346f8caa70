"""Levenshtein distance for the tree search's diversity filter and merge rule.

See docs/method.md#node-selection, #rollouts.

The distance (insertions, deletions and substitutions of single characters, each costing 1) comes from
``rapidfuzz`` (``rapidfuzz.distance.Levenshtein``), a bit-parallel C++
implementation: two 8,000-character utterances take well under a millisecond.

The two normalisations are the method's (docs/method.md#node-selection), kept distinct on purpose:

* ``selection_distance(a, b) = ed(a, b) / (max(len a, len b) + 1)``: diversity filter (symmetric);
* ``merge_distance(existing, reply) = ed(existing, reply) / (len(reply) + 1)``: merging a new reply into a child.
"""

from __future__ import annotations

from rapidfuzz.distance import Levenshtein


def levenshtein(a: str, b: str) -> int:
    """Edit distance between ``a`` and ``b`` (unit-cost insert, delete, substitute, over characters).

    Args:
        a: A string.
        b: Another string.
    """
    return Levenshtein.distance(a, b)


def selection_distance(a: str, b: str) -> float:
    """``ed(a, b) / (max(len a, len b) + 1)``: how different two node contents are (diversity filter).

    Args:
        a: A node's content.
        b: Another node's content.
    """
    return levenshtein(a, b) / (max(len(a), len(b)) + 1)


def merge_distance(existing: str, reply: str) -> float:
    """``ed(existing, reply) / (len(reply) + 1)``: how far a new reply is from an existing child (merge rule).

    Args:
        existing: The content of a child already in the tree.
        reply: The newly generated utterance.
    """
    return levenshtein(existing, reply) / (len(reply) + 1)
