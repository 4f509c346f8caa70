"""bench/iteration.py on a hand-made run directory: the ratio, the scoring not hidden, the baseline comparison."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_iteration", REPO / "bench" / "iteration.py")
bench_iteration = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_iteration)

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
    assert "<= 1.1 in every iteration: MISSED" in out
    assert "whole run: 301.0 s vs 481.0 s" in out and "0.626x (target <= 0.75x: met)" in out
