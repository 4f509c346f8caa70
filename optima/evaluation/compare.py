"""``python -m optima compare``: the baselines and Optima checkpoints on the same questions, in one table
(docs/compare.md).

The base model is served once for every baseline it runs, then each ``--optima NAME=CHECKPOINT`` in turn for
Optima's greedy conversation (and with ``--optima_sc K`` K sampled conversations, majority-voted). Each method's
file resumes on its own and is regenerated when its producer changed. Per task: ``comparison.json/.csv/.md/.png``;
with several tasks, each in ``<output>/<task>/``, joined into the methods x tasks table ``table.md/.csv/.json/.png``
(each cell: strict metric / flexible metric / tokens per question, paper Table 1).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from optima.config import MultiSCRecipe, RecipeError
from optima.environments import PythonEnv
from optima.evaluation.baselines import BASELINES, BaselineSettings, method_job
from optima.evaluation.metrics import TIMEOUTS, flexible_name, method_row, metric_names, with_timeouts
from optima.evaluation.runs import (
    EvalSession,
    GenerationJob,
    RecordScorers,
    describe_limit,
    load_eval_examples,
    load_results,
    prepare_output,
    read_producer,
)
from optima.evaluation.tables import (
    LABELS,
    cut_share,
    plot_comparison,
    plot_task_table,
    render_markdown_table,
    render_table,
    task_metric,
    write_csv,
)
from optima.identity import digest
from optima.store import atomic_write_text, write_json
from optima.tasks import TASKS, get_task
from optima.tasks.math_equiv import MathVerifier

logger = logging.getLogger(__name__)

# Tokens beside the cut share, strict beside flexible (as lm-eval-harness shows them).
ROW_COLUMNS = ("method", "model", "questions", "{metric}", "{metric}_flexible", "answer_rate", "flexible_answer_rate",
               "mean_tokens", "cut_rate", "too_long_rate", "error_rate")  # fmt: skip
TABLE_NOTE = (
    "Each cell: task metric of the strict answer (the answer format) / of the flexible answer (named in words: an "
    "option, the last number) / tokens per question ({metrics}); MATH cells add the symbolic checks that timed out "
    "twice (scored 0), if any.\n"
)


@dataclass(frozen=True)
class OptimaRow:
    """A trained checkpoint's row: its name in the table, its folder, and the task it is for (None: every task)."""

    name: str
    path: Path
    task: str | None = None


@dataclass(frozen=True)
class CompareOptions:
    """What to compare: the baselines (table order), the Optima rows, the sampled methods' settings, and the
    samples of each Optima row's self-consistency row (0: none)."""

    methods: tuple[str, ...] = BASELINES
    optima: tuple[OptimaRow, ...] = ()
    settings: BaselineSettings = field(default_factory=BaselineSettings)
    optima_sc: int = 0

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in BASELINES]
        if unknown:
            raise RecipeError("methods", f"unknown {unknown}; choose from {BASELINES}")
        keys = [(row.task, row.name) for row in self.optima]
        names = {row.name for row in self.optima}
        if len(set(keys)) != len(keys) or names & {*BASELINES, *(LABELS[m] for m in BASELINES)}:
            raise RecipeError("optima", f"row names must be unique and differ from the baselines, got {keys}")
        for row in self.optima:
            if row.task is not None and row.task not in TASKS:
                raise RecipeError("optima", f"{row.task}:{row.name}: unknown task {row.task!r}")
            if not (Path(row.path) / "config.json").is_file():
                raise RecipeError("optima", f"{row.name}={row.path}: not a model folder (no config.json)")
        if self.optima_sc < 0:
            raise RecipeError("optima_sc", f"must be >= 0, got {self.optima_sc}")


def parse_optima_rows(items: Sequence[str]) -> tuple[OptimaRow, ...]:
    """``[TASK:]NAME=CHECKPOINT`` strings -> Optima rows (with a task prefix: that task's table only)."""
    rows = []
    for item in items:
        name, sep, path = item.partition("=")
        task, colon, plain = name.partition(":")
        name = plain if colon else name
        if not sep or not name.strip() or not path.strip():
            raise RecipeError("optima", f"expected [TASK:]NAME=CHECKPOINT, got {item!r}")
        rows.append(OptimaRow(name.strip(), Path(path.strip()), task.strip() if colon else None))
    return tuple(rows)


@dataclass(frozen=True)
class Row:
    """One table row to fill: its label, the model serving it, its result file."""

    label: str
    model: str
    model_path: Path
    job: GenerationJob


