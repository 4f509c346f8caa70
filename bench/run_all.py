"""Run every benchmark with small settings and write ``bench/RESULTS.md`` (9-10 min on a quiet 2-core box).

    .venvs/train/bin/python bench/run_all.py
    .venvs/train/bin/python bench/run_all.py --only iteration scoring --out /tmp/RESULTS.md
    .venvs/train/bin/python bench/run_all.py --render /tmp/optima_bench_all_XXXX/results.json

Each benchmark runs as its own subprocess, one after the other (so at most one vLLM server is up at a time),
while a sampler here records the peak summed ``VmRSS`` of its whole process tree (benchmark, vLLM server,
trainer launches). ``iteration``, ``scoring`` and ``sft`` hand their numbers over as JSON; ``generation``'s
printed summary is parsed. The output files, and ``results.json`` with everything RESULTS.md shows, are kept in
a temporary folder named in RESULTS.md; ``--render <that folder>/results.json`` rewrites RESULTS.md from it.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import REPO, TreeMemorySampler, describe_machine, load_average  # noqa: E402
from report import render_results, update_sections  # noqa: E402

PYTHON = sys.executable
# Sections after this line come from longer, one-off measurements (commands given there); run_all keeps them.
KEPT_MARKER = "<!-- measured separately: run_all.py keeps what follows -->"
# Small settings that keep a full run near 20 minutes on this box (see each script for its defaults).
BENCHMARKS = {
    "iteration": ["-m", "optima", "times"],
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
    parser.add_argument("--render", default=None, help="only re-render --out from this earlier run's results.json")
    parser.add_argument(
        "--update", action="store_true", help="replace only the sections of --only in the existing --out"
    )
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
    argv = [PYTHON, *BENCHMARKS[name]]
    json_path = workdir / f"{name}.json"
    if name == "iteration":
        argv += [args.run_dir]
    if not name.startswith("generation"):
        argv += ["--json", str(json_path)]
    log_path = workdir / f"{name}.log"
    print(f"{name}: {' '.join(argv[1:])} (log {log_path}) | load {load_average()}", flush=True)
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
        "load_after": load_average(),
    }


def write_results(path: Path, rendered: str) -> None:
    """Write RESULTS.md, keeping the measured-by-hand sections below ``KEPT_MARKER`` of the file that is there."""
    kept = ""
    if path.exists() and KEPT_MARKER in path.read_text():
        kept = path.read_text()[path.read_text().index(KEPT_MARKER) :]
    path.write_text(rendered.rstrip("\n") + "\n\n" + kept if kept else rendered)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:  # report wording changed: no need to measure again
        saved = json.loads(Path(args.render).read_text())
        write_results(Path(args.out), render_results(saved["results"], saved["meta"]))
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="optima_bench_all_"))
    machine = describe_machine()
    load_before = load_average()
    started = time.monotonic()
    results = {name: run_benchmark(name, args, workdir) for name in args.only}
    meta = {
        "machine": machine,
        "load_before": load_before,
        "load_after": load_average(),
        "total_s": round(time.monotonic() - started, 1),
        "workdir": str(workdir),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    (workdir / "results.json").write_text(json.dumps({"results": results, "meta": meta}, indent=2) + "\n")
    out = Path(args.out)
    if args.update and out.exists():
        out.write_text(update_sections(out.read_text(), results, meta))
    else:
        write_results(out, render_results(results, meta))
    print(f"wrote {args.out} ({meta['total_s']:.0f} s in all)")
    return 0 if all("error" not in r["data"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
