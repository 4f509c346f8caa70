"""The evaluation's files, tables and plots (paper Table 1 and Fig. 3): JSON and CSV written atomically, text and
Markdown tables, and matplotlib figures on the Agg canvas (no pyplot state; matplotlib is imported only when a plot
is drawn, so ``--help`` and ``--dry-run`` stay fast). Point labels never overlap (``place_labels``).
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from optima import store
from optima.evaluation.metrics import flexible_name, metric_names
from optima.paths import checkpoint_label
from optima.tasks import get_task

logger = logging.getLogger(__name__)

# Each method's name in the tables and plots.
LABELS = {"optima": "Optima", "optima_sc": "Optima SC", "cot": "CoT", "cot_sc": "CoT-SC", "mad": "MAD",
          "autoform": "AutoForm", "autoform_sc": "AutoForm SC"}  # fmt: skip
MARKERS = "osD^vP*X"  # colours repeat after ten points, markers tell them apart
# Where a point's label may go (offset in points from the point; a negative x puts the label on the left).
LABEL_OFFSETS = ((6, 5), (6, -13), (-6, 5), (-6, -13), (6, 15), (6, -23), (-6, 15), (-6, -23), (10, -4), (-10, -4))
HELDOUT_COLUMNS = ("checkpoint", "questions", "answer_rate", "{metric}", "{metric}_ci", "flexible_answer_rate",
                   "{metric}_flexible", "{metric}_flexible_ci", "mean_tokens", "cut_rate",
                   "max_turns_rate")  # fmt: skip
HELDOUT_HEADERS = ("model", "questions", "answer rate", "{metric} (strict)", "95% interval", "answer rate (flexible)",
                   "{metric} (flexible)", "95% interval", "tokens / question", "cut (max_tokens)",
                   "out of turns")  # fmt: skip


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
    """A Markdown table of ``rows`` (numbers as in ``render_table``, missing values ``-``; ``headers``: column
    titles, default the keys)."""
    titles = list(headers) or list(columns)
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def render_heldout_table(rows: Sequence[Mapping], metric: str) -> str:
    """The Markdown table of the held-out rows (what the run report shows last)."""
    columns = [column.format(metric=metric) for column in HELDOUT_COLUMNS]
    return render_markdown_table(rows, columns, [header.format(metric=metric) for header in HELDOUT_HEADERS])


def new_figure(panels: int, rows: int = 1):
    """A matplotlib ``Figure`` on the Agg canvas (no pyplot state) and its ``rows`` x ``panels`` axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.5 * panels, 4.2 * rows), layout="constrained")
    FigureCanvasAgg(figure)  # attaches the Agg canvas: savefig works without any GUI backend
    return figure, figure.subplots(rows, panels, squeeze=False) if rows > 1 else figure.subplots(1, panels)


def cut_share(row: Mapping) -> float | None:
    """The share of a row's conversations cut for length (``cut_rate``; older summaries: ``too_long_rate``)."""
    return row.get("cut_rate", row.get("too_long_rate"))


def save(figure, path: Path, dpi: int) -> None:
    figure.savefig(path, dpi=dpi)
    logger.info("plot | %s", path)


def plot_sweep(rows: Sequence[Mapping], metric: str, original_metric: str, path: Path, title: str):
    """Per checkpoint ("after iteration k"): the metric (ours, ``_original``, flexible), the answer rates, the share
    cut for length, and the mean tokens per question; returns the figure."""
    figure, (score_axis, token_axis) = new_figure(2)
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
    save(figure, path, 120)
    return figure


def plot_self_consistency(
    curves: Mapping[str, Sequence[Mapping]], points: Mapping[str, Mapping], path: Path, title: str
) -> None:
    """Majority vote and coverage vs samples, and majority vote vs tokens, one line per method (paper Fig. 3);
    ``curves``: label -> rows of ``analyze_self_consistency``, ``points``: label -> one-sample ``score``/``tokens``."""
    figure, (k_axis, token_axis) = new_figure(2)
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
    k_axis.set(xlabel="samples per question (k)", ylabel="score")
    tokens = [row["tokens"] for rows in curves.values() for row in rows] + [p["tokens"] for p in points.values()]
    if tokens and min(tokens) > 0:
        token_axis.set_xscale("log")  # the paper's budget axis; zero tokens (nothing generated) stay linear
    token_axis.set(xlabel="tokens per question", ylabel="majority-vote score")
    for axis in (k_axis, token_axis):
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle(title)
    save(figure, path, 120)


def place_labels(axis, points: Sequence[tuple[float, float]], labels: Sequence[str], marker_px: float = 6.0) -> list:
    """Label each point at the first offset where its text stays inside the axes and covers no earlier label and
    no point; a label with no free place is left out (the legend names every point). Call after the layout is
    drawn; returns the annotations placed."""
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


