"""Deterministic splitting of a question's context between the two agents (information-exchange tasks,
docs/method.md#tasks).

Splits are seeded, so the evaluation contexts are the same on every run (docs/method.md D8); paragraphs are whole
and de-duplicated (docs/method.md D19):
* the RNG is `random.Random` seeded from a SHA-256 of `"{seed}:{task}:{example id}"` (never Python's `hash()`, which
  is salted per process), so a split depends only on (seed, task, id);
* paragraphs are whole (`"Title: all sentences"`), de-duplicated by title and by text;
* supporting paragraphs are shuffled and dealt alternately, Alice first, so each agent holds part of the evidence;
  every other paragraph goes to a random agent;
* each agent's paragraphs keep the order they have in the source, so the position of a paragraph does not reveal
  whether it is a supporting one.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence


def stable_rng(*parts: object) -> random.Random:
    """Return a `random.Random` seeded from a SHA-256 of the parts joined by ":" (stable across processes).

    Args:
        *parts: values that identify the draw, e.g. (seed, task name, example id).
    """
    key = ":".join(str(part) for part in parts).encode("utf-8")
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))


def format_paragraph(title: str, sentences: Sequence[str] | str) -> str:
    """Render one paragraph as `"Title: full text"` (sentences joined as in the source, then whitespace-trimmed).

    Args:
        title: the paragraph's title (may be empty).
        sentences: the paragraph's sentences (HotpotQA/2Wiki keep their own leading spaces) or its text.
    """
    text = sentences if isinstance(sentences, str) else "".join(sentences)
    text = " ".join(text.split())
    return f"{title}: {text}" if title else text


def unique_paragraphs(pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Drop paragraphs whose title or text was already seen, keeping the first occurrence and the order.

    Args:
        pairs: (title, rendered paragraph) pairs in source order.
    """
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
    """Deal paragraphs to (Alice, Bob): supporting ones alternately after a shuffle, the rest at random.

    Args:
        paragraphs: unique (title, text) pairs in source order (see `unique_paragraphs`).
        supporting_titles: titles of the supporting facts (duplicates and unknown titles are ignored).
        rng: the example's own RNG (see `stable_rng`).
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
    """Shuffle unique non-empty texts and deal them alternately to (Alice, Bob) (TriviaQA search snippets).

    Args:
        texts: the snippets (duplicates and blanks are dropped).
        rng: the example's own RNG.
    """
    unique = [text for text in dict.fromkeys(" ".join(t.split()) for t in texts) if text]
    rng.shuffle(unique)
    return tuple(unique[0::2]), tuple(unique[1::2])
