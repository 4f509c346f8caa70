"""TriviaQA, reading-comprehension config (Joshi et al. 2017): information exchange over web snippets.

The task keeps the released recipes' spelling `trival_qa` (`trivia_qa` is an alias). Hub `mandarjoshi/trivia_qa`,
config `rc`; local `triviaqa/` with `<split>.jsonl` or `<split>.*.jsonl`, in the HF or the release's JSON schema.
The search snippets are dealt alternately (Alice first); a question without any runs closed-book. The gold is a
tuple of aliases (the score is their maximum). Eval: the first 1000 validation questions.
"""

from __future__ import annotations

import logging

from optima.tasks.base import QA_EVAL_LIMIT, Example, Task, row_id
from optima.tasks.sampling import split_alternating, stable_rng

logger = logging.getLogger(__name__)


def search_descriptions(row: dict) -> list[str]:
    """The search-result descriptions of a row, in either schema."""
    if "search_results" in row:
        results = row["search_results"] or {}
        return list(results.get("description") or []) if isinstance(results, dict) else []
    return [result.get("Description", "") for result in row.get("SearchResults") or []]


def answer_aliases(row: dict) -> tuple[str, ...]:
    """The gold aliases of a row, its answer value first, without duplicates."""
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
        """Warn, once per load, how many questions have no evidence (they run closed-book)."""
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
