"""Multi-agent self-consistency of ``multi_sc_data_generate_script.py`` with its baselines
(docs/method.md#self-consistency).

The model (every model of ``list_models``, usually one) is served once and samples ``num_samples`` conversations
per eval question at ``sc_temperature`` into ``<model>.sc.jsonl``. The baselines run on the same questions on the
*base* model (``--base_model_path``, else the ``initial_model_path`` of the run a checkpoint belongs to):
``--baseline cot`` adds CoT (greedy) and CoT-SC (``num_samples`` answers), ``mad`` one debate per question,
``autoform`` ``num_samples`` AutoForm conversations. Then, for k = 1..K, majority vote, coverage and tokens into
``sc_analysis.json``/``.csv``/``.png`` (score vs k and vote vs tokens: paper Fig. 3).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from optima.agents.conversation import GenerationSettings
from optima.config import MultiSCRecipe, RecipeError
from optima.environments import PythonEnv
from optima.evaluation.baselines import BaselineSettings, DebateSettings, method_job
from optima.evaluation.metrics import (
    TIMEOUTS,
    RecordScorer,
    analyze_self_consistency,
    metric_names,
    summarize_records,
    with_timeouts,
)
from optima.evaluation.runs import (
    EvalSession,
    GenerationJob,
    RecordScorers,
    checkpoint_iteration,
    load_eval_examples,
    load_results,
    prepare_output,
    read_producer,
)
from optima.evaluation.sweep import list_models
from optima.evaluation.tables import LABELS, plot_self_consistency, render_table, write_csv
from optima.identity import COMPLETE_MARKER
from optima.store import write_json
from optima.tasks import get_task
from optima.tasks.math_equiv import MathVerifier

logger = logging.getLogger(__name__)

SC_BASELINES = ("cot", "mad", "autoform")
CSV_COLUMNS = ("model", "method", "k", "majority_vote", "coverage", "tokens", "cut_rate", "questions")
# --baseline -> the files it adds: CoT brings its greedy answer and its sampled answers (CoT-SC).
BASELINE_METHODS = {"cot": ("cot", "cot_sc"), "mad": ("mad",), "autoform": ("autoform_sc",)}


@dataclass(frozen=True)
class SCOptions:
    """Run options beside the recipe: the ``baselines`` (``SC_BASELINES``), the largest k of the analysis
    (``max_k``, default ``num_samples``) and MAD's shape."""

    baselines: tuple[str, ...] = ()
    max_k: int | None = None
    debate: DebateSettings = field(default_factory=DebateSettings)

    def __post_init__(self) -> None:
        unknown = [b for b in self.baselines if b not in SC_BASELINES]
        if unknown:
            raise RecipeError("baseline", f"must be among {SC_BASELINES}, got {unknown}")
        if self.max_k is not None and self.max_k < 1:
            raise RecipeError("max_k", f"must be >= 1, got {self.max_k}")


def base_model(recipe: MultiSCRecipe, models: list[tuple[str, Path]]) -> tuple[str, Path]:
    """The model the baselines run on and its name in the files: ``initial_model_path``; else, for a trained
    checkpoint (it has a completion marker), the ``initial_model_path`` of its run's ``recipe.yaml``; else the
    model itself. Raises ``RecipeError`` for a checkpoint whose run is not found."""
    if recipe.initial_model_path:
        path = Path(recipe.initial_model_path)
        return next(((name, p) for name, p in models if p.resolve() == path.resolve()), ("base", path))
    name, path = models[0]
    if not (path / COMPLETE_MARKER).is_file():
        return name, path
    run_recipe = path.parent.parent / "recipe.yaml"
    initial = yaml.safe_load(run_recipe.read_text()).get("initial_model_path") if run_recipe.is_file() else None
    if not initial:
        raise RecipeError(
            "base_model_path",
            f"{path} is a trained checkpoint and {run_recipe} names no initial_model_path; the baselines run on "
            "the base model: give --base_model_path",
        )
    return "base", Path(initial)


def model_jobs(recipe: MultiSCRecipe, out_root: Path, options: SCOptions) -> dict[str, tuple[Path, list]]:
    """Per model name: its folder and its result files (Optima's samples; the baselines on the base model)."""
    models = list_models(recipe)
    planned = {}
    for name, path in models:
        generation = GenerationSettings(
            checkpoint_iteration(name), recipe.sc_temperature, recipe.num_samples, stage="sc"
        )
        planned[name] = (path, [GenerationJob("optima_sc", out_root / f"{name}.sc.jsonl", generation)])
    if options.baselines and models:
        name, path = base_model(recipe, models)
        settings = BaselineSettings(recipe.num_samples, recipe.sc_temperature, options.debate)
        methods = [m for baseline in options.baselines for m in BASELINE_METHODS[baseline]]
        planned.setdefault(name, (path, []))[1].extend(method_job(m, out_root, name, settings) for m in methods)
    return planned


