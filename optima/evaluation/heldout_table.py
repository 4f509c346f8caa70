"""The held-out evaluation's table and plot (``optima.evaluation.heldout``), apart so that the run report can draw
them without the evaluation's machinery: the columns, the 95% Wilson interval, the Markdown table, the plot of the
task metric against tokens per question.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from optima.evaluation.metrics import flexible_name
from optima.evaluation.report import _new_figure, place_labels, render_markdown_table

logger = logging.getLogger(__name__)

Z_95 = 1.959964  # two-sided 95% normal quantile
COLUMNS = ("checkpoint", "questions", "answer_rate", "{metric}", "{metric}_ci", "flexible_answer_rate",
           "{metric}_flexible", "{metric}_flexible_ci", "mean_tokens", "cut_rate", "max_turns_rate")  # fmt: skip
HEADERS = ("model", "questions", "answer rate", "{metric} (strict)", "95% interval", "answer rate (flexible)",
           "{metric} (flexible)", "95% interval", "tokens / question", "cut (max_tokens)", "out of turns")  # fmt: skip


def wilson_interval(successes: float, total: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (``successes`` of ``total``; (0, 1) when ``total`` is 0).

    For F1 tasks ``successes`` is the summed score: the interval is then an approximation.
    """
    if total <= 0:
        return 0.0, 1.0
    share = successes / total
    centre = (share + z * z / (2 * total)) / (1 + z * z / total)
    half = z / (1 + z * z / total) * math.sqrt(share * (1 - share) / total + z * z / (4 * total * total))
    return max(0.0, centre - half), min(1.0, centre + half)


def plot_heldout(rows: Sequence[Mapping], metric: str, path: Path, title: str):
    """Strict and flexible task metric against tokens per question, one point per model with its 95% interval,
    joined in checkpoint order; returns the figure."""
    figure, axis = _new_figure(1)
    shown = [row for row in rows if row.get("mean_tokens") is not None and row.get(metric) is not None]
    tokens = [row["mean_tokens"] for row in shown]
    for key, name, fill in ((metric, "strict (answer tag)", None), (flexible_name(metric), "flexible", "none")):
        values = [row[key] for row in shown]
        errors = [[v - row[f"{key}_low"] for v, row in zip(values, shown, strict=True)],
                  [row[f"{key}_high"] - v for v, row in zip(values, shown, strict=True)]]  # fmt: skip
        axis.errorbar(tokens, values, yerr=errors, marker="o", mfc=fill, capsize=4, linestyle="--", label=name)
    axis.set(xlabel="tokens per question", ylabel=metric, ylim=(-0.02, 1.02), title=title)
    axis.set_xlim(0, max(tokens, default=1.0) * 1.25 or 1.0)  # the origin shows how far the tokens fell
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small", loc="upper left")
    figure.canvas.draw()  # lay the figure out first: labels are placed in the final axes
    points = [(x, row[metric]) for row, x in zip(shown, tokens, strict=True)]
    place_labels(axis, points, [row["checkpoint"] for row in shown])
    figure.savefig(path, dpi=110)
    logger.info("plot | %s", path)
    return figure


def render_heldout_table(rows: Sequence[Mapping], metric: str) -> str:
    """The Markdown table of the held-out rows (what the run report shows last)."""
    columns = [column.format(metric=metric) for column in COLUMNS]
    return render_markdown_table(rows, columns, [header.format(metric=metric) for header in HEADERS])