def table_rows(recipe: MultiSCRecipe, options: CompareOptions) -> list[Row]:
    """The rows in table order: the baselines on the base model, then the Optima checkpoints (and their SC)."""
    out_root, base, s = Path(recipe.output_root_path), Path(recipe.model_root_path), options.settings
    rows = [Row(LABELS[m], base.name, base, method_job(m, out_root, base.name, s)) for m in options.methods]
    sc = dataclasses.replace(s, samples=options.optima_sc or 1)
    for optima in options.optima:
        if optima.task not in (None, recipe.dataset_type):
            continue
        path = Path(optima.path)
        rows.append(Row(optima.name, path.name, path, method_job("optima", out_root, optima.name, s)))
        if options.optima_sc:
            job = method_job("optima_sc", out_root, optima.name, sc)
            rows.append(Row(f"{optima.name} SC", path.name, path, job))
    return rows


def render_compare_dry_run(recipe: MultiSCRecipe, options: CompareOptions) -> str:
    """What ``compare`` would run, one line per row."""
    questions = describe_limit(recipe) or "the default eval size"
    s = options.settings
    lines = [
        f"Optima comparison plan: {recipe.dataset_type}, {questions} questions of the eval split",
        f"  CoT-SC: {s.samples} samples at T={s.temperature}; MAD: {s.debate.agents} agents, "
        f"{s.debate.rounds} rounds at T={s.temperature}, {s.debate.context} context"
        + (f"; Optima SC: {options.optima_sc} samples" if options.optima_sc else ""),
    ]
    lines += [f"  [{row.label}] serve {row.model_path} -> {row.job.out_path}" for row in table_rows(recipe, options)]
    return "\n".join(lines)


def write_comparison(out_root: Path, task: str, rows: list[dict], header: dict) -> str:
    """Write comparison.json/.csv/.md/.png; return the table as text."""
    metric, _ = metric_names(get_task(task).score_type)
    columns = with_timeouts([c.format(metric=metric) for c in ROW_COLUMNS], rows)
    write_json(out_root / "comparison.json", {"task": task, "metric": metric} | header | {"rows": rows})
    write_csv(out_root / "comparison.csv", rows, columns)
    atomic_write_text(out_root / "comparison.md", render_markdown_table(rows, columns) + "\n")
    if rows:
        plot_comparison(
            rows, metric, out_root / "comparison.png", f"{task}: {metric} and answer rate vs tokens per question"
        )
    return render_table(rows, columns, title=f"Comparison | {task} | {metric} | {out_root}")


def settings_header(options: CompareOptions) -> dict:
    """The sampling settings and debate shape, as the reports record them."""
    s = options.settings
    return {"samples": s.samples, "temperature": s.temperature, "optima_sc": options.optima_sc} | dataclasses.asdict(
        s.debate
    )


def compare_rows(recipe: MultiSCRecipe, envs: dict[str, PythonEnv], options: CompareOptions) -> tuple[list, dict]:
    """Generate every row's file of one task (resuming) and score them; return the rows and the header."""
    prepare_output(recipe)
    examples = load_eval_examples(recipe)
    rows = table_rows(recipe, options)
    session = EvalSession(recipe, envs, examples, Path(recipe.output_root_path))
    by_model: dict[Path, list[Row]] = {}
    for row in rows:  # one server per model folder, however its path was written
        by_model.setdefault(row.model_path.resolve(), []).append(row)
    task = recipe.dataset_type
    logger.info("compare | %s | %d questions | %d rows | %d models", task, len(examples), len(rows), len(by_model))
    for position, (path, model_rows) in enumerate(by_model.items(), start=1):
        logger.info("compare | model %d/%d | %s | %s", position, len(by_model), path, [r.label for r in model_rows])
        session.run(model_rows[0].label if len(model_rows) == 1 else path.name, path, [r.job for r in model_rows])
    results, producers = [], {}
    with MathVerifier() as verifier:
        scorer_of = RecordScorers(recipe, verifier)  # rows of one model share its tokenizer
        for row in rows:
            records = load_results(row.job.out_path, recipe.cluster_f1)
            summary = method_row(records, row.job.generation.samples, scorer_of(row.model_path), recipe.cluster_f1)
            producers[row.label] = producer = read_producer(row.job.out_path)
            results.append({"method": row.label, "model": row.model} | summary | {"producer": digest(producer)})
    header = {"questions": len(examples), "settings": settings_header(options), "producers": producers}
    logger.info("compare | %s | done | %d servers started", task, session.servers_started)
    return results, header


