"""The checkpoint sweep of ``inference_script.py`` (docs/method.md#checkpoint-sweep), and what its and the
self-consistency script's ``--dry-run`` print.

Every model of ``list_models`` (the base model first when asked, then the run's ``iteration_*`` checkpoints in
numeric order) is served and holds one greedy conversation per eval question, no prompt pool, into
``<output_root>/<model>.jsonl``; a model whose file is complete starts no server, an interrupted one resumes. After
each model ``summary.json``/``.csv``/``.png`` are rewritten (with ``--baseline`` also ``comparison.*``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from optima.config import InferenceRecipe, MultiSCRecipe
from optima.environments import PythonEnv
from optima.evaluation.baselines import BaselineSettings, method_job
from optima.evaluation.compare import write_comparison
from optima.evaluation.metrics import RecordScorer, method_row, metric_names, summarize_records, with_timeouts
from optima.evaluation.runs import (
    EvalSession,
    RecordScorers,
    checkpoint_iteration,
    describe_limit,
    greedy_job,
    load_eval_examples,
    load_results,
    prepare_output,
    read_producer,
)
from optima.evaluation.tables import LABELS, plot_sweep, render_table, write_csv
from optima.identity import digest
from optima.lineage import lineage_checkpoints
from optima.paths import checkpoint_label, models_label
from optima.store import write_json
from optima.tasks import get_task
from optima.tasks.math_equiv import MathVerifier

logger = logging.getLogger(__name__)

TABLE_COLUMNS = ("model", "checkpoint", "questions", "{metric}", "{metric}_flexible", "{original}", "answer_rate",
                 "flexible_answer_rate", "mean_tokens", "cut_rate", "error_rate")  # fmt: skip


def list_models(recipe: InferenceRecipe) -> list[tuple[str, Path]]:
    """(name, path) of every model to evaluate: ``base`` first when asked, then the checkpoints of the root (of the
    run's current lineage when it is a run's ``checkpoints`` folder)."""
    models = lineage_checkpoints(Path(recipe.model_root_path))
    if recipe.include_base and recipe.initial_model_path:
        models.insert(0, ("base", Path(recipe.initial_model_path)))
    return models


def render_dry_run(recipe: InferenceRecipe | MultiSCRecipe, envs: dict[str, PythonEnv]) -> str:
    """What ``--dry-run`` prints for a sweep or a self-consistency run."""
    sc = isinstance(recipe, MultiSCRecipe)
    models = list_models(recipe)
    questions = describe_limit(recipe) or "default eval size (1000 or the test split)"
    sampling = (
        f"{recipe.num_samples} conversations per question at temperature {recipe.sc_temperature}"
        if sc
        else "1 conversation per question, greedy (temperature 0), no prompt pool"
    )
    if recipe.endpoints:
        serving = f"endpoints {', '.join(recipe.endpoints)} (endpoint_sync: {recipe.endpoint_sync})"
    else:
        gpus = "all visible" if recipe.devices is None else str(recipe.devices)
        serving = f"GPUs {gpus}, one replica per {recipe.tensor_parallel_size} (one CPU replica without a GPU)"
    lines = [
        f"Optima {'self-consistency' if sc else 'evaluation'} plan: {recipe.dataset_type}",
        f"  models under {recipe.model_root_path}: {len(models)}",
        f"  vllm env: {envs['vllm'].describe()}",
        f"  questions: {questions} of the eval split (data: {recipe.data_dir or 'hub'})",
        f"  sampling: {sampling}",
        f"  serving: {serving}",
        f"  output: {recipe.output_root_path}",
    ]
    if not models:
        lines.append("  WARNING: no iteration_<k> checkpoint and no model folder found")
    for name, path in models:
        lines.append(f"  [{name}] serve {path} -> {Path(recipe.output_root_path) / (name + '.jsonl')}")
    return "\n".join(lines)


def summarize_checkpoint(recipe: InferenceRecipe, name: str, scorer: RecordScorer) -> dict:
    """The summary row of one model's file, with its ``iteration``, ``producer`` (the hash of its fingerprint) and
    ``checkpoint`` ("after iteration k" for ``iteration_<k-1>``, last so the columns stay put)."""
    path = Path(recipe.output_root_path) / f"{name}.jsonl"
    iteration = checkpoint_iteration(name)
    row = {"model": name, "iteration": iteration if iteration >= 0 else None}  # None: the base or a lone model
    summary = row | summarize_records(load_results(path), scorer) | {"producer": digest(read_producer(path))}
    return summary | {"checkpoint": checkpoint_label(name)}


def sweep_title(recipe: InferenceRecipe) -> str:
    """The plot's title: the task and the run whose checkpoints were evaluated (its name, not the machine's path)."""
    return f"{recipe.dataset_type}: checkpoints of {models_label(recipe.model_root_path)}"


def write_sweep_report(recipe: InferenceRecipe, rows: list[dict]) -> str:
    """Write summary.json, summary.csv and summary.png; return the table as text."""
    out_root = Path(recipe.output_root_path)
    metric, original = metric_names(get_task(recipe.dataset_type).score_type)
    header = {"task": recipe.dataset_type, "metric": metric, "original_metric": original}
    write_json(out_root / "summary.json", header | {"models": rows})
    write_csv(out_root / "summary.csv", rows, list(rows[0]) if rows else ["model"])
    if rows:
        plot_sweep(rows, metric, original, out_root / "summary.png", sweep_title(recipe))
    shown = with_timeouts([c.format(metric=metric, original=original) for c in TABLE_COLUMNS], rows)
    return render_table(rows, shown, title=f"Optima evaluation | {recipe.dataset_type} | {out_root}")


def comparison_rows(recipe: InferenceRecipe, models, baselines, settings, scorer_of: RecordScorers) -> list:
    """The sweep's comparison: per model, Optima's greedy conversation and then each baseline, as rows."""
    out_root = Path(recipe.output_root_path)
    rows = []
    for name, path in models:
        scorer = scorer_of(path)
        for job in [greedy_job(out_root, name), *(method_job(b, out_root, name, settings) for b in baselines)]:
            records = load_results(job.out_path, getattr(recipe, "cluster_f1", 0.9))
            label = LABELS["optima" if job.label == "eval" else job.label]
            rows.append({"method": label, "model": name} | method_row(records, job.generation.samples, scorer))
    return rows


def run_sweep(
    recipe: InferenceRecipe, envs: dict[str, PythonEnv], baselines: tuple[str, ...] = (), settings=None
) -> str:
    """Evaluate every model (resuming), write the summaries and the plot; return the table. ``baselines`` run on
    every model too (same server, same questions, with ``settings``) and are compared in ``comparison.*``."""
    out_root = prepare_output(recipe)
    models = list_models(recipe)
    if not models:
        logger.warning("no iteration_<k> checkpoint and no model folder under %s", recipe.model_root_path)
    examples = load_eval_examples(recipe)
    logger.info("eval | %s | %d questions | %d models | %s", recipe.dataset_type, len(examples), len(models), out_root)
    session = EvalSession(recipe, envs, examples, out_root)
    settings = settings or BaselineSettings()
    rows: list[dict] = []
    with MathVerifier() as verifier:
        scorer_of = RecordScorers(recipe, verifier)  # each model's tokenizer loaded once for both tables
        for position, (name, path) in enumerate(models, start=1):
            logger.info("eval | model %d/%d | %s", position, len(models), name)
            iteration = checkpoint_iteration(name)
            extra = [method_job(b, out_root, name, settings, iteration) for b in baselines]
            session.run(name, path, [greedy_job(out_root, name), *extra])
            rows.append(summarize_checkpoint(recipe, name, scorer_of(path)))
            if position < len(models):
                write_sweep_report(recipe, rows)  # partial summaries survive an interrupted sweep
        table = write_sweep_report(recipe, rows)
        if baselines:
            compared = comparison_rows(recipe, models, baselines, settings, scorer_of)
            table += "\n\n" + write_comparison(out_root, recipe.dataset_type, compared, {"questions": len(examples)})
    logger.info("eval | done | %d models, %d servers started", len(models), session.servers_started)
    return table
