"""Levenshtein distance for the tree search's diversity filter and merge rule.

See docs/method.md#node-selection, #rollouts.

The original used the ``editdistance`` package; we add no dependency and compute the exact same distance
(insertions, deletions and substitutions of single characters, each costing 1) with the bit-parallel algorithm of
Myers (1999) as formulated by Hyyrö (2001). Python's unbounded integers hold the bit vectors, so one pass over the
longer string does ``O(len(longer))`` big-integer operations on ``len(shorter)``-bit numbers: two 8,000-character
utterances take milliseconds instead of the tens of seconds of the textbook dynamic programme.

The two normalisations are the original's, kept distinct on purpose:

* ``selection_distance(a, b) = ed(a, b) / (max(len a, len b) + 1)``: diversity filter (symmetric);
* ``merge_distance(existing, reply) = ed(existing, reply) / (len(reply) + 1)``: merging a new reply into a child.
"""

from __future__ import annotations


def levenshtein(a: str, b: str) -> int:
    """Edit distance between ``a`` and ``b`` (unit-cost insert, delete, substitute).

    Args:
        a: A string.
        b: Another string.
    """
    if a == b:
        return 0
    if len(a) < len(b):
        a, b = b, a  # the shorter string is the bit-vector "pattern"
    m = len(b)
    if m == 0:
        return len(a)
    # Bit i of peq[c] is set when b[i] == c.
    peq: dict[str, int] = {}
    for i, char in enumerate(b):
        peq[char] = peq.get(char, 0) | (1 << i)
    full = (1 << m) - 1
    top = 1 << (m - 1)
    plus, minus, score = full, 0, m  # vertical +1 / -1 deltas of the current column, and D[m][j]
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
