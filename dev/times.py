"""Per-iteration cost of a finished iSFT run, read from its folder (``logs/driver.log``, each
``iteration_<i>/manifest.json`` and, when sampled, ``logs/cpu_busy.jsonl``).

    python -m dev.times runs/demo_arc_sft [--baseline OLD_RUN] [--json times.json]
    python -m dev.times runs/my_run -- python sft_script.py --train_config_path ...   # run it sampled, then time

Per iteration: wall (driver log, ``| generate`` to the iteration report; else the stages' ``elapsed_s``), the
generator's own time, LM-loss scoring not hidden behind generation (the wait for the last streamed losses plus the
score stage), TRL's ``train_runtime``, the servers' start-ups, the ratio wall / (generation + training) (target
<= 1.15 for the first iteration, <= 1.05 after) and the busy share of the cores (``dev.cpu_busy``; target >= 0.80).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from dev.cpu_busy import CpuSampler, busy_share, read_samples
from optima.logging_utils import setup_logging

REPO = Path(__file__).resolve().parent.parent
logger = logging.getLogger(__name__)

LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ ([\w.]+): (.*)$")
TARGET = 0.10
FIRST_RATIO_TARGET, RATIO_TARGET = 1.15, 1.05  # wall / (generation + training): the first iteration, the others
RUN_TARGET = 0.75  # whole-run wall time against the run before scoring while generating
BUSY_TARGET = 0.80  # share of the cores at work over the run
SAMPLES = Path("logs") / "cpu_busy.jsonl"


def read_driver_log(path: Path) -> list[tuple[datetime, str, str]]:
    """(time, logger, message) of every line of the driver log that has a timestamp."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text(errors="replace").splitlines():
        match = LINE.match(line)
        if match:
            events.append((datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f"), match[2], match[3]))
    return events


def find_event(events, start: int, predicate) -> int | None:
    """Index of the first event at or after ``start`` whose (logger, message) satisfies ``predicate``."""
    for index in range(start, len(events)):
        if predicate(events[index][1], events[index][2]):
            return index
    return None


def iteration_window(events, iteration: int) -> tuple[int, int] | None:
    """Indices of the iteration's first stage line and of its report line (``answer rate``)."""
    prefix = f"iteration {iteration + 1}/"
    first = find_event(events, 0, lambda _, m: m.startswith(prefix) and m.endswith("| generate"))
    if first is None:
        return None
    last = find_event(events, first, lambda _, m: m.startswith(prefix) and "| answer rate" in m)
    return (first, last) if last is not None else None


def seconds_between(events, a: int | None, b: int | None) -> float | None:
    if a is None or b is None:
        return None
    return (events[b][0] - events[a][0]).total_seconds()


def scoring_seconds(events, window: tuple[int, int]) -> float | None:
    """From the score stage's own first line (``score | ...``) to the select stage line."""
    start = find_event(events, window[0], lambda _, m: m.startswith("score |"))
    end = find_event(events, start or window[0], lambda _, m: m.endswith("| select"))
    if start is None or end is None or end > window[1]:
        return None
    return seconds_between(events, start, end)


def server_start_seconds(events, window: tuple[int, int]) -> float:
    """Sum of ``replica N ready after S s`` inside the window."""
    total = 0.0
    for _, name, message in events[window[0] : window[1] + 1]:
        match = re.search(r"ready after (\d+(?:\.\d+)?) s", message)
        if name.startswith("optima.serving") and match:
            total += float(match[1])
    return total


def busy_shares(events, window: tuple[int, int] | None, samples: list[dict]) -> dict:
    """Busy share of the iteration, of its generation (``| generate`` to ``| score``) and of its training (``| train``
    to the report); {} without samples or a driver-log window."""
    if not samples or window is None:
        return {}

    def share(a: int | None, b: int | None) -> float | None:
        if a is None or b is None:
            return None
        return rounded_share(samples, events[a][0].timestamp(), events[b][0].timestamp())

    score = find_event(events, window[0], lambda _, m: m.endswith("| score"))
    train = find_event(events, window[0], lambda _, m: m.endswith("| train"))
    return {
        "busy": share(*window),
        "busy_generation": share(window[0], score),
        "busy_training": share(train, window[1]),
    }


def measure_iteration(manifest: dict, events, iteration: int, samples: list[dict] = ()) -> dict:
    """Wall time, work time (generation, scoring, training) and the overhead breakdown of one iteration."""
    stages = {name: entry for name, entry in manifest["stages"].items() if "result" in entry}  # finished ones only
    elapsed = {name: entry["elapsed_s"] for name, entry in stages.items()}
    window = iteration_window(events, iteration)
    wall = seconds_between(events, *window) if window else sum(elapsed.values())
    generated = stages["generate"]["result"]
    generation = generated["elapsed_s"]
    scoring = scoring_seconds(events, window) if window else None
    if scoring is None:
        scoring = elapsed.get("score", 0.0)  # no log: the whole stage counts as scoring (overhead understated)
    scoring += generated.get("loss_stream", {}).get("wait_s", 0.0)
    train = stages.get("train", {}).get("result", {})
    training = train.get("train_runtime", 0.0)
    work = generation + scoring + training
    overhead = wall - work
    return {
        "iteration": iteration,
        "wall_s": round(wall, 1),
        "generation_s": round(generation, 1),
        "scoring_s": round(scoring, 1),
        "training_s": round(training, 1),
        "ratio": round(wall / (generation + training), 3) if generation + training > 0 else None,
        "overhead_s": round(overhead, 1),
        "overhead_share": round(overhead / wall, 4),
        "server_start_s": server_start_seconds(events, window) if window else None,
        "train_launch_s": round(elapsed.get("train", 0.0) - training, 1),
        "select_s": elapsed.get("select", 0.0),
        "work_scale_for_target": round(overhead * (1 - TARGET) / (TARGET * work), 2) if work > 0 else None,
        "wall_from": "driver log" if window else "manifest (sum of stages)",
    } | busy_shares(events, window, list(samples))


def run_wall_seconds(events) -> float | None:
    """First driver log line to ``done | final model`` (the whole run as the driver saw it)."""
    done = find_event(events, 0, lambda name, m: m.startswith("done | final model"))
    return seconds_between(events, 0, done) if events else None


def run_busy_share(events, samples: list[dict]) -> float | None:
    """Busy share from the first driver log line to ``done | final model`` (all samples without a driver log)."""
    if not samples:
        return None
    done = find_event(events, 0, lambda name, m: m.startswith("done | final model"))
    start = events[0][0].timestamp() if events else None
    end = events[done][0].timestamp() if done is not None else None
    return rounded_share(samples, start, end)


def rounded_share(samples: list[dict], start: float | None, end: float | None) -> float | None:
    """``busy_share`` between the two instants, to three decimals (None: too few samples)."""
    value = busy_share(samples, start, end)
    return round(value, 3) if value is not None else None


def ratio_target(iteration: int) -> float:
    """The ratio's target: the first iteration starts both servers, the later ones reuse them."""
    return FIRST_RATIO_TARGET if iteration == 0 else RATIO_TARGET


def measure_run(run_dir: Path) -> dict:
    events = read_driver_log(run_dir / "logs" / "driver.log")
    samples = read_samples(run_dir / SAMPLES)
    manifests = sorted(run_dir.glob("iteration_*/manifest.json"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not manifests:
        raise ValueError(f"{run_dir}: no iteration_<i>/manifest.json (is it an iSFT run directory?)")
    rows = []
    for path in manifests:
        iteration = int(path.parent.name.split("_")[1])
        manifest = json.loads(path.read_text())
        if "result" not in manifest["stages"].get("generate", {}):
            logger.info("%s: iteration %d has not finished generating; it is left out", run_dir, iteration + 1)
            continue
        rows.append(measure_iteration(manifest, events, iteration, samples))
    if not rows:
        raise ValueError(f"{run_dir}: no iteration has finished generating yet (rerun when one has)")
    total_wall = sum(r["wall_s"] for r in rows)
    total_overhead = sum(r["overhead_s"] for r in rows)
    return {
        "run_dir": str(run_dir),
        "run_wall_s": run_wall_seconds(events),
        "busy": run_busy_share(events, samples),
        "iterations": rows,
        "overhead_share_total": round(total_overhead / total_wall, 4),
        "target_met": all(r["overhead_share"] <= TARGET for r in rows),
        "ratio_target_met": all(r["ratio"] is not None and r["ratio"] <= ratio_target(r["iteration"]) for r in rows),
    }


def render_times(result: dict) -> str:
    """The table of ``measure_run``'s result and its target lines."""
    columns = ["iteration", "wall_s", "generation_s", "training_s", "scoring_s", "server_start_s", "ratio"]
    columns += ["overhead_s", "overhead_share", "train_launch_s", "select_s"]
    if result["busy"] is not None:
        columns += ["busy", "busy_generation", "busy_training"]
    lines = ["scoring_s: LM-loss scoring not hidden behind generation; ratio: wall / (generation + training)"]
    lines.append(" | ".join(columns))
    for row in result["iterations"]:
        lines.append(" | ".join(f"{row[c]:.1%}" if c == "overhead_share" else str(row.get(c)) for c in columns))
    overall = f"{result['overhead_share_total']:.1%}"
    lines.append(f"run wall (driver log): {result['run_wall_s']} s | overhead overall {overall}")
    if result["busy"] is not None:
        met = "met" if result["busy"] >= BUSY_TARGET else "MISSED"
        share = f"{result['busy']:.1%} (target >= {BUSY_TARGET:.0%}: {met})"
        lines.append(f"busy share of the cores over the run (/proc/stat): {share}")
    met = "met" if result["ratio_target_met"] else "MISSED"
    targets = f"<= {FIRST_RATIO_TARGET} first, <= {RATIO_TARGET} after"
    lines.append(f"target: wall / (generation + training) {targets}: {met}")
    if "baseline" in result:
        base = result["baseline"]
        met = "met" if base["wall_ratio"] is not None and base["wall_ratio"] <= RUN_TARGET else "MISSED"
        lines.append(
            f"whole run: {result['run_wall_s']} s vs {base['run_wall_s']} s ({base['run_dir']}): "
            f"{base['wall_ratio']}x (target <= {RUN_TARGET}x: {met})"
        )
    return "\n".join(lines)


def compare_with(result: dict, baseline_dir: Path) -> dict:
    """The baseline run's wall time and this run's fraction of it."""
    base = measure_run(baseline_dir)
    both = result["run_wall_s"] and base["run_wall_s"]
    ratio = round(result["run_wall_s"] / base["run_wall_s"], 3) if both else None
    return {"run_dir": str(baseline_dir), "run_wall_s": base["run_wall_s"], "wall_ratio": ratio, "run": base}


def run_sampled(command: list[str], run_dir: Path, cwd: Path | None = None) -> int:
    """Run ``command`` to its end while sampling ``/proc/stat`` into the run directory; its exit code."""
    with CpuSampler(run_dir / SAMPLES):
        return subprocess.call(command, cwd=cwd)


def print_times(run_dir: Path, baseline: Path | None = None, json_path: Path | None = None) -> int:
    """Measure ``run_dir`` (and its ``baseline``), print the table, write ``json_path``; 2 for no run there."""
    try:
        result = measure_run(run_dir)
        if baseline is not None:
            result["baseline"] = compare_with(result, baseline)
    except ValueError as error:
        logger.error("%s", error)
        return 2
    sys.stdout.write(render_times(result) + "\n")
    sys.stdout.flush()
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m dev.times``: with a command after ``--``, run it sampled first; then print the times."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(
        prog="python -m dev.times",
        description="time per iteration of a finished iSFT run (generation, training, start-ups, busy share)",
        usage="%(prog)s [RUN_DIR] [options] [-- COMMAND ...]",
    )
    parser.add_argument("run_dir", nargs="?", type=Path, default=REPO / "runs" / "demo_arc_sft")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here (bench/run_all.py)")
    parser.add_argument("--baseline", type=Path, default=None, help="a run directory of the same recipe to compare")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if command:
        code = run_sampled(command, args.run_dir)
        if code != 0:
            logger.error("%s exited with %d", " ".join(command), code)
            return code
    return print_times(args.run_dir, args.baseline, args.json)


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
