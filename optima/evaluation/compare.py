"""``python -m optima compare``: the baselines and Optima checkpoints on the same questions, in one table.

The base model is served once for every baseline it runs (CoT, CoT-SC, MAD, AutoForm; ``optima.evaluation.methods``),
then each ``--optima NAME=CHECKPOINT`` is served in turn and holds Optima's conversation greedily (as the sweep
does), and with ``--optima_sc K`` also K sampled conversations per question, majority-voted (the paper's
Optima + SC rows). Every method's file resumes on its own, and records what produced it
(``optima.evaluation.fingerprint``): a rerun regenerates only what is missing, starts no server for a model whose
files are complete, and recomputes a file whose producer changed. Then, in the output folder:

    <model>.<method>.jsonl   one record per answer, debate or conversation (``<NAME>.optima.jsonl`` for checkpoints,
                             ``<NAME>.optima_sc.jsonl`` for their samples), with ``<file>.producer.json`` beside it
    comparison.json          {"task", "metric", "questions", "settings", "rows": [...]}
    comparison.csv / .md     one row per method: task metric, answer rate, tokens per question, failure rates
    comparison.png           task metric and answer rate against tokens per question, one point per method
    conversations.html       every answer, debate and conversation behind the table (``optima.browser``, written by
                             the ``compare`` command)

With ``--tasks a,b,...`` each task gets its own folder ``<output>/<task>/`` with those files, and the methods x
tasks table joins them (``optima.evaluation.task_table``: ``table.md/.csv/.json/.png``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from optima.config import RecipeError
from optima.environments import PythonEnv
from optima.evaluation.fingerprint import read_producer
from optima.evaluation.methods import BASELINES, LABELS, ROW_COLUMNS, BaselineSettings, method_job, method_row
from optima.evaluation.metrics import metric_names, with_timeouts
from optima.evaluation.report import plot_comparison, render_markdown_table, render_table, write_csv, write_json
from optima.evaluation.runs import (
    EvalSession,
    GenerationJob,
    RecordScorers,
    describe_limit,
    load_eval_examples,
    load_results,
    prepare_output,
)
from optima.identity import digest
from optima.store import atomic_write_text
from optima.tasks import TASKS, get_task
from optima.tasks.math_equiv import MathVerifier

if TYPE_CHECKING:
    from optima.config import InferenceRecipe, MultiSCRecipe

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimaRow:
    """A trained checkpoint's row: its name in the table, its folder, and the task it is for (None: every task)."""

    name: str
    path: Path
    task: str | None = None


@dataclass(frozen=True)
class CompareOptions:
    """What to compare.

    Args:
        methods: Baselines run on the base model, in table order.
        optima: The Optima rows.
        settings: Samples and temperature of the sampled methods, shape of the debate.
        optima_sc: Sampled conversations per question of each Optima row's self-consistency row (0: none).
    """

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


def table_rows(recipe: InferenceRecipe, options: CompareOptions) -> list[Row]:
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


def render_compare_dry_run(recipe: InferenceRecipe, options: CompareOptions) -> str:
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
    title = f"{task}: {metric} and answer rate vs tokens per question"
    atomic_write_text(out_root / "comparison.md", render_markdown_table(rows, columns) + "\n")
    if rows:
        plot_comparison(rows, metric, out_root / "comparison.png", title)
    return render_table(rows, columns, title=f"Comparison | {task} | {metric} | {out_root}")


def settings_header(options: CompareOptions) -> dict:
    """The sampling settings and debate shape, as the reports record them."""
    s = options.settings
    return {"samples": s.samples, "temperature": s.temperature, "optima_sc": options.optima_sc} | dataclasses.asdict(
        s.debate
    )


def compare_rows(
    recipe: MultiSCRecipe, envs: dict[str, PythonEnv], options: CompareOptions
) -> tuple[list[dict], dict]:
    """Generate every row's file of one task (resuming) and score them; return the rows and the header."""
    prepare_output(recipe)
    examples = load_eval_examples(recipe)
    rows = table_rows(recipe, options)
    session = EvalSession(recipe, envs, examples, Path(recipe.output_root_path))
    by_model: dict[Path, list[Row]] = {}
    for row in rows:  # one server per model folder, however its path was written
        by_model.setdefault(row.model_path.resolve(), []).append(row)
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
    results, producers = [], {}
    with MathVerifier() as verifier:
        scorer_of = RecordScorers(recipe, verifier)  # rows of one model share its tokenizer
        for row in rows:
            records = load_results(row.job.out_path, recipe.cluster_f1)
            scorer = scorer_of(row.model_path)
            summary = method_row(records, row.job.generation.samples, scorer, recipe.cluster_f1)
            producers[row.label] = producer = read_producer(row.job.out_path)
            results.append({"method": row.label, "model": row.model} | summary | {"producer": digest(producer)})
    header = {"questions": len(examples), "settings": settings_header(options), "producers": producers}
    logger.info("compare | %s | done | %d servers started", recipe.dataset_type, session.servers_started)
    return results, header


def run_compare(recipe: MultiSCRecipe, envs: dict[str, PythonEnv], options: CompareOptions) -> str:
    """Generate every row's file (resuming), score them, write the comparison; return the table.

    Args:
        recipe: A validated ``MultiSCRecipe`` (``model_root_path`` is the base model; serving fields, ``limit``).
        envs: ``{"vllm": PythonEnv}`` (unused when the recipe lists ``endpoints``).
        options: Methods, Optima rows, sampling settings.
    """
    results, header = compare_rows(recipe, envs, options)
    return write_comparison(Path(recipe.output_root_path), recipe.dataset_type, results, header)


def run_compare_tasks(
    recipes: Sequence[MultiSCRecipe], envs: dict[str, PythonEnv], options: CompareOptions, out_root: Path
) -> str:
    """``run_compare`` for each task's recipe (its own output folder), then the methods x tasks table.

    Args:
        recipes: One validated ``MultiSCRecipe`` per task, each with its own ``output_root_path``.
        envs: ``{"vllm": PythonEnv}``.
        options: Methods, Optima rows, sampling settings (the same for every task).
        out_root: Where ``table.md/.csv/.json/.png`` go.
    """
    per_task, producers, texts = {}, {}, []
    for recipe in recipes:
        results, header = compare_rows(recipe, envs, options)
        texts.append(write_comparison(Path(recipe.output_root_path), recipe.dataset_type, results, header))
        per_task[recipe.dataset_type] = results
        producers[recipe.dataset_type] = header["producers"]
    from optima.evaluation.task_table import write_task_table

    header = {"settings": settings_header(options), "producers": producers}
    table = write_task_table(out_root, per_task, header)
    return "\n\n".join([*texts, f"Methods x tasks | {out_root / 'table.md'}", table])
