"""The paper's comparison table: methods x tasks, task metric and tokens per question in each cell (paper Table 1).

``python -m optima compare --tasks a,b,...`` compares the methods on each task (``optima.evaluation.compare``,
one folder per task) and then joins the rows here:

    <output>/table.md     | method | arc | gsm8k |, each cell "strict metric / flexible metric / tokens"
                          (e.g. "0.412 / 0.530 / 87"; strict: the answer format, flexible: ``optima.tasks.flexible``)
    <output>/table.csv    one row per method: <task>_<metric>, <task>_<metric>_flexible, <task>_tokens, <task>_cut
                          (share of records with a reply cut at max_tokens: ``cut_rate``), <task>_answer_rate,
                          <task>_flexible_answer_rate
    <output>/table.json   {"tasks": {task: {"metric", "rows"}}, "producers": ...}
    <output>/table.png    one panel per task: the task metric against tokens per question, one point per method
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from optima.evaluation.metrics import TIMEOUTS, flexible_name, metric_names
from optima.evaluation.report import (
    _new_figure,
    cut_share,
    place_labels,
    render_markdown_table,
    scatter_flexible,
    write_csv,
    write_json,
)
from optima.store import atomic_write_text
from optima.tasks import get_task

logger = logging.getLogger(__name__)


def task_metric(task: str) -> str:
    """The task's metric key (``accuracy`` or ``f1``)."""
    return metric_names(get_task(task).score_type)[0]


def cell(row: Mapping | None, metric: str) -> str:
    """One table cell: ``strict metric / flexible metric / tokens`` (``-`` for a method the task did not run; the
    flexible part is left out of rows that have none), and the MATH verifier's timeouts when there were any
    (``0.412 / 0.450 / 87 / 2 timeouts``)."""
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


def plot_task_table(per_task: Mapping[str, Sequence[Mapping]], path: Path, title: str):
    """One panel per task: task metric against tokens per question, one point per method.

    As the single-task comparison plot: labels never overlap (``place_labels``), and the legend, outside the
    panels, names every point (a method keeps its colour in every panel). Returns the figure.
    """
    figure, axes = _new_figure(len(per_task))
    axes = axes if len(per_task) > 1 else [axes]
    methods = list(dict.fromkeys(row["method"] for rows in per_task.values() for row in rows))
    points = []
    for axis, (task, rows) in zip(axes, per_task.items(), strict=True):
        metric = task_metric(task)
        shown = [row for row in rows if row.get("mean_tokens") is not None]
        for row in shown:
            index = methods.index(row["method"])
            axis.scatter([row["mean_tokens"]], [row.get(metric) or 0.0], color=f"C{index % 10}",
                         marker="osD^vP*X"[index // 10 % 8], s=60, zorder=3, label=row["method"])  # fmt: skip
            scatter_flexible(axis, row, flexible_name(metric), index)
        tokens = [row["mean_tokens"] for row in shown]
        if tokens and min(tokens) > 0 and max(tokens) >= 10 * min(tokens):
            axis.set_xscale("log")  # a log axis only across a decade or more
        flexible = any(row.get(flexible_name(metric)) is not None for row in shown)
        name = f"{task} (filled: strict, hollow: flexible)" if flexible else task
        axis.set(title=name, xlabel="tokens per question", ylabel=metric, ylim=(-0.02, 1.02))
        axis.grid(alpha=0.3)
        points.append((axis, [(row["mean_tokens"], row.get(metric) or 0.0) for row in shown], shown))
    handles = {label: handle for axis in axes for handle, label in zip(*axis.get_legend_handles_labels(), strict=True)}
    if handles:
        figure.legend(handles.values(), handles.keys(), loc="outside right upper", fontsize="small")
    figure.suptitle(title)
    figure.canvas.draw()  # lay the figure out first: labels are placed in the final axes
    for axis, xy, shown in points:
        place_labels(axis, xy, [row["method"] for row in shown])
    figure.savefig(path, dpi=100)
    logger.info("plot | %s", path)
    return figure


def write_task_table(out_root: Path, per_task: Mapping[str, Sequence[Mapping]], header: Mapping) -> str:
    """Write table.md/.csv/.json/.png under ``out_root``; return the Markdown table."""
    rows = wide_rows(per_task)
    tasks = list(per_task)
    markdown = render_markdown_table(rows, ["method", *(f"{t}_cell" for t in tasks)], ["method", *tasks])
    metrics = ", ".join(f"{t}: {task_metric(t)}" for t in tasks)
    atomic_write_text(
        out_root / "table.md",
        f"{markdown}\n\nEach cell: task metric of the strict answer (the answer format) / of the flexible answer "
        f"(named in words: an option, the last number) / tokens per question ({metrics}); MATH cells add the "
        "symbolic checks that timed out twice (scored 0), if any.\n",
    )
    kinds = ("{metric}", "{metric}_flexible", "tokens", "cut", "answer_rate", "flexible_answer_rate")
    columns = ["method"] + [f"{t}_{k.format(metric=task_metric(t))}" for t in tasks for k in kinds]
    columns += [key for key in dict.fromkeys(k for row in rows for k in row) if key.endswith(f"_{TIMEOUTS}")]
    write_csv(out_root / "table.csv", rows, columns)
    tables = {t: {"metric": task_metric(t), "rows": list(per_task[t])} for t in tasks}
    write_json(out_root / "table.json", dict(header) | {"tasks": tables})
    if rows:
        plot_task_table(per_task, out_root / "table.png", "methods x tasks: task metric vs tokens per question")
    return markdown