def scatter_methods(axis, rows: Sequence[Mapping], key: str, colours: Sequence[int], labels: Sequence[str]) -> bool:
    """One point per row at (tokens per question, ``key``) and a hollow one of the same colour at its flexible value;
    a log axis across a decade or more; whether any row has a flexible value."""
    flexible_key = "flexible_answer_rate" if key == "answer_rate" else flexible_name(key)
    for row, index, label in zip(rows, colours, labels, strict=True):
        marker = MARKERS[index // 10 % 8]
        axis.scatter([row["mean_tokens"]], [row.get(key) or 0.0], color=f"C{index % 10}", marker=marker, s=60,
                     zorder=3, label=label)  # fmt: skip
        if row.get(flexible_key) is not None:
            axis.scatter([row["mean_tokens"]], [row[flexible_key]], facecolors="none", edgecolors=f"C{index % 10}",
                         marker=marker, s=60, zorder=3)  # fmt: skip
    tokens = [row["mean_tokens"] for row in rows]
    if tokens and min(tokens) > 0 and max(tokens) >= 10 * min(tokens):
        axis.set_xscale("log")  # a log axis only across a decade or more: plain tick numbers otherwise
    axis.set(xlabel="tokens per question", ylim=(-0.02, 1.02))
    axis.grid(alpha=0.3)
    return any(row.get(flexible_key) is not None for row in rows)


def label_points(figure, panels: Sequence[tuple], path: Path) -> None:
    """Lay the figure out, label each panel's points (``(axis, rows, key, labels)``), save it."""
    figure.canvas.draw()  # labels are placed in the final axes
    for axis, rows, key, labels in panels:
        place_labels(axis, [(row["mean_tokens"], row.get(key) or 0.0) for row in rows], labels)
    save(figure, path, 100)


def comparison_labels(rows: Sequence[Mapping]) -> list[str]:
    """Each row's method, with its checkpoint when the rows come from several models (the sweep's comparison)."""
    if len({row.get("model") for row in rows}) <= 1:
        return [row["method"] for row in rows]
    return [f"{row['method']} ({checkpoint_label(str(row['model']))})" for row in rows]


def plot_comparison(rows: Sequence[Mapping], metric: str, path: Path, title: str):
    """The metric and the answer rate against tokens per question, one labelled point per method (paper Fig. 1
    style), the legend outside the panels; returns the figure."""
    figure, axes = new_figure(2)
    shown = [row for row in rows if row.get("mean_tokens") is not None]
    labels = comparison_labels(shown)
    panels = [(axes[0], shown, metric, labels), (axes[1], shown, "answer_rate", labels)]
    for (axis, _, key, _), name in zip(panels, (metric, "answer rate"), strict=True):
        if scatter_methods(axis, shown, key, range(len(shown)), labels):
            axis.set_title("filled: strict answer (tag), hollow: flexible answer", fontsize="small")
        axis.set_ylabel(name)
    if shown:
        figure.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize="small")
    figure.suptitle(title)
    label_points(figure, panels, path)
    return figure


def task_metric(task: str) -> str:
    """The task's metric key (``accuracy`` or ``f1``)."""
    return metric_names(get_task(task).score_type)[0]


def plot_task_table(per_task: Mapping[str, Sequence[Mapping]], path: Path, title: str):
    """One panel per task: its metric against tokens per question, one point per method, a method keeping its
    colour in every panel; returns the figure."""
    figure, axes = new_figure(len(per_task))
    axes = axes if len(per_task) > 1 else [axes]
    methods = list(dict.fromkeys(row["method"] for rows in per_task.values() for row in rows))
    panels = []
    for axis, (task, rows) in zip(axes, per_task.items(), strict=True):
        shown = [row for row in rows if row.get("mean_tokens") is not None]
        labels = [row["method"] for row in shown]
        metric = task_metric(task)
        flexible = scatter_methods(axis, shown, metric, [methods.index(m) for m in labels], labels)
        axis.set(title=f"{task} (filled: strict, hollow: flexible)" if flexible else task, ylabel=metric)
        panels.append((axis, shown, metric, labels))
    handles = {label: handle for axis in axes for handle, label in zip(*axis.get_legend_handles_labels(), strict=True)}
    if handles:
        figure.legend(handles.values(), handles.keys(), loc="outside right upper", fontsize="small")
    figure.suptitle(title)
    label_points(figure, panels, path)
    return figure


def plot_heldout(rows: Sequence[Mapping], metric: str, path: Path, title: str):
    """Strict and flexible metric against tokens per question, one point per model with its 95% interval, joined in
    checkpoint order; returns the figure."""
    figure, axis = new_figure(1)
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
    place_labels(
        axis, [(x, row[metric]) for row, x in zip(shown, tokens, strict=True)], [r["checkpoint"] for r in shown]
    )
    save(figure, path, 110)
    return figure
