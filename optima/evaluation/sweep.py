"""The checkpoint sweep of ``inference_script.py`` with its metrics and report (docs/method.md#metrics).

See docs/method.md#checkpoint-sweep.

For every model of ``list_models`` (the base model first when asked, then ``iteration_*`` checkpoints in numeric
order): serve it, hold one greedy conversation per eval question (temperature 0, no prompt pool), write
``<output_root>/<model>.jsonl``, stop the server. A checkpoint whose file is complete is skipped without a server;
an interrupted one resumes at the first missing question. After each checkpoint the summary is rewritten:

    <output_root>/summary.json   {"task", "metric", "original_metric", "models": [row, ...]}
    <output_root>/summary.csv    one row per model
    <output_root>/summary.png    metric (ours and its ``_original`` variant) and mean tokens per checkpoint
    <output_root>/<model>/logs/vllm_0.log
    <output_root>/conversations.html   every conversation of every model and method (``python -m optima show``)
    <output_root>/<model>.<method>.jsonl, comparison.md/.csv/.json/.png   (with --baseline cot/mad/autoform)

The rows are those of ``optima.evaluation.metrics.summarize_records`` plus ``model``, ``iteration``, ``producer``
(the hash of the fingerprint recorded beside the model's file: ``optima.evaluation.fingerprint``) and
``checkpoint`` ("after iteration k" for ``iteration_<k-1>``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from optima.agents.runner import GenerationSettings
from optima.environments import PythonEnv
from optima.evaluation.compare import write_comparison
from optima.evaluation.dry_run import list_models
from optima.evaluation.fingerprint import read_producer
from optima.evaluation.methods import LABELS, BaselineSettings, method_job, method_row
from optima.evaluation.metrics import RecordScorer, metric_names, summarize_records, with_timeouts
from optima.evaluation.report import plot_sweep, render_table, write_csv, write_json
from optima.evaluation.runs import (
    EvalSession,
    GenerationJob,
    RecordScorers,
    checkpoint_iteration,
    load_eval_examples,
    load_results,
    prepare_output,
)
from optima.identity import digest
from optima.paths import checkpoint_label, models_label
from optima.tasks import get_task
from optima.tasks.math_equiv import MathVerifier

if TYPE_CHECKING:
    from optima.config import InferenceRecipe

logger = logging.getLogger(__name__)

TABLE_COLUMNS = (
    "model",
    "checkpoint",
    "questions",
    "{metric}",
    "{metric}_flexible",
    "{original}",
    "answer_rate",
    "flexible_answer_rate",
    "mean_tokens",
    "cut_rate",
    "error_rate",
)


def sweep_job(out_root: Path, name: str) -> GenerationJob:
    """The greedy eval file of one checkpoint: one conversation per question, temperature 0, no prompt pool."""
    generation = GenerationSettings(checkpoint_iteration(name), 0.0, 1, use_prompt_pool=False, stage="eval")
    return GenerationJob("eval", out_root / f"{name}.jsonl", generation)


def summarize_checkpoint(recipe: InferenceRecipe, name: str, scorer: RecordScorer) -> dict:
    """The summary row of one checkpoint's result file (``scorer``: the checkpoint's ``RecordScorer``)."""
    records = load_results(Path(recipe.output_root_path) / f"{name}.jsonl")
    iteration = checkpoint_iteration(name)
    row = {"model": name, "iteration": iteration if iteration >= 0 else None}  # None: the base or a lone model
    producer = {"producer": digest(read_producer(Path(recipe.output_root_path) / f"{name}.jsonl"))}
    # "checkpoint": the name for people (iteration_0 is the model after iteration 1), last so the columns stay put.
    summary = row | summarize_records(records, scorer) | producer
    return summary | {"checkpoint": checkpoint_label(name)}


def sweep_title(recipe: InferenceRecipe) -> str:
    """The plot's title: the task and the run whose checkpoints were evaluated (its name, not the machine's path)."""
    return f"{recipe.dataset_type}: checkpoints of {models_label(recipe.model_root_path)}"


def write_sweep_report(recipe: InferenceRecipe, rows: list[dict]) -> str:
    """Write summary.json, summary.csv and summary.png; return the table as text."""
    out_root = Path(recipe.output_root_path)
    metric, original = metric_names(get_task(recipe.dataset_type).score_type)
    write_json(
        out_root / "summary.json",
        {"task": recipe.dataset_type, "metric": metric, "original_metric": original, "models": rows},
    )
    columns = list(rows[0]) if rows else ["model"]
    write_csv(out_root / "summary.csv", rows, columns)
    if rows:
        plot_sweep(rows, metric, original, out_root / "summary.png", sweep_title(recipe))
    shown = with_timeouts([c.format(metric=metric, original=original) for c in TABLE_COLUMNS], rows)
    return render_table(rows, shown, title=f"Optima evaluation | {recipe.dataset_type} | {out_root}")


def comparison_rows(
    recipe: InferenceRecipe,
    models: list[tuple[str, Path]],
    baselines: tuple[str, ...],
    settings,
    scorer_of: RecordScorers,
) -> list:
    """The sweep's comparison: per model, Optima's greedy conversation and then each baseline, as rows."""
    out_root = Path(recipe.output_root_path)
    rows = []
    for name, path in models:
        scorer = scorer_of(path)
        jobs = [sweep_job(out_root, name), *(method_job(b, out_root, name, settings) for b in baselines)]
        for job in jobs:
            records = load_results(job.out_path, getattr(recipe, "cluster_f1", 0.9))
            label = LABELS["optima" if job.label == "eval" else job.label]
            rows.append({"method": label, "model": name} | method_row(records, job.generation.samples, scorer))
    return rows


def run_sweep(
    recipe: InferenceRecipe, envs: dict[str, PythonEnv], baselines: tuple[str, ...] = (), settings=None
) -> str:
    """Evaluate every checkpoint (resuming), write the summaries and the plot; return the table.

    Args:
        recipe: A validated ``InferenceRecipe``.
        envs: ``{"vllm": PythonEnv}`` (unused when the recipe lists ``endpoints``).
        baselines: Methods of ``optima.evaluation.methods`` also run on every model (same server, same
            questions), written to ``<model>.<method>.jsonl`` and compared in ``comparison.md/.csv/.png``.
        settings: ``BaselineSettings`` of those baselines (default: its defaults).
    """
    out_root = prepare_output(recipe)
    models = list_models(recipe)
    if not models:
        logger.warning("no iteration_<k> checkpoint and no model folder under %s", recipe.model_root_path)
    examples = load_eval_examples(recipe)
    logger.info("eval | %s | %d questions | %d models | %s", recipe.dataset_type, len(examples), len(models), out_root)
    session = EvalSession(recipe, envs, examples, Path(recipe.output_root_path))
    settings = settings or BaselineSettings()
    rows: list[dict] = []
    with MathVerifier() as verifier:
        scorer_of = RecordScorers(recipe, verifier)  # each model's tokenizer loaded once for both tables
        for position, (name, path) in enumerate(models, start=1):
            logger.info("eval | model %d/%d | %s", position, len(models), name)
            iteration = checkpoint_iteration(name)
            extra = [method_job(b, out_root, name, settings, iteration) for b in baselines]
            session.run(name, path, [sweep_job(out_root, name), *extra])
            rows.append(summarize_checkpoint(recipe, name, scorer_of(path)))
            if position < len(models):
                write_sweep_report(recipe, rows)  # partial summaries survive an interrupted sweep
        table = write_sweep_report(recipe, rows)
        if baselines:
            compared = comparison_rows(recipe, models, baselines, settings, scorer_of)
            table += "\n\n" + write_comparison(out_root, recipe.dataset_type, compared, {"questions": len(examples)})
    logger.info("eval | done | %d models, %d servers started", len(models), session.servers_started)
    return table
