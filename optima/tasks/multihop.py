"""HotpotQA (distractor) and 2WikiMultiHopQA: information exchange over about ten Wikipedia paragraphs.

Both give a question, a short answer, (title, sentences) paragraphs and supporting facts; the release files write
them as lists (`context: [[title, [sentences]]]`), the hub copies as columns (`context: {title, sentences}`).
The paragraphs are split between the agents by `split_supporting`. Eval: the first 1000 questions.
"""

from __future__ import annotations

from collections.abc import Iterator

from optima.tasks.base import QA_EVAL_LIMIT, Example, Task, row_id
from optima.tasks.sampling import format_paragraph, split_supporting, stable_rng, unique_paragraphs


def iter_context(context: list | dict) -> Iterator[tuple[str, list[str] | str]]:
    """(title, sentences) of a `context` field in either schema."""
    if isinstance(context, dict):
        yield from zip(context["title"], context["sentences"], strict=True)
        return
    yield from ((title, sentences) for title, sentences in context)


def iter_supporting_titles(supporting_facts: list | dict) -> Iterator[str]:
    """The title of every supporting fact, in either schema."""
    if isinstance(supporting_facts, dict):
        yield from supporting_facts["title"]
        return
    for fact in supporting_facts:
        yield fact[0]


class MultiHopTask(Task):
    """F1-scored, `<A>` answers, whole paragraphs dealt between the agents (supporting ones alternately)."""

    family = "qa"
    answer_style = "tag"
    score_type = "f1"
    prompt_set = "qa"
    eval_limit = QA_EVAL_LIMIT

    def build_example(self, row: dict, *, split: str, index: int, seed: int) -> Example | None:
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


class HotpotQA(MultiHopTask):
    """HotpotQA distractor (Yang et al. 2018): hub `hotpotqa/hotpot_qa`, local `hotpotqa/` train/validation."""

    name = "hotpot_qa"
    train_split = "train"
    eval_split = "validation"
    hub_name = "hotpotqa/hotpot_qa"
    hub_configs = ("distractor",)
    local_folder = "hotpotqa"


class MultiWikiHopQA(MultiHopTask):
    """2WikiMultiHopQA (Ho et al. 2020): no hub copy; local `2wikimultihopqa/` train/dev, JSONL or release JSON."""

    name = "mwh_qa"
    train_split = "train"
    eval_split = "dev"
    hub_name = None
    local_folder = "2wikimultihopqa"