def analyze_model(jobs: list[GenerationJob], max_k: int, scorer: RecordScorer, cluster_f1: float) -> dict:
    """Per method: the k = 1..K rows (sampled methods) or the summary (one answer per question: CoT, MAD)."""
    results = {}
    for job in jobs:
        records = load_results(job.out_path, cluster_f1)
        if job.generation.samples == 1:  # one answer per question: the sweep's summary
            results[job.label] = summarize_records(records, scorer)
        else:
            results[job.label] = analyze_self_consistency(records, max_k, scorer, cluster_f1)
    return results


def flat_rows(results: dict[str, dict], metric: str) -> list[dict]:
    """One CSV row per (model, method, k); a one-answer method is its single k = 1 point."""
    rows = []
    for model, methods in results.items():
        for method, value in methods.items():
            if isinstance(value, dict):
                score, tokens, questions = value.get(metric), value.get("mean_tokens"), value.get("questions")
                point = {"k": 1, "majority_vote": score, "coverage": score, "tokens": tokens}
                point |= {"cut_rate": value.get("cut_rate"), "questions": questions}
                point |= {TIMEOUTS: value[TIMEOUTS]} if TIMEOUTS in value else {}
                rows.append({"model": model, "method": method} | point)
            else:
                rows.extend({"model": model, "method": method} | row for row in value)
    return rows


def shown_rows(rows: list[dict]) -> list[dict]:
    """The table's rows: k = 1, 2, 4, 8, ... and the largest k of each method."""
    last = {(row["model"], row["method"]): row["k"] for row in rows}
    return [r for r in rows if r["k"] & (r["k"] - 1) == 0 or r["k"] == last[(r["model"], r["method"])]]


def write_sc_report(recipe: MultiSCRecipe, results: dict[str, dict], max_k: int, producers: dict | None = None) -> str:
    """Write sc_analysis.json/.csv/.png (``results``: per model and method, the rows or summary; ``producers``:
    their files' fingerprints); return the table as text."""
    out_root = Path(recipe.output_root_path)
    metric, _ = metric_names(get_task(recipe.dataset_type).score_type)
    header = {"task": recipe.dataset_type, "metric": metric, "temperature": recipe.sc_temperature}
    header |= {"num_samples": recipe.num_samples, "max_k": max_k, "producers": producers or {}}
    write_json(out_root / "sc_analysis.json", header | {"models": results})
    rows = flat_rows(results, metric)
    columns = with_timeouts(CSV_COLUMNS, rows)
    write_csv(out_root / "sc_analysis.csv", rows, columns)
    curves, points = {}, {}
    for model, methods in results.items():
        for method, value in methods.items():
            label = f"{model} {LABELS[method]}" if len(results) > 1 else LABELS[method]
            if isinstance(value, dict):
                points[label] = {"score": value.get(metric, 0.0), "tokens": value.get("mean_tokens", 0.0)}
            elif value:
                curves[label] = value
    title = f"{recipe.dataset_type}: self-consistency ({metric}, T={recipe.sc_temperature})"
    if curves or points:
        plot_self_consistency(curves, points, out_root / "sc_analysis.png", title)
    return render_table(shown_rows(rows), columns, title=f"Self-consistency | {recipe.dataset_type} | {metric}")


def run_self_consistency(recipe: MultiSCRecipe, envs: dict[str, PythonEnv], options: SCOptions | None = None) -> str:
    """Sample (resuming), analyse for k = 1..K, write the reports; return the table (``envs``: unused when the
    recipe lists ``endpoints``)."""
    options = options or SCOptions()
    out_root = prepare_output(recipe)
    examples = load_eval_examples(recipe)
    max_k = options.max_k or recipe.num_samples
    session = EvalSession(recipe, envs, examples, out_root)
    results, producers = {}, {}
    with MathVerifier() as verifier:
        scorer_of = RecordScorers(recipe, verifier)
        for name, (path, jobs) in model_jobs(recipe, out_root, options).items():
            logger.info("self-consistency | %s | %d questions | %s", name, len(examples), [j.label for j in jobs])
            session.run(name, path, jobs)
            results[name] = analyze_model(jobs, max_k, scorer_of(path), recipe.cluster_f1)
            producers[name] = {job.label: read_producer(job.out_path) for job in jobs}
        return write_sc_report(recipe, results, max_k, producers)
