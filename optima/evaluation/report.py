"""Evaluation reports: JSON and CSV summaries, a plain-text table, and the plots.

See docs/method.md#evaluation; paper Fig. 3.

Files are written through a temporary file and an atomic rename, so a reader never sees half a summary. Plots use
matplotlib's object API (``Figure`` + its Agg canvas: no pyplot state, no display), imported only when a plot is
drawn so that ``--help`` and ``--dry-run`` stay fast.
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from optima import store
from optima.paths import checkpoint_label

logger = logging.getLogger(__name__)


def write_json(path: Path, payload: Mapping) -> None:
    """Write ``payload`` as indented JSON."""
    store.write_json(path, payload)


def write_csv(path: Path, rows: Sequence[Mapping], columns: Sequence[str]) -> None:
    """Write ``rows`` as CSV with the given columns (missing values left empty)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    store.atomic_write_text(path, buffer.getvalue())


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _line(values: Sequence[str], widths: Sequence[int]) -> str:
    # First column (names) left-aligned, the numbers right-aligned.
    cells = [v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True))]
    return "  ".join(cells)


def render_table(rows: Sequence[Mapping], columns: Sequence[str], title: str = "") -> str:
    """A fixed-width text table: an optional title, a header line, then one line per row."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(line[i]) for line in cells)]) for i, c in enumerate(columns)]
    lines = [title] if title else []
    lines += [_line(columns, widths), "  ".join("-" * w for w in widths)]
    lines += [_line(line, widths) for line in cells]
    return "\n".join(lines)


def render_markdown_table(rows: Sequence[Mapping], columns: Sequence[str], headers: Sequence[str] = ()) -> str:
    """A Markdown table of ``rows`` (numbers formatted as in ``render_table``, missing values as ``-``).

    Args:
        rows: One mapping per table row.
        columns: The keys to show, in order.
        headers: Column titles (default: the keys).
    """
    titles = list(headers) or list(columns)
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _new_figure(panels: int, rows: int = 1):
    """A matplotlib ``Figure`` on the Agg canvas (no pyplot state) and its ``rows`` x ``panels`` axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.5 * panels, 4.2 * rows), layout="constrained")
    FigureCanvasAgg(figure)  # attaches the Agg canvas: savefig works without any GUI backend
    return figure, figure.subplots(rows, panels, squeeze=False) if rows > 1 else figure.subplots(1, panels)


def cut_share(row: Mapping) -> float | None:
    """The share of a row's conversations cut for length (``cut_rate``; older summaries: ``too_long_rate``)."""
    return row.get("cut_rate", row.get("too_long_rate"))


def plot_sweep(rows: Sequence[Mapping], metric: str, original_metric: str, path: Path, title: str):
    """Task metric (ours, its ``_original`` variant and its flexible variant), answer rate (strict and flexible),
    share cut for length and mean tokens per question, per checkpoint (named "after iteration k"); returns the figure.

    Args:
        rows: Summary rows in checkpoint order (``model`` plus the metric keys and ``mean_tokens``).
        metric: Our metric key (``f1`` or ``accuracy``).
        original_metric: The key of its ``_original`` variant.
        path: PNG to write.
        title: Figure title (task and model root).
    """
    figure, (score_axis, token_axis) = _new_figure(2)
    x = list(range(len(rows)))
    names = [checkpoint_label(row["model"]) for row in rows]
    score_axis.plot(x, [row.get(metric) for row in rows], marker="o", label=metric)
    score_axis.plot(x, [row.get(original_metric) for row in rows], marker="s", linestyle="--", label=original_metric)
    if any(row.get(f"{metric}_flexible") is not None for row in rows):
        flexible = [row.get(f"{metric}_flexible") for row in rows]
        score_axis.plot(x, flexible, marker="o", mfc="none", linestyle="-.", label=f"{metric} (flexible answer)")
    # The share of conversations that end with an answer: the first thing training changes in a small model.
    answered = [None if row.get("no_answer_rate") is None else 1 - row["no_answer_rate"] for row in rows]
    score_axis.plot(x, answered, marker="^", linestyle=":", color="tab:gray", label="answer rate")
    if any(row.get("flexible_answer_rate") is not None for row in rows):
        flexible_rate = [row.get("flexible_answer_rate") for row in rows]
        score_axis.plot(x, flexible_rate, marker="^", mfc="none", linestyle=":", color="tab:olive",
                        label="answer rate (flexible)")  # fmt: skip
    cut = [cut_share(row) for row in rows]
    if any(value is not None for value in cut):
        score_axis.plot(x, cut, marker="v", linestyle="--", color="tab:brown", label="cut for length")
    score_axis.set_ylabel(f"{metric} / share of conversations")
    score_axis.legend()
    token_axis.plot(x, [row.get("mean_tokens") for row in rows], marker="o", color="tab:red")
    token_axis.set_ylabel("mean tokens per question")
    score_axis.set_ylim(-0.02, 1.02)  # scores live in [0, 1]: keep curves of different runs comparable
    token_axis.set_ylim(bottom=0)
    for axis in (score_axis, token_axis):
        axis.set_xticks(x, names, rotation=30, ha="right")
        axis.set_xlabel("checkpoint")
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.savefig(path, dpi=120)
    logger.info("plot | %s", path)
    return figure


