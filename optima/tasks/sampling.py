"""Seeded draws: the question slice of each stage and iteration, a stratified `--limit` sample, context splits.

Every draw is a pure function of its inputs (never Python's salted `hash()`), so a resumed run sees the same
questions and every run the same eval contexts (docs/method.md#question-slices).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def stable_rng(*parts: object) -> random.Random:
    """A `random.Random` seeded from a SHA-256 of the parts joined by ":" (the same in every process)."""
    key = ":".join(str(part) for part in parts).encode("utf-8")
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))


def epoch_permutation(size: int, seed: int, stage: str, epoch: int) -> list[int]:
    """The order of `range(size)` in one epoch of the (seed, stage) stream."""
    order = list(range(size))
    stable_rng(seed, stage, epoch).shuffle(order)
    return order


def select_indices(size: int, count: int, seed: int, iteration: int, stage: str) -> list[int]:
    """Positions `[i * count, (i + 1) * count)` of an endless stream of epoch permutations of the split.

    Consecutive iterations get fresh questions until the split is used up, then it wraps; each stage ("sft",
    "search", "probe") has its own stream.
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
    """The `count` examples a stage uses in one iteration (`select_indices` over the whole split)."""
    return [examples[index] for index in select_indices(len(examples), count, seed, iteration, stage)]


def allocate(sizes: Sequence[int], count: int) -> list[int]:
    """How many of `count` draws each group gets: one each first, the rest by size (largest remainder)."""
    spare, extra = sum(sizes) - len(sizes), count - len(sizes)
    quotas = [extra * (size - 1) / spare if spare else 0.0 for size in sizes]
    shares = [int(quota) for quota in quotas]
    by_remainder = sorted(range(len(sizes)), key=lambda g: (shares[g] - quotas[g], g))
    for g in by_remainder[: extra - sum(shares)]:
        shares[g] += 1
    return [1 + share for share in shares]


def stratified_indices(groups: Sequence[str], count: int, seed: int) -> list[int]:
    """A seeded sample of `count` positions stratified by each position's group, in order (all when it fits).

    With fewer draws than groups, `count` groups are drawn and give one question each.
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


def format_paragraph(title: str, sentences: Sequence[str] | str) -> str:
    """`"Title: full text"`, the sentences joined as in the source and the whitespace collapsed."""
    text = sentences if isinstance(sentences, str) else "".join(sentences)
    text = " ".join(text.split())
    return f"{title}: {text}" if title else text


def unique_paragraphs(pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """(title, paragraph) pairs without repeated titles or texts, first occurrence kept, in order."""
    seen_titles: set[str] = set()
    seen_texts: set[str] = set()
    kept = []
    for title, text in pairs:
        if not text or title in seen_titles or text in seen_texts:
            continue
        if title:
            seen_titles.add(title)
        seen_texts.add(text)
        kept.append((title, text))
    return kept


def split_supporting(
    paragraphs: Sequence[tuple[str, str]], supporting_titles: Iterable[str], rng: random.Random
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Deal paragraphs to (Alice, Bob): the supporting ones shuffled and dealt alternately, the rest at random.

    Each agent's paragraphs keep their source order, so a paragraph's place does not say it is a supporting one.
    """
    index_of = {title: index for index, (title, _) in reversed(list(enumerate(paragraphs))) if title}
    support = [index_of[t] for t in dict.fromkeys(supporting_titles) if t in index_of]
    rng.shuffle(support)
    owner = {index: position % 2 for position, index in enumerate(support)}
    for index in range(len(paragraphs)):
        if index not in owner:
            owner[index] = rng.randrange(2)
    first = tuple(text for index, (_, text) in enumerate(paragraphs) if owner[index] == 0)
    second = tuple(text for index, (_, text) in enumerate(paragraphs) if owner[index] == 1)
    return first, second


def split_alternating(texts: Iterable[str], rng: random.Random) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Unique non-empty texts shuffled and dealt alternately to (Alice, Bob) (TriviaQA's snippets)."""
    unique = [text for text in dict.fromkeys(" ".join(t.split()) for t in texts) if text]
    rng.shuffle(unique)
    return tuple(unique[0::2]), tuple(unique[1::2])
