"""``python -m dev.times`` / ``dev.demo`` on hand-made run directories: the ratio, the scoring not hidden, the
baseline comparison, the busy share, and the demo's order (run sampled, times, report)."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

from dev import demo
from dev.cpu_busy import read_cpu_jiffies, read_samples
from dev.times import main as run_times_command
from dev.times import measure_run, ratio_target, render_times

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
    assert run_times_command([str(run), "--baseline", str(baseline)]) == 0
    row = measure_run(run)["iterations"][0]
    assert row["wall_s"] == 300.0 and row["generation_s"] == 100.0 and row["training_s"] == 130.0
    assert row["scoring_s"] == 6.0  # 4 s waiting for streamed losses + 2 s score stage
    assert row["server_start_s"] == 38.0 and row["ratio"] == round(300 / 230, 3)
    out = capsys.readouterr().out
    assert "<= 1.15 first, <= 1.05 after: MISSED" in out  # 1.304 at iteration 0
    assert "whole run: 301.0 s vs 481.0 s" in out and "0.626x (target <= 0.75x: met)" in out


def test_a_stage_started_but_not_finished_counts_no_time(tmp_path):
    """A killed run: the train stage recorded its key when it started, and no result."""
    run = make_run(tmp_path / "run", "", wait_s=None)
    manifest = run / "iteration_0" / "manifest.json"
    stages = json.loads(manifest.read_text())["stages"]
    stages["train"] = {"config_hash": "h", "started_at": "2026-12-01T10:00:00"}
    manifest.write_text(json.dumps({"stages": stages}))
    row = measure_run(run)["iterations"][0]
    assert row["training_s"] == 0.0 and row["wall_s"] == 153.5  # generate, score and select only


def test_an_iteration_still_generating_is_left_out_and_none_finished_is_an_error(tmp_path, caplog):
    """A run stopped in its second iteration's generation: the first is timed; a run stopped in the first's is rc 2."""
    run = make_run(tmp_path / "run", LOG, wait_s=None)
    (run / "iteration_1").mkdir()
    (run / "iteration_1" / "manifest.json").write_text(json.dumps({"stages": {"generate": {"config_hash": "h"}}}))
    assert [row["iteration"] for row in measure_run(run)["iterations"]] == [0]
    (run / "iteration_0" / "manifest.json").write_text(json.dumps({"stages": {}}))
    assert run_times_command([str(run)]) == 2
    assert f"{run}: no iteration has finished generating yet" in caplog.text


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
    result = measure_run(run)
    row = result["iterations"][0]
    assert row["busy_generation"] == 0.5 and row["busy_training"] == 1.0
    assert row["busy"] == round(447 / 600, 3)
    assert result["busy"] == round(449 / 602, 3)  # first log line to "done | final model", not the idle tail
    out = render_times(result)
    assert "busy share of the cores over the run (/proc/stat): 74.6% (target >= 80%: MISSED)" in out


def test_without_samples_no_busy_columns(tmp_path):
    result = measure_run(make_run(tmp_path / "run", LOG, wait_s=None))
    assert result["busy"] is None and "busy" not in result["iterations"][0]
    assert "busy" not in render_times(result)


def test_command_after_dashes_runs_sampled_and_its_failure_is_the_exit_code(tmp_path):
    run = make_run(tmp_path / "run", LOG, wait_s=None)
    script = "import time; [sum(range(10**6)) for _ in range(30)]; time.sleep(1.2)"
    assert run_times_command([str(run), "--", sys.executable, "-c", script]) == 0
    samples = read_samples(run / "logs" / "cpu_busy.jsonl")
    assert len(samples) >= 3 and samples[-1]["total"] > samples[0]["total"]
    assert all(0 <= s["busy"] <= s["total"] for s in samples)
    assert run_times_command([str(run), "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_read_cpu_jiffies_counts_user_nice_system_irq_softirq():
    stat = "cpu  10 1 5 100 7 2 3 4 0 0\ncpu0 5 0 2 50 3 1 1 2 0 0\nintr 1\n"
    assert read_cpu_jiffies(stat) == (10 + 1 + 5 + 2 + 3, 132)


def test_ratio_target_is_looser_for_the_first_iteration_only():
    assert ratio_target(0) == 1.15 and ratio_target(1) == 1.05


def test_a_folder_without_iterations_is_an_error_naming_it(tmp_path, caplog):
    assert run_times_command([str(tmp_path)]) == 2
    assert f"{tmp_path}: no iteration_<i>/manifest.json" in caplog.text


FAKE_SCRIPT = """\
import json, shutil, sys
from pathlib import Path
Path("calls.json").write_text(json.dumps(sys.argv[1:]))
if "fail" in sys.argv[-1]:
    raise SystemExit(5)
shutil.copytree("made", "runs/demo", dirs_exist_ok=True)
"""


def fake_repo(tmp_path: Path) -> Path:
    """A repository whose sft_script.py copies a finished run into the recipe's output_dir."""
    repo = tmp_path / "repo"
    (repo / "train").mkdir(parents=True)
    (repo / "sft_script.py").write_text(FAKE_SCRIPT)
    (repo / "train" / "demo.yaml").write_text("output_dir: runs/demo\n")
    (repo / "train" / "fail.yaml").write_text("output_dir: runs/demo\n")
    make_run(repo / "made", LOG, wait_s=4.0)  # copied over the folder the sampler writes into
    return repo


def test_demo_runs_the_recipe_sampled_then_prints_its_times_then_its_report(tmp_path, monkeypatch, capsys):
    repo = fake_repo(tmp_path)
    reports = []
    monkeypatch.setattr(demo, "REPO", repo)
    monkeypatch.setattr(demo, "optima_main", lambda argv: reports.append(argv) or 0)
    assert demo.main(["--recipe", "train/demo.yaml"]) == 0
    assert json.loads((repo / "calls.json").read_text()) == ["--train_config_path", "train/demo.yaml"]
    assert len(read_samples(repo / "runs/demo/logs/cpu_busy.jsonl")) >= 2  # sampled while the script ran
    assert "ratio: wall / (generation + training)" in capsys.readouterr().out
    assert reports == [["report", str(repo / "runs" / "demo")]]  # python -m optima report RUN_DIR
    assert demo.main(["--recipe", "train/fail.yaml"]) == 5 and len(reports) == 1


def test_demo_names_a_recipe_without_output_dir(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(demo, "REPO", tmp_path)
    (tmp_path / "r.yaml").write_text("sample_count: 3\n")
    assert demo.main(["--recipe", "r.yaml"]) == 2
    assert f"{tmp_path / 'r.yaml'}: output_dir: missing" in caplog.text