def run_compare(recipe: MultiSCRecipe, envs: dict[str, PythonEnv], options: CompareOptions) -> str:
    """Generate every row's file (resuming), score them, write the comparison; return the table (``recipe``:
    ``model_root_path`` is the base model; ``envs``: unused when the recipe lists ``endpoints``)."""
    results, header = compare_rows(recipe, envs, options)
    return write_comparison(Path(recipe.output_root_path), recipe.dataset_type, results, header)


def cell(row: Mapping | None, metric: str) -> str:
    """One methods x tasks cell: ``strict / flexible / tokens`` (``-`` for a method the task did not run; no
    flexible part for rows without one), plus the MATH verifier's timeouts when there were any."""
    if not row or row.get(metric) is None:
        return "-"
    flexible = row.get(flexible_name(metric))
    middle = "" if flexible is None else f"{flexible:.3f} / "
    timeouts = f" / {row[TIMEOUTS]} timeouts" if row.get(TIMEOUTS) else ""
    return f"{row[metric]:.3f} / {middle}{row.get('mean_tokens') or 0:.0f}{timeouts}"


def wide_rows(per_task: Mapping[str, Sequence[Mapping]]) -> list[dict]:
    """One row per method (in first-seen order) with each task's metric, tokens, cut share and answer rate."""
    rows: dict[str, dict] = {}
    for task, task_rows in per_task.items():
        metric = task_metric(task)
        for row in task_rows:
            wide = rows.setdefault(row["method"], {"method": row["method"]})
            wide |= {f"{task}_{metric}": row.get(metric), f"{task}_tokens": row.get("mean_tokens")}
            wide |= {f"{task}_{flexible_name(metric)}": row.get(flexible_name(metric))}
            wide |= {f"{task}_cut": cut_share(row), f"{task}_answer_rate": row.get("answer_rate")}
            wide |= {f"{task}_flexible_answer_rate": row.get("flexible_answer_rate")}
            wide |= {f"{task}_{TIMEOUTS}": row[TIMEOUTS]} if TIMEOUTS in row else {}
            wide[f"{task}_cell"] = cell(row, metric)
    return list(rows.values())


def write_task_table(out_root: Path, per_task: Mapping[str, Sequence[Mapping]], header: Mapping) -> str:
    """Write table.md/.csv/.json/.png under ``out_root``; return the Markdown table."""
    rows = wide_rows(per_task)
    tasks = list(per_task)
    markdown = render_markdown_table(rows, ["method", *(f"{t}_cell" for t in tasks)], ["method", *tasks])
    metrics = ", ".join(f"{t}: {task_metric(t)}" for t in tasks)
    atomic_write_text(out_root / "table.md", f"{markdown}\n\n{TABLE_NOTE.format(metrics=metrics)}")
    kinds = ("{metric}", "{metric}_flexible", "tokens", "cut", "answer_rate", "flexible_answer_rate")
    columns = ["method"] + [f"{t}_{k.format(metric=task_metric(t))}" for t in tasks for k in kinds]
    columns += [key for key in dict.fromkeys(k for row in rows for k in row) if key.endswith(f"_{TIMEOUTS}")]
    write_csv(out_root / "table.csv", rows, columns)
    write_json(
        out_root / "table.json",
        dict(header) | {"tasks": {t: {"metric": task_metric(t), "rows": list(per_task[t])} for t in tasks}},
    )
    if rows:
        plot_task_table(per_task, out_root / "table.png", "methods x tasks: task metric vs tokens per question")
    return markdown


def run_compare_tasks(
    recipes: Sequence[MultiSCRecipe], envs: dict[str, PythonEnv], options: CompareOptions, out_root: Path
) -> str:
    """``run_compare`` for each task's recipe (each its own output folder), then the methods x tasks table in
    ``out_root``."""
    per_task, producers, texts = {}, {}, []
    for recipe in recipes:
        results, header = compare_rows(recipe, envs, options)
        texts.append(write_comparison(Path(recipe.output_root_path), recipe.dataset_type, results, header))
        per_task[recipe.dataset_type] = results
        producers[recipe.dataset_type] = header["producers"]
    table = write_task_table(out_root, per_task, {"settings": settings_header(options), "producers": producers})
    return "\n\n".join([*texts, f"Methods x tasks | {out_root / 'table.md'}", table])
