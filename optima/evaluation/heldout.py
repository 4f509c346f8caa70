"""The held-out evaluation of a training run (docs/method.md#held-out-evaluation): the base model and every
checkpoint, greedily, on one seeded sample of eval questions that the run never trained on.

Run after the last iteration (``optima.loop.run_heldout_stage``) with the sweep's job: one greedy conversation per
question, no prompt pool, no answer pre-fill, no constraint, resumable and fingerprinted as every evaluation file. The
sample: the eval split without any question of the training split (by id or by text), then ``select_questions`` with
``heldout_seed``. Under ``<output_dir>/heldout/``: ``<model>.jsonl`` and ``summary.json/.csv/.md/.png`` (answer rate,
strict and flexible metric with their 95% Wilson intervals, tokens, cut and out-of-turns shares).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from optima.config import LoopRecipe
from optima.evaluation.metrics import RecordScorer, flexible_name, metric_names, summarize_records, wilson_interval
from optima.evaluation.runs import (
    EvalSession,
    RecordScorers,
    ServeModel,
    checkpoint_iteration,
    greedy_job,
    read_producer,
)
from optima.evaluation.tables import plot_heldout, render_heldout_table, write_csv
from optima.identity import digest
from optima.paths import checkpoint_label
from optima.store import atomic_write_text, load_records, write_json
from optima.tasks import Example, get_task, select_questions
from optima.tasks.choice import normalize_question
from optima.tasks.math_equiv import MathVerifier

logger = logging.getLogger(__name__)

SAMPLE_STAGE = "heldout"  # the question stream of select_questions (independent of the training slices)


def heldout_examples(recipe: LoopRecipe) -> list[Example]:
    """The held-out sample: ``heldout_size`` questions of the eval split that are not in the training split.

    Raises:
        ValueError: the eval split has no question outside the training split.
    """
    task = get_task(recipe.dataset_type)
    trained = task.load_train(data_dir=recipe.data_dir, seed=recipe.seed)
    trained_ids = {example.id for example in trained}
    trained_texts = {normalize_question(example.question) for example in trained}
    examples = [
        example
        for example in task.load_eval(data_dir=recipe.data_dir, seed=recipe.seed)
        if example.id not in trained_ids and normalize_question(example.question) not in trained_texts
    ]
    if not examples:
        raise ValueError(f"{recipe.dataset_type}: no eval question outside the training split to hold out")
    size = min(recipe.heldout_size, len(examples))
    if size < recipe.heldout_size:
        logger.warning("heldout | heldout_size %d > %d questions held out: using all", recipe.heldout_size, size)
    return select_questions(examples, size, recipe.heldout_seed, 0, SAMPLE_STAGE)


def heldout_row(name: str, records: Sequence[dict], scorer: RecordScorer) -> dict:
    """The table row of one model's result file (strict and flexible numbers with their 95% intervals)."""
    summary = summarize_records(records, scorer)
    count = summary["questions"]
    row = {"model": name, "checkpoint": checkpoint_label(name), "iteration": checkpoint_iteration(name)} | summary
    if not count:
        return row
    metric, _ = metric_names(Example.from_dict(records[0]["example"]).score_type)
    for key in (metric, flexible_name(metric)):
        low, high = wilson_interval(summary[key] * count, count)
        row[f"{key}_low"], row[f"{key}_high"] = round(low, 4), round(high, 4)
        row[f"{key}_ci"] = f"{low:.2f}-{high:.2f}"
    ended = [record for record in records if record.get("status") == "ok"]
    row["max_turns_rate"] = round(sum(r.get("stop_reason") == "max_turns" for r in ended) / len(records), 4)
    row["question_ids"] = digest(sorted(str(record["task_id"]) for record in records))
    return row


def write_heldout_report(
    out_root: Path, task: str, rows: list[dict], examples: Sequence[Example], seed: int, seconds: float | None = None
) -> str:
    """Write summary.json/.csv/.md/.png under ``out_root``; return the Markdown table (``seconds``: wall time)."""
    metric, _ = metric_names(get_task(task).score_type)
    header = {"task": task, "metric": metric, "seed": seed, "questions": len(examples), "seconds": seconds}
    write_json(out_root / "summary.json", header | {"question_ids": [e.id for e in examples], "models": rows})
    write_csv(out_root / "summary.csv", rows, list(rows[0]) if rows else ["model"])
    table = render_heldout_table(rows, metric)
    atomic_write_text(out_root / "summary.md", table + "\n")
    if rows:
        plot_heldout(rows, metric, out_root / "summary.png", f"{task}: {len(examples)} held-out questions, greedy")
    return table


def run_heldout(
    recipe: LoopRecipe, out_root: Path, models: Sequence[tuple[str, Path]], serve_model: ServeModel, envs=None
) -> str:
    """Evaluate ``models`` (``(name, folder)`` in table order: ``base``, then ``iteration_<k>``) on the held-out
    sample with the run's servers (``serve_model``), resuming; write the summaries and return the table."""
    out_root.mkdir(parents=True, exist_ok=True)
    examples = heldout_examples(recipe)
    logger.info(
        "heldout | %s | %d questions | %d models | %s", recipe.dataset_type, len(examples), len(models), out_root
    )
    session = EvalSession(recipe, envs or {}, examples, out_root=out_root, server=serve_model)
    rows, started = [], time.monotonic()
    with MathVerifier() as verifier:
        scorer_of = RecordScorers(recipe, verifier)  # F1 tasks: each model's tokenizer, loaded once
        for name, path in models:
            job = greedy_job(out_root, name)
            session.run(name, path, [job])
            records, _ = load_records(job.out_path)
            row = heldout_row(name, records, scorer_of(path))
            rows.append(row | {"producer": digest(read_producer(job.out_path))})
    seconds = round(time.monotonic() - started, 1)  # this run's serving and generation (0 when all resumed)
    return write_heldout_report(out_root, recipe.dataset_type, rows, examples, recipe.heldout_seed, seconds)
