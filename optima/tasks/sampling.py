"""Deterministic question slices per iteration and stage (replaces the shared loader cursor;
docs/method.md#question-slices).

A slice is a pure function of (seed, stage, iteration, count), so the questions a stage sees do not depend on what
ran before it, and a resumed run sees the same ones (docs/method.md, D9):

* For each (seed, stage) there is an endless stream of question indices made of "epochs"; epoch `e` is a
  permutation of all indices drawn by `random.Random` seeded from SHA-256 of `"{seed}:{stage}:{e}"`.
* Iteration `i` takes stream positions `[i * count, (i + 1) * count)`.

So consecutive iterations of a stage get disjoint, fresh questions until the split is used up, then the stream
wraps into a new permutation (small splits repeat questions). Different stages ("sft",
"search", "probe") draw from independent streams. Resuming at iteration `i` needs no replay of earlier stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from optima.tasks.contexts import stable_rng

T = TypeVar("T")


def epoch_permutation(size: int, seed: int, stage: str, epoch: int) -> list[int]:
    """Return the permutation of `range(size)` used for one epoch of a (seed, stage) stream.

    Args:
        size: number of questions in the split.
        seed: the run's seed.
        stage: the stage name, e.g. "sft", "search", "probe".
        epoch: the epoch number (0, 1, ...).
    """
    order = list(range(size))
    stable_rng(seed, stage, epoch).shuffle(order)
    return order


def select_indices(size: int, count: int, seed: int, iteration: int, stage: str) -> list[int]:
    """Return the question indices for (seed, iteration, stage): positions `[i*count, (i+1)*count)` of the stream.

    Args:
        size: number of questions in the split (> 0).
        count: how many questions the stage uses per iteration (>= 0).
        seed: the run's seed.
        iteration: the iteration number (>= 0).
        stage: the stage name.
    """
    if size <= 0:
        raise ValueError(f"cannot select questions from an empty split (size={size})")
    if count < 0 or iteration < 0:
        raise ValueError(f"count and iteration must be >= 0, got count={count}, iteration={iteration}")
    start, end = iteration * count, (iteration + 1) * count
    indices: list[int] = []
    # Only the epochs that overlap [start, end) are drawn.
    for epoch in range(start // size, (end - 1) // size + 1 if count else 0):
        order = epoch_permutation(size, seed, stage, epoch)
        lo, hi = max(start - epoch * size, 0), min(end - epoch * size, size)
        indices.extend(order[lo:hi])
    return indices


def select_questions(examples: Sequence[T], count: int, seed: int, iteration: int, stage: str) -> list[T]:
    """Return the `count` examples a stage uses in one iteration (deterministic, see module doc).

    Args:
        examples: the whole split, in dataset order.
        count: questions per iteration (e.g. the recipe's sample_count or monte_sample_count).
        seed: the run's seed.
        iteration: the iteration number.
        stage: the stage name, e.g. "sft", "search", "probe".
    """
    return [examples[index] for index in select_indices(len(examples), count, seed, iteration, stage)]
