"""Shared loader for the multi-hop information-exchange datasets (HotpotQA distractor, 2WikiMultiHopQA).

Both datasets give a question, a short answer, about ten (title, sentences) paragraphs and supporting facts
(title, sentence index). The local files keep the release schema (`context: [[title, [sentences]]]`,
`supporting_facts: [[title, sent_id]]`); the hub copies use columns (`context: {title: [...], sentences: [...]}`).
Both are accepted. Contexts are split between the agents by `optima.tasks.contexts.split_supporting`.
"""

from __future__ import annotations

from collections.abc import Iterator

from optima.tasks.base import QA_EVAL_LIMIT, Example, Task, row_id
from optima.tasks.contexts import format_paragraph, split_supporting, stable_rng, unique_paragraphs


def iter_context(context: list | dict) -> Iterator[tuple[str, list[str] | str]]:
    """Yield (title, sentences) from either schema of a multi-hop `context` field.

    Args:
        context: `[[title, [sentences]], ...]` (original files) or `{"title": [...], "sentences": [...]}` (hub).
    """
    if isinstance(context, dict):
        yield from zip(context["title"], context["sentences"], strict=True)
        return
    yield from ((title, sentences) for title, sentences in context)


def iter_supporting_titles(supporting_facts: list | dict) -> Iterator[str]:
    """Yield the title of every supporting fact, from either schema.

    Args:
        supporting_facts: `[[title, sent_id], ...]` or `{"title": [...], "sent_id": [...]}`.
    """
    if isinstance(supporting_facts, dict):
        yield from supporting_facts["title"]
        return
    for fact in supporting_facts:
        yield fact[0]


class MultiHopTask(Task):
    """Base of HotpotQA and 2WikiMultiHopQA: F1-scored, `<A>` answers, paragraphs split between the agents."""

    family = "qa"
    answer_style = "tag"
    score_type = "f1"
    prompt_set = "qa"
    eval_limit = QA_EVAL_LIMIT

    def build_example(self, row: dict, *, split: str, index: int, seed: int) -> Example | None:
        """Convert one row: whole unique paragraphs, supporting ones dealt alternately (see module doc)."""
        example_id = row_id(row, ("_id", "id"), split, index)
        paragraphs = unique_paragraphs(
            (title, format_paragraph(title, sentences)) for title, sentences in iter_context(row["context"])
        )
        supporting = list(iter_supporting_titles(row.get("supporting_facts") or []))
        first, second = split_supporting(paragraphs, supporting, stable_rng(seed, self.name, example_id))
        return Example(
            id=example_id,
            task=self.name,
            question=row["question"].strip(),
            answer=str(row["answer"]).strip(),
            score_type=self.score_type,
            context_first=first,
            context_second=second,
        )
