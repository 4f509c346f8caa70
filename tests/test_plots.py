"""Plots that read: labels that do not overlap, no machine paths in titles, checkpoints named "after iteration k",
the share cut for length drawn. Each figure is rendered and measured with matplotlib's own renderer."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path
from types import SimpleNamespace

import pytest

from optima.evaluation.sweep import sweep_title, write_sweep_report
from optima.evaluation.tables import plot_comparison, plot_sweep
from optima.paths import checkpoint_label, models_label
from optima.reporting import plot_report


def clustered_rows(count: int, models: tuple[str, ...] = ("SmolLM2",)) -> list[dict]:
    """Comparison rows whose points nearly coincide: the case that used to print labels on top of each other."""
    names = ("CoT", "CoT-SC", "MAD", "AutoForm", "Optima-iSFT", "Optima-iDPO", "Optima-iSFT-DPO", "Optima SC")
    return [
        {
            "method": names[i % len(names)],
            "model": models[i % len(models)],
            "accuracy": 0.30 + 0.004 * i,
            "answer_rate": 0.90 - 0.003 * i,
            "mean_tokens": 100.0 + i,
        }  # fmt: skip
        for i in range(count)
    ]


def text_boxes(figure, texts):
    renderer = figure.canvas.get_renderer()
    return [text.get_window_extent(renderer) for text in texts if text.get_visible() and text.get_text()]


@pytest.mark.parametrize("count", [3, 8])
def test_comparison_labels_never_overlap_and_the_legend_names_every_point(tmp_path, count):
    figure = plot_comparison(clustered_rows(count), "accuracy", tmp_path / "c.png", "arc: accuracy vs tokens")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    legend_texts = [t.get_text() for t in figure.legends[0].get_texts()]
    assert legend_texts == [row["method"] for row in clustered_rows(count)]
    legend_box = figure.legends[0].get_window_extent(figure.canvas.get_renderer())
    placed = 0
    for axis in figure.axes:
        notes = [child for child in axis.texts]
        boxes = text_boxes(figure, notes)
        placed += len(boxes)
        for first, second in combinations(boxes, 2):
            assert not first.overlaps(second), (first, second)
        frame = axis.get_window_extent(figure.canvas.get_renderer())
        assert all(frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1 for b in boxes)
        assert not frame.overlaps(legend_box)  # the legend sits outside the panels
        # Axis and tick labels do not collide either.
        ticks = text_boxes(figure, [*axis.get_xticklabels(), axis.xaxis.label])
        assert not any(a.overlaps(b) for a, b in combinations(ticks, 2))
    assert placed >= min(count, 3) * 2  # most points keep their label next to them


def test_the_sweeps_comparison_names_the_checkpoint_of_each_row(tmp_path):
    rows = clustered_rows(4, models=("base", "iteration_0"))
    figure = plot_comparison(rows, "accuracy", tmp_path / "c.png", "arc")
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert legend == ["CoT (base)", "CoT-SC (after iteration 1)", "MAD (base)", "AutoForm (after iteration 1)"]


def test_checkpoint_and_folder_labels():
    assert checkpoint_label("iteration_0") == "after iteration 1"
    assert checkpoint_label("iteration_12") == "after iteration 13"
    assert checkpoint_label("sft_iteration_1") == "after iteration 2 (SFT stage)"
    assert checkpoint_label("base") == "base" and checkpoint_label("SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    assert models_label(Path("/home/me/runs/demo_arc_sft/checkpoints")) == "demo_arc_sft"
    assert models_label(Path("/home/me/models/SmolLM2")) == "SmolLM2"


def sweep_rows() -> list[dict]:
    return [
        {
            "model": name,
            "accuracy": a,
            "accuracy_original": a,
            "no_answer_rate": 0.5,
            "too_long_rate": cut,
            "mean_tokens": tokens,
        }  # fmt: skip
        for name, a, cut, tokens in (
            ("base", 0.1, 0.6, 90.0),
            ("iteration_0", 0.2, 0.3, 80.0),
            ("iteration_1", 0.3, 0.1, 70.0),
        )  # fmt: skip
    ]


def test_sweep_plot_names_checkpoints_after_their_iteration_and_draws_the_cut_share(tmp_path):
    figure = plot_sweep(sweep_rows(), "accuracy", "accuracy_original", tmp_path / "s.png", "arc")
    score_axis = figure.axes[0]
    assert [t.get_text() for t in score_axis.get_xticklabels()] == ["base", "after iteration 1", "after iteration 2"]
    cut = next(line for line in score_axis.get_lines() if line.get_label() == "cut for length")
    assert list(cut.get_ydata()) == [0.6, 0.3, 0.1]
    rows = [row | {"cut_rate": 0.05} for row in sweep_rows()]  # records that carry ``cut``: their share is drawn
    figure = plot_sweep(rows, "accuracy", "accuracy_original", tmp_path / "s.png", "arc")
    cut = next(line for line in figure.axes[0].get_lines() if line.get_label() == "cut for length")
    assert list(cut.get_ydata()) == [0.05] * 3


def test_sweep_title_has_no_machine_path(tmp_path):
    root = tmp_path / "runs" / "demo_arc_sft" / "checkpoints"
    recipe = SimpleNamespace(output_root_path=str(tmp_path / "eval"), dataset_type="arc", model_root_path=str(root))
    assert sweep_title(recipe) == "arc: checkpoints of demo_arc_sft"
    (tmp_path / "eval").mkdir()
    write_sweep_report(recipe, sweep_rows())
    assert (tmp_path / "eval" / "summary.png").read_bytes()[:4] == b"\x89PNG"


def test_run_report_plot_draws_the_cut_share_when_recorded(tmp_path):
    rows = [
        {
            "label": str(i + 1),
            "task_score": 0.2,
            "answer_rate": 0.5,
            "cut_rate": cut,
            "mean_tokens": 80.0,
            "train_loss": 1.0,
            "time_generate": 5.0,
        }  # fmt: skip
        for i, cut in enumerate((0.4, 0.2))
    ]
    figure = plot_report(rows, tmp_path / "report.png", "Optima run demo")
    lines = {line.get_label(): list(line.get_ydata()) for line in figure.axes[0].get_lines()}
    assert lines["cut for length"] == [0.4, 0.2]
    assert [t.get_text() for t in figure.axes[0].get_xticklabels()] == ["1", "2"]
    older = [{k: v for k, v in row.items() if k != "cut_rate"} for row in rows]  # a run from before the share
    old = plot_report(older, tmp_path / "old.png", "t")
    assert "cut for length" not in {line.get_label() for line in old.axes[0].get_lines()}


def test_the_methods_x_tasks_plot_places_labels_like_the_comparison(tmp_path):
    """The paper-table plot (compare --tasks) uses the same placement: no two labels overlap, the legend names all."""
    from optima.evaluation.tables import plot_task_table

    rows = [row | {"accuracy": 0.0} for row in clustered_rows(6)]  # every method at accuracy 0, tokens close
    figure = plot_task_table({"arc": rows, "gsm8k": rows}, tmp_path / "t.png", "methods x tasks")
    assert [t.get_text() for t in figure.legends[0].get_texts()] == [row["method"] for row in rows]
    for axis in figure.axes:
        boxes = text_boxes(figure, list(axis.texts))
        assert boxes and not any(a.overlaps(b) for a, b in combinations(boxes, 2))
