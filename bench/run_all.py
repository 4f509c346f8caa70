"""Run every benchmark with small settings and write ``bench/RESULTS.md`` (9-10 min on a quiet 2-core box).

    .venvs/train/bin/python -m bench.run_all
    .venvs/train/bin/python -m bench.run_all --only iteration scoring
    .venvs/train/bin/python -m bench.run_all --render        # rewrite RESULTS.md from bench/results.json only

Each benchmark runs as its own subprocess, one after the other (so at most one vLLM server is up at a time),
while a sampler here records the peak summed ``VmRSS`` of its whole process tree (benchmark, vLLM server,
trainer launches). ``iteration``, ``scoring`` and ``sft`` hand their numbers over as JSON; ``generation``'s
printed summary is parsed. Their outputs and logs go to ``runs/bench/<date>_<random>/``.

Every run merges the results of the benchmarks it ran into ``bench/results.json`` (each with the date it ran) and
rewrites the whole generated part of RESULTS.md from it, the headline included (machine, targets): no line there
is left from an older run, and every path it names is relative to the repository. What follows the marker
(``KEPT_MARKER``, measured by hand with the commands given there) is kept as it is.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.benchlib import REPO, TreeMemorySampler, describe_machine, load_average, shown
from bench.report import render_results

PYTHON = sys.executable
# Sections after this line come from longer, one-off measurements (commands given there); run_all keeps them.
KEPT_MARKER = "<!-- measured separately: run_all.py keeps what follows -->"
# Small settings that keep a full run near 20 minutes on this box (see each script for its defaults).
BENCHMARKS = {
    "iteration": ["-m", "dev.times"],
    "scoring": ["bench/scoring.py", "--conversations", "48", "--rounds", "2"],
    "sft": ["bench/sft.py", "--max-steps", "3", "--rounds", "3"],
    "generation": ["bench/generation.py", "--questions", "12", "--samples", "2"],
    # Information exchange: HotpotQA's long private contexts, 6 turns, the default KV sizing and in-flight bound.
    "generation_ie": ["bench/generation.py", "--task", "hotpot_qa", "--questions", "6", "--samples", "2",
                      "--max-turns", "6", "--max-tokens", "128", "--threads", "64"],
}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--run-dir", default=str(REPO / "runs" / "demo_arc_sft"))
    parser.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    parser.add_argument("--results", default=str(REPO / "bench" / "results.json"), help="the merged results")
    parser.add_argument("--render", action="store_true", help="only rewrite --out from --results (no benchmark)")
    return parser.parse_args(argv)


def parse_generation(stdout: str) -> dict:
    """Numbers from ``bench/generation.py``'s printed summary."""
    found = {}
    patterns = {
        "generator": r"conversation generator: (\d+) tokens in ([\d.]+) s = ([\d.]+) tok/s",
        "plain": r"plain concurrent client: (\d+) tokens in ([\d.]+) s = ([\d.]+) tok/s",
    }
    for name, pattern in patterns.items():
        match = re.search(pattern, stdout)
        if match:
            found[name] = {"tokens": int(match[1]), "seconds": float(match[2]), "tokens_per_s": float(match[3])}
    ratio = re.search(r"ratio generator / plain: ([\d.]+)", stdout)
    setting = re.search(r"^model .*$", stdout, re.MULTILINE)
    found["ratio"] = float(ratio[1]) if ratio else None
    found["setting"] = setting[0] if setting else ""
    metrics = re.search(r"hit rate \(vLLM /metrics\): generator ([\d.]+|None), plain ([\d.]+|None)", stdout)
    if metrics:
        found["hit_rate"] = {
            side: float(v) if v != "None" else None
            for side, v in zip(("generator", "plain"), metrics.groups(), strict=True)
        }
    for first in (2, 3):
        match = re.search(rf"hit rate over turns {first}\.\.N: ([\d.]+)", stdout)
        if match:
            found[f"hit_rate_turns_{first}_n"] = float(match[1])
    by_turn = re.search(r"hit rate by turn \(share of prompt tokens\): (.*)$", stdout, re.MULTILINE)
    found["hit_rate_by_turn"] = by_turn[1] if by_turn else ""
    return found


