"""The held-out evaluation of a training run (docs/method.md#held-out-evaluation): the base model and every
checkpoint, greedily, on one seeded sample of eval questions that the run never trained on.

A loop's recipe turns it on with ``heldout_size`` (questions; 0: off) and ``heldout_seed``. After the last iteration
(``optima.stages.heldout``) every model holds one greedy conversation per question, no prompt pool, no answer
pre-fill and no constraint: the checkpoint sweep's job (``optima.evaluation.sweep.sweep_job``) through the sweep's
``EvalSession``, so each result file resumes and records what produced it (weights, questions, settings): a rerun
regenerates only what is missing or what another producer wrote. The sample: the task's eval split without any
question of its training split (by id or by text), then ``select_questions`` with ``heldout_seed``: the same
questions for every model and every run of the recipe. Under ``<output_dir>/heldout/``:

    <model>.jsonl (+ .producer.json)   the conversations (``base``, ``iteration_<k>``)
    summary.json    {"task", "metric", "seed", "questions", "question_ids", "models": [row, ...]}
    summary.csv, summary.md
    summary.png     strict and flexible task metric against tokens per question, one point per model, 95% intervals

A row: answer rate, task metric and its 95% Wilson interval for the strict answer (the tag) and for the flexible
one (``optima.tasks.flexible``), tokens per question, and the shares of conversations cut at ``max_tokens`` and of
those that used every turn without the stop rule firing (``max_turns``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from optima.evaluation.fingerprint import read_producer
from optima.evaluation.heldout_table import plot_heldout, render_heldout_table, wilson_interval
from optima.evaluation.metrics import RecordScorer, flexible_name, metric_names, summarize_records
from optima.evaluation.report import write_csv, write_json
from optima.evaluation.runs import EvalSession, RecordScorers, checkpoint_iteration
from optima.evaluation.sweep import sweep_job
from optima.identity import digest
from optima.paths import checkpoint_label
from optima.store import atomic_write_text, load_records
from optima.tasks import Example, get_task, select_questions
from optima.tasks.math_equiv import MathVerifier
from optima.tasks.multiple_choice import normalize_question

if TYPE_CHECKING:
    from optima.config import LoopRecipe

logger = logging.getLogger(__name__)

SAMPLE_STAGE = "heldout"  # the question stream of select_questions (independent of the training slices)
ServeModel = Callable[[str, Path], AbstractContextManager]


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
        title = f"{task}: {len(examples)} held-out questions, greedy"
        plot_heldout(rows, metric, out_root / "summary.png", title)
    return table


def run_heldout(
    recipe: LoopRecipe, out_root: Path, models: Sequence[tuple[str, Path]], serve_model: ServeModel, envs=None
) -> str:
    """Evaluate ``models`` on the held-out sample (resuming), write the summaries; return the table.

    Args:
        recipe: The loop's recipe (task, data, ``heldout_size``, ``heldout_seed``, serving and conversation fields).
        out_root: The run's ``heldout/`` folder.
        models: ``(name, folder)`` in table order: ``base``, then ``iteration_<k>``.
        serve_model: ``(name, folder)`` -> a context manager giving the URLs that serve the folder's weights.
        envs: ``{"vllm": PythonEnv}`` (unused: ``serve_model`` serves).
    """
    out_root.mkdir(parents=True, exist_ok=True)
    examples = heldout_examples(recipe)
    task, count = recipe.dataset_type, len(examples)
    logger.info("heldout | %s | %d questions | %d models | %s", task, count, len(models), out_root)
    session = EvalSession(recipe, envs or {}, examples, out_root=out_root, server=serve_model)
    rows, started = [], time.monotonic()
    with MathVerifier() as verifier:
        scorer_of = RecordScorers(recipe, verifier)  # F1 tasks: each model's tokenizer, loaded once
        for name, path in models:
            job = sweep_job(out_root, name)
            session.run(name, path, [job])
            records, _ = load_records(job.out_path)
            row = heldout_row(name, records, scorer_of(path))
            rows.append(row | {"producer": digest(read_producer(job.out_path))})
    seconds = round(time.monotonic() - started, 1)  # this run's serving and generation (0 when all resumed)
    return write_heldout_report(out_root, recipe.dataset_type, rows, examples, recipe.heldout_seed, seconds)
