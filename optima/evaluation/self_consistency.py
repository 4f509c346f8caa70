"""Multi-agent self-consistency of ``multi_sc_data_generate_script.py``, with the CoT baselines.

See docs/method.md#self-consistency.

For the model (every model of ``list_models``, usually one): serve it once, sample ``num_samples`` conversations
per eval question at ``sc_temperature`` (no prompt pool). The baselines run on the same questions on the *base*
model (what Optima trained from, as in the paper's table: ``--base_model_path``, else the ``initial_model_path`` of
the run a checkpoint belongs to, else the model itself when it is no trained checkpoint): ``--baseline cot`` adds
CoT (one greedy answer) and CoT-SC (``num_samples`` sampled answers), ``--baseline mad`` one debate per question,
``--baseline autoform`` ``num_samples`` AutoForm conversations.
Every file resumes; complete ones are not regenerated, and a model whose files are all complete is not served.
Then, for k = 1..K, majority vote, coverage and tokens (``optima.evaluation.voting``):

    <output_root>/<model>.sc.jsonl         Optima conversations (not <model>.jsonl: the sweep's greedy file
                                           of the same model may share the default folder)
    <output_root>/<base>.cot.jsonl         CoT, greedy          (with --baseline cot; <base>: "base", or the
    <output_root>/<base>.cot_sc.jsonl      CoT samples           model's name when it is the base model)
    <output_root>/<base>.mad.jsonl         debates              (with --baseline mad)
    <output_root>/<base>.autoform_sc.jsonl AutoForm samples     (with --baseline autoform)
    <output_root>/sc_analysis.json         {"task", "metric", ..., "models": {model: {method: rows or summary}}}
    <output_root>/sc_analysis.csv          model, method, k, majority_vote, coverage, tokens, cut_rate, questions
    <output_root>/sc_analysis.png          score vs k (vote and coverage), vote vs tokens (paper Fig. 3)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from optima.agents.runner import GenerationSettings
from optima.config import RecipeError
from optima.environments import PythonEnv
from optima.evaluation.debate import DebateSettings
from optima.evaluation.dry_run import list_models
from optima.evaluation.fingerprint import read_producer
from optima.evaluation.methods import LABELS, BaselineSettings, method_job
from optima.evaluation.metrics import TIMEOUTS, RecordScorer, metric_names, summarize_records, with_timeouts
from optima.evaluation.report import plot_self_consistency, render_table, write_csv, write_json
from optima.evaluation.runs import (
    EvalSession,
    GenerationJob,
    RecordScorers,
    checkpoint_iteration,
    load_eval_examples,
    load_results,
    prepare_output,
)
from optima.evaluation.voting import analyze_self_consistency
from optima.identity import COMPLETE_MARKER
from optima.tasks import get_task
from optima.tasks.math_equiv import MathVerifier

if TYPE_CHECKING:
    from optima.config import MultiSCRecipe, Recipe

logger = logging.getLogger(__name__)

SC_BASELINES = ("cot", "mad", "autoform")
CSV_COLUMNS = ("model", "method", "k", "majority_vote", "coverage", "tokens", "cut_rate", "questions")
# --baseline -> the files it adds: CoT brings its greedy answer and its sampled answers (CoT-SC).
BASELINE_METHODS = {"cot": ("cot", "cot_sc"), "mad": ("mad",), "autoform": ("autoform_sc",)}


@dataclass(frozen=True)
class SCOptions:
    """Run options beside the recipe.

    Args:
        baselines: Baselines run on the same model and questions (``SC_BASELINES``): ``cot`` adds CoT (greedy) and
            CoT-SC (``num_samples`` answers), ``mad`` one debate per question at ``sc_temperature``, ``autoform``
            ``num_samples`` AutoForm conversations.
        max_k: Largest k of the analysis (default: ``num_samples``).
        debate: Agents and rounds of MAD.
    """

    baselines: tuple[str, ...] = ()
    max_k: int | None = None
    debate: DebateSettings = field(default_factory=DebateSettings)

    def __post_init__(self) -> None:
        unknown = [b for b in self.baselines if b not in SC_BASELINES]
        if unknown:
            raise RecipeError("baseline", f"must be among {SC_BASELINES}, got {unknown}")
        if self.max_k is not None and self.max_k < 1:
            raise RecipeError("max_k", f"must be >= 1, got {self.max_k}")


def base_model(recipe: Recipe, models: list[tuple[str, Path]]) -> tuple[str, Path]:
    """The model the baselines run on, and its name in the files.

    ``initial_model_path`` (``--base_model_path``); else, for a trained checkpoint (it has a completion marker),
    the ``initial_model_path`` of its run's ``recipe.yaml`` (``<run>/checkpoints/<checkpoint>``); else the model
    itself. Raises ``RecipeError`` for a checkpoint whose run is not found.
    """
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


def sc_jobs(recipe: MultiSCRecipe, out_root: Path, name: str, options: SCOptions) -> list[GenerationJob]:
    """The Optima samples of one model."""
    optima = GenerationSettings(checkpoint_iteration(name), recipe.sc_temperature, recipe.num_samples, stage="sc")
    return [GenerationJob("optima_sc", out_root / f"{name}.sc.jsonl", optima)]


def baseline_jobs(recipe: MultiSCRecipe, out_root: Path, name: str, options: SCOptions) -> list[GenerationJob]:
    """The result files of each baseline (``BASELINE_METHODS``) on the base model called ``name``."""
    settings = BaselineSettings(recipe.num_samples, recipe.sc_temperature, options.debate)
    methods = [m for baseline in options.baselines for m in BASELINE_METHODS[baseline]]
    return [method_job(m, out_root, name, settings) for m in methods]


def model_jobs(
    recipe: MultiSCRecipe, out_root: Path, options: SCOptions
) -> dict[str, tuple[Path, list[GenerationJob]]]:
    """Per model name: its folder and its result files (Optima's samples; the baselines on the base model)."""
    models = list_models(recipe)
    planned = {name: (path, sc_jobs(recipe, out_root, name, options)) for name, path in models}
    if options.baselines and models:
        name, path = base_model(recipe, models)
        planned.setdefault(name, (path, []))[1].extend(baseline_jobs(recipe, out_root, name, options))
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
    """One CSV row per (model, method, k); the greedy CoT is its single k = 1 point."""
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
    last = {}
    for row in rows:
        last[(row["model"], row["method"])] = row["k"]
    return [r for r in rows if r["k"] & (r["k"] - 1) == 0 or r["k"] == last[(r["model"], r["method"])]]


def write_sc_report(recipe: MultiSCRecipe, results: dict[str, dict], max_k: int, producers: dict | None = None) -> str:
    """Write sc_analysis.json/.csv/.png; return the table as text.

    Args:
        recipe: The recipe.
        results: Per model and method, the analysis rows or summary.
        max_k: Largest k.
        producers: Per model and method, the fingerprint of its file (recorded in the JSON).
    """
    out_root = Path(recipe.output_root_path)
    metric, _ = metric_names(get_task(recipe.dataset_type).score_type)
    header = {"task": recipe.dataset_type, "metric": metric, "temperature": recipe.sc_temperature}
    header |= {"num_samples": recipe.num_samples, "max_k": max_k, "producers": producers or {}}
    write_json(out_root / "sc_analysis.json", header | {"models": results})
    rows = flat_rows(results, metric)
    columns = with_timeouts(CSV_COLUMNS, rows)
    write_csv(out_root / "sc_analysis.csv", rows, columns)
    several = len(results) > 1
    curves, points = {}, {}
    for model, methods in results.items():
        for method, value in methods.items():
            label = f"{model} {LABELS[method]}" if several else LABELS[method]
            if isinstance(value, dict):
                points[label] = {"score": value.get(metric, 0.0), "tokens": value.get("mean_tokens", 0.0)}
            elif value:
                curves[label] = value
    title = f"{recipe.dataset_type}: self-consistency ({metric}, T={recipe.sc_temperature})"
    if curves or points:
        plot_self_consistency(curves, points, out_root / "sc_analysis.png", title)
    return render_table(shown_rows(rows), columns, title=f"Self-consistency | {recipe.dataset_type} | {metric}")


def run_self_consistency(recipe: MultiSCRecipe, envs: dict[str, PythonEnv], options: SCOptions | None = None) -> str:
    """Sample (resuming), analyse for k = 1..K, write the reports; return the table.

    Args:
        recipe: A validated ``MultiSCRecipe``.
        envs: ``{"vllm": PythonEnv}`` (unused when the recipe lists ``endpoints``).
        options: Baseline and largest k.
    """
    options = options or SCOptions()
    out_root = prepare_output(recipe)
    examples = load_eval_examples(recipe)
    max_k = options.max_k or recipe.num_samples
    session = EvalSession(recipe, envs, examples, Path(recipe.output_root_path))
    results, producers = {}, {}
    with MathVerifier() as verifier:
        scorer_of = RecordScorers(recipe, verifier)
        for name, (path, jobs) in model_jobs(recipe, out_root, options).items():
            logger.info("self-consistency | %s | %d questions | %s", name, len(examples), [j.label for j in jobs])
            session.run(name, path, jobs)
            results[name] = analyze_model(jobs, max_k, scorer_of(path), recipe.cluster_f1)
            producers[name] = {job.label: read_producer(job.out_path) for job in jobs}
        table = write_sc_report(recipe, results, max_k, producers)
    return table
