"""TriviaQA, reading-comprehension config (Joshi et al. 2017): information exchange over web snippets.

The task keeps the released recipes' spelling `trival_qa` (`trivia_qa` is accepted through `TASK_ALIASES`).
Hub: `mandarjoshi/trivia_qa`, config `rc`, splits train/validation. Local folder `triviaqa/` with `<split>.jsonl`
or `<split>.*.jsonl` (e.g. `validation.rc.wikipedia.nocontext.jsonl`) rows in the HF schema; rows in TriviaQA's release
JSON schema (`Question`, `QuestionId`, `Answer`, `SearchResults`) are accepted too.
Contexts: the search-result descriptions, de-duplicated, shuffled and dealt alternately (Alice first).
Rows without any evidence run closed-book (both agents get no context); `load` logs how many, once per load.
Gold answer: a tuple of aliases (the answer value first); the score is the maximum over aliases.
"""

from __future__ import annotations

import logging

from optima.tasks.base import QA_EVAL_LIMIT, Example, Task, row_id
from optima.tasks.contexts import split_alternating, stable_rng

logger = logging.getLogger(__name__)


def search_descriptions(row: dict) -> list[str]:
    """Return the search-result descriptions of a row in either schema (HF columns or original records).

    Args:
        row: a TriviaQA row.
    """
    if "search_results" in row:
        results = row["search_results"] or {}
        return list(results.get("description") or []) if isinstance(results, dict) else []
    return [result.get("Description", "") for result in row.get("SearchResults") or []]


def answer_aliases(row: dict) -> tuple[str, ...]:
    """Return the gold aliases of a row, its answer value first, without duplicates.

    Args:
        row: a TriviaQA row in either schema.
    """
    answer = row.get("answer") or {}
    if answer:
        names = [answer.get("value", ""), *(answer.get("aliases") or [])]
    else:
        original = row.get("Answer") or {}
        names = [original.get("Value", ""), *(original.get("Aliases") or [])]
    return tuple(name for name in dict.fromkeys(str(n).strip() for n in names) if name)


class TriviaQA(Task):
    """TriviaQA rc: question, alias answers, and web snippets split between Alice and Bob."""

    name = "trival_qa"
    family = "qa"
    answer_style = "tag"
    score_type = "f1"
    prompt_set = "qa"
    train_split = "train"
    eval_split = "validation"
    hub_name = "mandarjoshi/trivia_qa"
    hub_configs = ("rc",)
    local_folder = "triviaqa"
    eval_limit = QA_EVAL_LIMIT

    def build_example(self, row: dict, *, split: str, index: int, seed: int) -> Example | None:
        """Convert one row; rows without any answer alias are skipped."""
        aliases = answer_aliases(row)
        if not aliases:
            return None
        example_id = row_id(row, ("question_id", "QuestionId"), split, index)
        question = row["question"] if "question" in row else row["Question"]
        first, second = split_alternating(search_descriptions(row), stable_rng(seed, self.name, example_id))
        return Example(
            id=example_id,
            task=self.name,
            question=question.strip(),
            answer=aliases,
            score_type=self.score_type,
            context_first=first,
            context_second=second,
        )

    def finalize(self, examples, *, split, data_dir, seed):
        """Log, once per load, how many questions have no evidence and therefore run closed-book."""
        closed_book = sum(1 for example in examples if not example.context_first and not example.context_second)
        if closed_book:
            logger.warning(
                "%s split %s: %d of %d questions have no evidence; they run closed-book (both agents get no context)",
                self.name,
                split,
                closed_book,
                len(examples),
            )
        return examples