def run_benchmark(name: str, args, workdir: Path) -> dict:
    """Run one benchmark script; its parsed results, wall time, exit code and the tree's peak memory."""
    argv = [PYTHON, *BENCHMARKS[name]]  # run in the repository: its paths are given relative to it
    json_path = workdir / f"{name}.json"
    if name == "iteration":
        argv += [shown(args.run_dir)]
    if not name.startswith("generation"):
        argv += ["--json", shown(json_path)]
    log_path = workdir / f"{name}.log"
    load_before, date = load_average(), time.strftime("%Y-%m-%d %H:%M")
    print(f"{name}: {' '.join(argv[1:])} (log {shown(log_path)}) | load {load_before}", flush=True)
    started = time.monotonic()
    with TreeMemorySampler(include_self=False) as memory, log_path.open("w") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, check=False).returncode
    wall = time.monotonic() - started
    output = log_path.read_text(errors="replace")
    if code != 0:
        data = {"error": f"exit code {code}", "tail": output.splitlines()[-20:]}
    elif name.startswith("generation"):
        data = parse_generation(output)
    else:
        data = json.loads(json_path.read_text())
    summary = [ln for ln in output.splitlines() if not re.match(r"^\d{4}-\d\d-\d\d ", ln) and "%|" not in ln]
    print("\n".join(summary[-8:]), flush=True)
    return {
        "data": data,
        "command": " ".join([".venvs/train/bin/python", *argv[1:]]),
        "wall_s": round(wall, 1),
        "tree_peak_rss_mib": round(memory.peak_mib),
        "date": date,
        "outputs": shown(workdir),
        "load_before": load_before,
        "load_after": load_average(),
    }


def write_results(path: Path, rendered: str) -> None:
    """Write RESULTS.md, keeping the measured-by-hand sections below ``KEPT_MARKER`` of the file that is there."""
    kept = ""
    if path.exists() and KEPT_MARKER in path.read_text():
        kept = path.read_text()[path.read_text().index(KEPT_MARKER) :]
    path.write_text(rendered.rstrip("\n") + "\n\n" + kept if kept else rendered)


def merge_results(path: Path, results: dict, machine: dict) -> dict:
    """The stored results (``bench/results.json``) with this run's benchmarks replaced; written back."""
    saved = json.loads(path.read_text()) if path.exists() else {"results": {}}
    missing = [name for name in BENCHMARKS if name not in saved["results"] and name not in results]
    if missing:
        raise SystemExit(f"{shown(path)} has no results of {missing}: run them (or all) first")
    merged = {"results": saved["results"] | results, "meta": {"machine": machine}}
    path.write_text(json.dumps(merged, indent=2) + "\n")
    return merged


def main(argv=None) -> int:
    args = parse_args(argv)
    results_path, out = Path(args.results), Path(args.out)
    if args.render:  # report wording changed: no need to measure again
        saved = json.loads(results_path.read_text())
        write_results(out, render_results(saved["results"], saved["meta"]))
        return 0
    bench_runs = REPO / "runs" / "bench"
    bench_runs.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M_"), dir=bench_runs))
    machine = describe_machine()
    started = time.monotonic()
    results = {name: run_benchmark(name, args, workdir) for name in args.only}
    (workdir / "results.json").write_text(json.dumps({"results": results}, indent=2) + "\n")
    merged = merge_results(results_path, results, machine)
    write_results(out, render_results(merged["results"], merged["meta"]))
    print(f"wrote {shown(out)} and {shown(results_path)} ({time.monotonic() - started:.0f} s in all)")
    return 0 if all("error" not in r["data"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
