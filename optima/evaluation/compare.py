"""``python -m optima compare``: the baselines and Optima checkpoints on the same questions, in one table.

The base model is served once for every baseline it runs (CoT, CoT-SC, MAD, AutoForm; ``optima.evaluation.methods``),
then each ``--optima NAME=CHECKPOINT`` is served in turn and holds Optima's conversation greedily (as the sweep
does). Every method's file resumes on its own: a rerun regenerates only what is missing and starts no server for a
model whose files are complete. Then, in the output folder:

    <model>.<method>.jsonl   one record per answer, debate or conversation (``<NAME>.optima.jsonl`` for checkpoints)
    comparison.json          {"task", "metric", "questions", "settings", "rows": [...]}
    comparison.csv / .md     one row per method: task metric, answer rate, tokens per question, failure rates
    comparison.png           task metric and answer rate against tokens per question, one point per method
    conversations.html       every answer, debate and conversation behind the table (``optima.browser``)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from optima.browser import write_conversations_page
from optima.config.fields import RecipeError
from optima.environments import PythonEnv
from optima.evaluation.methods import BASELINES, LABELS, ROW_COLUMNS, BaselineSettings, method_job, method_row
from optima.evaluation.metrics import RecordScorer, metric_names
from optima.evaluation.report import plot_comparison, render_markdown_table, render_table, write_csv, write_json
from optima.evaluation.runs import (
    EvalSession,
    GenerationJob,
    load_eval_examples,
    load_tokenize,
    prepare_output,
)
from optima.store import atomic_write_text, load_records
from optima.tasks import get_task
from optima.tasks.math_equiv import MathVerifier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompareOptions:
    """What to compare.

    Args:
        methods: Baselines run on the base model, in table order.
        optima: (row name, checkpoint folder) of each Optima row.
        settings: Samples and temperature of the sampled baselines, shape of the debate.
    """

    methods: tuple[str, ...] = BASELINES
    optima: tuple[tuple[str, Path], ...] = ()
    settings: BaselineSettings = field(default_factory=BaselineSettings)

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in BASELINES]
        if unknown:
            raise RecipeError("methods", f"unknown {unknown}; choose from {BASELINES}")
        names = [name for name, _ in self.optima]
        if len(set(names)) != len(names) or set(names) & set(BASELINES):
            raise RecipeError("optima", f"row names must be unique and differ from the baselines, got {names}")
        for name, path in self.optima:
            if not (Path(path) / "config.json").is_file():
                raise RecipeError("optima", f"{name}={path}: not a model folder (no config.json)")


def parse_optima_rows(items: Sequence[str]) -> tuple[tuple[str, Path], ...]:
    """``NAME=CHECKPOINT`` strings -> (name, path) pairs."""
    rows = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise RecipeError("optima", f"expected NAME=CHECKPOINT, got {item!r}")
        rows.append((name.strip(), Path(path.strip())))
    return tuple(rows)


@dataclass(frozen=True)
class Row:
    """One table row to fill: its label, the model serving it, its result file."""

    label: str
    model: str
    model_path: Path
    job: GenerationJob


def plan_rows(recipe, options: CompareOptions) -> list[Row]:
    """The rows in table order: the baselines on the base model, then the Optima checkpoints."""
    out_root, base = Path(recipe.output_root_path), Path(recipe.model_root_path)
    rows = [
        Row(LABELS[m], base.name, base, method_job(m, out_root, base.name, options.settings)) for m in options.methods
    ]
    for name, path in options.optima:
        rows.append(Row(name, Path(path).name, Path(path), method_job("optima", out_root, name, options.settings)))
    return rows


def render_compare_plan(recipe, options: CompareOptions) -> str:
    """What ``compare`` would run, one line per row."""
    questions = f"first {recipe.limit}" if recipe.limit else "the default eval size"
    s = options.settings
    lines = [
        f"Optima comparison plan: {recipe.dataset_type}, {questions} questions of the eval split",
        f"  CoT-SC: {s.samples} samples at T={s.temperature}; MAD: {s.debate.agents} agents, "
        f"{s.debate.rounds} rounds at T={s.temperature}",
    ]
    lines += [f"  [{row.label}] serve {row.model_path} -> {row.job.out_path}" for row in plan_rows(recipe, options)]
    return "\n".join(lines)


def write_comparison(out_root: Path, task: str, rows: list[dict], header: dict) -> str:
    """Write comparison.json/.csv/.md/.png; return the table as text."""
    metric, _ = metric_names(get_task(task).score_type)
    columns = [c.format(metric=metric) for c in ROW_COLUMNS]
    write_json(out_root / "comparison.json", {"task": task, "metric": metric} | header | {"rows": rows})
    write_csv(out_root / "comparison.csv", rows, columns)
    title = f"{task}: {metric} and answer rate vs tokens per question"
    atomic_write_text(out_root / "comparison.md", render_markdown_table(rows, columns) + "\n")
    if rows:
        plot_comparison(rows, metric, out_root / "comparison.png", title)
    return render_table(rows, columns, title=f"Comparison | {task} | {metric} | {out_root}")


def run_compare(recipe, envs: dict[str, PythonEnv], options: CompareOptions) -> str:
    """Generate every row's file (resuming), score them, write the comparison; return the table.

    Args:
        recipe: A validated ``MultiSCRecipe`` (``model_root_path`` is the base model; serving fields, ``limit``).
        envs: ``{"vllm": PythonEnv}`` (unused when the recipe lists ``endpoints``).
        options: Methods, Optima rows, sampling settings.
    """
    out_root = prepare_output(recipe)
    examples = load_eval_examples(recipe)
    rows = plan_rows(recipe, options)
    session = EvalSession(recipe, envs, examples)
    by_model: dict[Path, list[Row]] = {}
    for row in rows:
        by_model.setdefault(row.model_path, []).append(row)
    logger.info(
        "compare | %s | %d questions | %d rows | %d models",
        recipe.dataset_type,
        len(examples),
        len(rows),
        len(by_model),
    )
    for position, (path, model_rows) in enumerate(by_model.items(), start=1):
        logger.info("compare | model %d/%d | %s | %s", position, len(by_model), path, [r.label for r in model_rows])
        session.run(model_rows[0].label if len(model_rows) == 1 else path.name, path, [r.job for r in model_rows])
    score_type = get_task(recipe.dataset_type).score_type
    results = []
    with MathVerifier() as verifier:
        for row in rows:
            records, _ = load_records(row.job.out_path)
            scorer = RecordScorer(load_tokenize(recipe, row.model_path, score_type), verifier)
            summary = method_row(records, row.job.plan.samples, scorer, recipe.cluster_f1)
            results.append({"method": row.label, "model": row.model} | summary)
    s = options.settings
    header = {
        "questions": len(examples),
        "settings": {"samples": s.samples, "temperature": s.temperature} | dataclasses.asdict(s.debate),
    }
    logger.info("compare | done | %d servers started", session.servers_started)
    table = write_comparison(out_root, recipe.dataset_type, results, header)
    write_conversations_page(out_root)  # every answer, debate and conversation behind the table, browsable
    return table
