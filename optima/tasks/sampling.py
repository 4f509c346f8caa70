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


def allocate(sizes: Sequence[int], count: int) -> list[int]:
    """How many of ``count`` draws each group gets: one per group first (coverage), the rest in proportion to size.

    The rest is shared by the largest-remainder rule over the groups' sizes beyond their first question, so the
    total is exactly ``count`` (``len(sizes) <= count <= sum(sizes)``) and no group gets more than it holds.

    Args:
        sizes: questions per group (each >= 1).
        count: questions to draw in all.
    """
    spare, extra = sum(sizes) - len(sizes), count - len(sizes)
    quotas = [extra * (size - 1) / spare if spare else 0.0 for size in sizes]
    shares = [int(quota) for quota in quotas]
    by_remainder = sorted(range(len(sizes)), key=lambda g: (shares[g] - quotas[g], g))
    for g in by_remainder[: extra - sum(shares)]:
        shares[g] += 1
    return [1 + share for share in shares]


def stratified_indices(groups: Sequence[str], count: int, seed: int) -> list[int]:
    """A seeded sample of ``count`` positions, stratified by ``groups`` (each position's group), in order.

    Every group gets at least one question when ``count`` allows (``count >= number of groups``), the rest goes
    in proportion to the groups' sizes; with fewer draws than groups, ``count`` groups are drawn (seeded) and
    give one question each. Inside a group the questions are a seeded draw. The sample is a pure function of
    (groups, count, seed): the same for every method and checkpoint evaluated with one seed.

    Args:
        groups: the group of each question of the split, in split order ("" everywhere: a uniform sample).
        count: questions to keep; all of them when ``count >= len(groups)``.
        seed: the run's seed.
    """
    if count >= len(groups):
        return list(range(len(groups)))
    members: dict[str, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    names = sorted(members)
    rng = stable_rng(seed, "limit", count)
    if count < len(names):
        names = sorted(rng.sample(names, count))
        shares = [1] * count
    else:
        shares = allocate([len(members[name]) for name in names], count)
    return sorted(i for name, share in zip(names, shares, strict=True) for i in rng.sample(members[name], share))
