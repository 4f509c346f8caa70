"""bench/iteration.py on a hand-made run directory: the ratio, the scoring not hidden, the baseline comparison."""

from __future__ import annotations

import importlib.util
import json
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_iteration", REPO / "bench" / "iteration.py")
bench_iteration = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_iteration)
cpu_busy = sys.modules["cpu_busy"]

LOG = """\
2026-12-01 10:00:00,000 INFO optima.manifest: iteration 1/1 | generate
2026-12-01 10:00:20,000 INFO optima.serving.vllm_server: replica 0 ready after 20 s
2026-12-01 10:00:21,000 INFO optima.serving.vllm_server: replica 0 ready after 18 s
2026-12-01 10:02:30,000 INFO optima.manifest: iteration 1/1 | score
2026-12-01 10:02:30,500 INFO optima.rewarding: score | 24 questions (0 already rewarded) | LM loss on
2026-12-01 10:02:32,500 INFO optima.manifest: iteration 1/1 | select
2026-12-01 10:02:33,000 INFO optima.manifest: iteration 1/1 | train
2026-12-01 10:05:00,000 INFO optima.run_context: iteration 1/1 | answer rate 0.5 | accuracy 0.2
2026-12-01 10:05:01,000 INFO optima.pipeline: done | final model /x
"""


def make_run(root: Path, log: str, wait_s: float | None) -> Path:
    (root / "logs").mkdir(parents=True)
    (root / "logs" / "driver.log").write_text(log)
    generate = {"elapsed_s": 100.0} | ({"loss_stream": {"wait_s": wait_s}} if wait_s is not None else {})
    stages = {
        "generate": {"result": generate, "elapsed_s": 150.0},
        "score": {"result": {}, "elapsed_s": 3.0},
        "select": {"result": {}, "elapsed_s": 0.5},
        "train": {"result": {"train_runtime": 130.0}, "elapsed_s": 147.0},
    }
    (root / "iteration_0").mkdir()
    (root / "iteration_0" / "manifest.json").write_text(json.dumps({"stages": stages}))
    return root


def test_ratio_counts_scoring_that_generation_did_not_hide(tmp_path, capsys):
    run = make_run(tmp_path / "new", LOG, wait_s=4.0)
    old_log = LOG.replace("10:05:00,000", "10:08:00,000").replace("10:05:01,000", "10:08:01,000")
    baseline = make_run(tmp_path / "old", old_log, wait_s=None)
    assert bench_iteration.main(["--run-dir", str(run), "--baseline", str(baseline)]) == 0
    row = bench_iteration.measure_run(run)["iterations"][0]
    assert row["wall_s"] == 300.0 and row["generation_s"] == 100.0 and row["training_s"] == 130.0
    assert row["scoring_s"] == 6.0  # 4 s waiting for streamed losses + 2 s score stage
    assert row["server_start_s"] == 38.0 and row["ratio"] == round(300 / 230, 3)
    out = capsys.readouterr().out
    assert "<= 1.15 first, <= 1.05 after: MISSED" in out  # 1.304 at iteration 0
    assert "whole run: 301.0 s vs 481.0 s" in out and "0.626x (target <= 0.75x: met)" in out


def epoch(clock: str) -> float:
    return datetime.strptime(f"2026-12-01 {clock}", "%Y-%m-%d %H:%M:%S").timestamp()


def write_samples(path: Path, points: list[tuple[str, int, int]]) -> None:
    path.write_text("".join(json.dumps({"t": epoch(c), "busy": b, "total": t}) + "\n" for c, b, t in points))


def test_busy_share_per_run_iteration_and_phase(tmp_path, capsys):
    run = make_run(tmp_path / "new", LOG, wait_s=4.0)
    # jiffies: generation (10:00:00-10:02:30) half busy, training (10:02:33-10:05:00) fully busy
    points = [("09:59:59", 0, 0), ("10:00:00", 0, 0), ("10:02:30", 150, 300), ("10:02:33", 153, 306)]
    points += [("10:05:00", 447, 600), ("10:05:01", 449, 602), ("10:05:02", 449, 700)]
    write_samples(run / "logs" / "cpu_busy.jsonl", points)
    result = bench_iteration.measure_run(run)
    row = result["iterations"][0]
    assert row["busy_generation"] == 0.5 and row["busy_training"] == 1.0
    assert row["busy"] == round(447 / 600, 3)
    assert result["busy"] == round(449 / 602, 3)  # first log line to "done | final model", not the idle tail
    bench_iteration.print_table(result)
    out = capsys.readouterr().out
    assert "busy share of the cores over the run (/proc/stat): 74.6% (target >= 80%: MISSED)" in out


def test_without_samples_no_busy_columns(tmp_path, capsys):
    result = bench_iteration.measure_run(make_run(tmp_path / "run", LOG, wait_s=None))
    assert result["busy"] is None and "busy" not in result["iterations"][0]
    bench_iteration.print_table(result)
    assert "busy" not in capsys.readouterr().out


def test_command_after_dashes_runs_sampled_and_its_failure_is_the_exit_code(tmp_path):
    run = make_run(tmp_path / "run", LOG, wait_s=None)
    script = "import time; [sum(range(10**6)) for _ in range(30)]; time.sleep(1.2)"
    assert bench_iteration.main(["--run-dir", str(run), "--", sys.executable, "-c", script]) == 0
    samples = cpu_busy.read_samples(run / "logs" / "cpu_busy.jsonl")
    assert len(samples) >= 3 and samples[-1]["total"] > samples[0]["total"]
    assert all(0 <= s["busy"] <= s["total"] for s in samples)
    assert bench_iteration.main(["--run-dir", str(run), "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_read_cpu_jiffies_counts_user_nice_system_irq_softirq():
    stat = "cpu  10 1 5 100 7 2 3 4 0 0\ncpu0 5 0 2 50 3 1 1 2 0 0\nintr 1\n"
    assert cpu_busy.read_cpu_jiffies(stat) == (10 + 1 + 5 + 2 + 3, 132)


def test_ratio_target_is_looser_for_the_first_iteration_only():
    assert bench_iteration.ratio_target(0) == 1.15 and bench_iteration.ratio_target(1) == 1.05