def plot_self_consistency(
    curves: Mapping[str, Sequence[Mapping]], points: Mapping[str, Mapping], path: Path, title: str
) -> None:
    """Majority vote and coverage vs samples, and majority vote vs tokens, one line per method (paper Fig. 3).

    Args:
        curves: Label -> rows of ``analyze_self_consistency`` (``k``, ``majority_vote``, ``coverage``, ``tokens``).
        points: Label -> single-sample results (``score``, ``tokens``), e.g. the greedy CoT baseline.
        path: PNG to write.
        title: Figure title.
    """
    figure, (k_axis, token_axis) = _new_figure(2)
    for index, (label, rows) in enumerate(curves.items()):
        color = f"C{index}"
        ks = [row["k"] for row in rows]
        votes = [row["majority_vote"] for row in rows]
        k_axis.plot(ks, votes, color=color, marker="o", label=f"{label} majority vote")
        k_axis.plot(ks, [row["coverage"] for row in rows], color=color, linestyle="--", label=f"{label} coverage")
        token_axis.plot([row["tokens"] for row in rows], votes, color=color, marker="o", label=label)
    for index, (label, point) in enumerate(points.items(), start=len(curves)):
        k_axis.scatter([1], [point["score"]], color=f"C{index}", marker="*", s=120, label=label, zorder=3)
        token_axis.scatter([point["tokens"]], [point["score"]], color=f"C{index}", marker="*", s=120, label=label)
    k_axis.set_xscale("log", base=2)
    k_axis.set_xlabel("samples per question (k)")
    k_axis.set_ylabel("score")
    tokens = [row["tokens"] for rows in curves.values() for row in rows] + [p["tokens"] for p in points.values()]
    if tokens and min(tokens) > 0:
        token_axis.set_xscale("log")  # the paper's budget axis; zero tokens (nothing generated) stay linear
    token_axis.set_xlabel("tokens per question")
    token_axis.set_ylabel("majority-vote score")
    for axis in (k_axis, token_axis):
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle(title)
    figure.savefig(path, dpi=120)
    logger.info("plot | %s", path)


# Where a point's label may go (offset in points from the point; a negative x puts the label on the left).
LABEL_OFFSETS = ((6, 5), (6, -13), (-6, 5), (-6, -13), (6, 15), (6, -23), (-6, 15), (-6, -23), (10, -4), (-10, -4))


def comparison_labels(rows: Sequence[Mapping]) -> list[str]:
    """Each row's method, with its checkpoint when the rows come from several models (the sweep's comparison)."""
    if len({row.get("model") for row in rows}) <= 1:
        return [row["method"] for row in rows]
    return [f"{row['method']} ({checkpoint_label(str(row['model']))})" for row in rows]


def place_labels(axis, points: Sequence[tuple[float, float]], labels: Sequence[str], marker_px: float = 6.0) -> list:
    """Label each point at the first offset where its text stays inside the axes and covers no earlier label and
    no point (a square of ``marker_px`` around each).

    A label with no free place is left out (the legend names every point). Call after the figure's layout is
    drawn: the boxes are measured with the canvas renderer. Returns the annotations placed.
    """
    from matplotlib.transforms import Bbox

    renderer = axis.figure.canvas.get_renderer()
    frame = axis.get_window_extent(renderer)
    centres = axis.transData.transform(points) if points else []
    taken = [Bbox.from_extents(x - marker_px, y - marker_px, x + marker_px, y + marker_px) for x, y in centres]
    placed = []
    for (x, y), label in zip(points, labels, strict=True):
        for dx, dy in LABEL_OFFSETS:
            note = axis.annotate(label, (x, y), textcoords="offset points", xytext=(dx, dy),
                                 ha="left" if dx > 0 else "right", fontsize="small")  # fmt: skip
            box = note.get_window_extent(renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(other) for other in taken):
                taken.append(box)
                placed.append(note)
                break
            note.remove()
    return placed


def scatter_flexible(axis, row: Mapping, key: str, index: int) -> None:
    """A hollow marker (the row's colour and marker) at the row's flexible value ``key``, when it has one."""
    if row.get(key) is None:
        return
    axis.scatter([row["mean_tokens"]], [row[key]], facecolors="none", edgecolors=f"C{index % 10}",
                 marker="osD^vP*X"[index // 10 % 8], s=60, zorder=3)  # fmt: skip


def plot_comparison(rows: Sequence[Mapping], metric: str, path: Path, title: str):
    """Task metric and answer rate against tokens per question, one labelled point per method (paper Fig. 1 style);
    a hollow marker of the same colour beside each shows the flexible answer's value.

    Labels never overlap (``place_labels``); the legend, outside the panels, names every point. Returns the figure.

    Args:
        rows: Comparison rows (``method``, ``model``, ``metric``, ``answer_rate``, ``mean_tokens``).
        metric: The task metric key (``accuracy`` or ``f1``).
        path: PNG to write.
        title: Figure title.
    """
    figure, axes = _new_figure(2)
    shown = [row for row in rows if row.get("mean_tokens") is not None]
    labels = comparison_labels(shown)
    panels = ((axes[0], metric, metric), (axes[1], "answer_rate", "answer rate"))
    flexible_keys = {metric: f"{metric}_flexible", "answer_rate": "flexible_answer_rate"}
    for axis, key, name in panels:
        for index, (row, label) in enumerate(zip(shown, labels, strict=True)):
            marker = "osD^vP*X"[index // 10 % 8]  # colours repeat after ten points, markers tell them apart
            axis.scatter([row["mean_tokens"]], [row.get(key) or 0.0], color=f"C{index % 10}", marker=marker, s=60,
                         zorder=3, label=label)  # fmt: skip
            scatter_flexible(axis, row, flexible_keys[key], index)
        if any(row.get(flexible_keys[key]) is not None for row in shown):
            axis.set_title("filled: strict answer (tag), hollow: flexible answer", fontsize="small")
        tokens = [row["mean_tokens"] for row in shown]
        if tokens and min(tokens) > 0 and max(tokens) >= 10 * min(tokens):
            axis.set_xscale("log")  # a log axis only across a decade or more: plain tick numbers otherwise
        axis.set_xlabel("tokens per question")
        axis.set_ylabel(name)
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
    if shown:
        figure.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize="small")
    figure.suptitle(title)
    figure.canvas.draw()  # lay the figure out first: labels are placed in the final axes
    for axis, key, _ in panels:
        place_labels(axis, [(row["mean_tokens"], row.get(key) or 0.0) for row in shown], labels)
    figure.savefig(path, dpi=100)
    logger.info("plot | %s", path)
    return figure
