"""How to use the cores during generation + LM-loss scoring: the arrangements side by side, same questions.

    .venvs/train/bin/python bench/serving.py                                   # 12 ARC questions x 4, demo settings
    .venvs/train/bin/python bench/serving.py --questions 24 --only beside after --json /tmp/serving.json

Arrangements (each generates the same conversations' worth of work with SmolLM2, then has every utterance's LM
loss scored; the loss model is the policy model, as at iteration 0 of the demo):

* ``after``: one policy server with vLLM's automatic binding (its OpenMP threads on one core, the other core
  left to the engine loop); generation, then scoring on that server (the ``loss_placement: after`` flow; from
  iteration 1 on it also pays a loss-server start-up, reported separately);
* ``beside``: policy OpenMP threads on core 0, a loss server's on core 1; each conversation is scored as soon as it
  finishes (``loss_placement: beside``, the default);
* ``beside_unbound``: the same two servers, both with vLLM's automatic binding.

For each: start-up of the servers, generation seconds, scoring seconds not hidden behind generation, total; and,
once, the CPU time that idle servers take over ``--idle-window`` seconds (does the loss server cost anything
while it waits through training?). ``restart``: what a policy start-up costs against loading new weights into the
running process (``sleep_mode: true``; the same checkpoint is reloaded, which costs what a new one would).
One pass per arrangement: on a shared box, read them as indications.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchlib import add_model_args  # noqa: E402

from optima.agents.generation import GenerationPlan, generate_conversations  # noqa: E402
from optima.config import SFTRecipe, load_recipe  # noqa: E402
from optima.environments import resolve_env  # noqa: E402
from optima.lm_loss import VLLMLossScorer  # noqa: E402
from optima.logging_utils import setup_logging  # noqa: E402
from optima.loss_stream import StreamingLosses, conversation_texts  # noqa: E402
from optima.paths import RunPaths  # noqa: E402
from optima.serving.holder import ServerHolder  # noqa: E402
from optima.serving.layout import ServerLayout  # noqa: E402
from optima.serving.processes import group_members  # noqa: E402
from optima.serving.vllm_server import Placement  # noqa: E402
from optima.store import load_records  # noqa: E402
from optima.tasks import TASKS  # noqa: E402

ARRANGEMENTS = ("after", "beside", "beside_unbound", "restart")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--idle-window", type=float, default=10.0)
    parser.add_argument("--only", nargs="+", choices=ARRANGEMENTS, default=list(ARRANGEMENTS))
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def build_recipe(args, run_dir: Path, placement: str, **extra):
    values = {
        "dataset_type": "arc",
        "initial_model_path": args.model,
        "origin_yaml_path": str(REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml"),
        "output_dir": str(run_dir),
        "port": args.port,
        "thread_count": args.threads,
        "max_turns": args.max_turns,
        "max_tokens": args.max_tokens,
        "request_timeout_s": 600.0,
        "loss_placement": "after" if placement in ("after", "restart") else "beside",
    }
    return load_recipe(SFTRecipe, None, values | extra)


def cpu_seconds(pgids: list[int]) -> float:
    """User + system CPU time of every live process of the groups."""
    total = 0
    for pgid in pgids:
        for pid in group_members(pgid):
            try:
                fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


def idle_cpu_share(pgids: list[int], window_s: float) -> float:
    """CPU seconds per second the servers use while nobody sends them anything (a measurement window)."""
    before, started = cpu_seconds(pgids), time.monotonic()
    deadline = started + window_s
    while time.monotonic() < deadline:
        time.sleep(min(0.5, max(deadline - time.monotonic(), 0)))  # poll to the window's end
    return round((cpu_seconds(pgids) - before) / (time.monotonic() - started), 3)


def ready_seconds(holder: ServerHolder) -> dict:
    servers = [s for s in (holder.loss.server if holder.loss else None,) if s is not None]
    return {"loss_server_ready_s": round(servers[0]._ready_after, 1)} if servers else {}


def measure_restart(args) -> dict:
    """Seconds to start a policy server, and to load weights into it instead (no restart)."""
    run_dir = Path(tempfile.mkdtemp(prefix="optima_serving_restart_"))
    recipe = build_recipe(args, run_dir, "restart", sleep_mode=True)
    stage = RunPaths.from_recipe(recipe).stage(0)
    with ServerHolder(recipe, resolve_env(None, "vllm"), args.model, run_dir / "logs") as holder:
        started = time.monotonic()
        holder.endpoints(args.model, stage)
        start_s = time.monotonic() - started
        holder.sleep_for_training()
        groups = child_groups(os.getpid())  # the policy (no loss server in this arrangement)
        idle = idle_cpu_share(groups, args.idle_window) if args.idle_window > 0 else None
        started = time.monotonic()
        holder.endpoints(args.model, stage)
        reload_s = time.monotonic() - started
    return {"arrangement": "restart", "start_s": round(start_s, 1), "reload_s": round(reload_s, 2),
            "idle_policy_cpu_per_s": idle}  # fmt: skip


def child_groups(parent: int) -> list[int]:
    """Process groups led by live children of ``parent`` (the servers this process started)."""
    groups = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split() if entry.name.isdigit() else None
        except OSError:
            continue
        if fields and fields[0] != "Z" and int(fields[1]) == parent and int(fields[2]) == int(entry.name):
            groups.append(int(entry.name))
    return groups


def run_arrangement(args, name: str, examples, tokenizer) -> dict:
    if name == "restart":
        return measure_restart(args)
    run_dir = Path(tempfile.mkdtemp(prefix=f"optima_serving_{name}_"))
    recipe = build_recipe(args, run_dir, name)
    holder = ServerHolder(recipe, resolve_env(None, "vllm"), args.model, run_dir / "logs")
    if name == "beside_unbound":
        holder.layout = ServerLayout((Placement(),), Placement())
    stage = RunPaths.from_recipe(recipe).stage(0)
    plan = GenerationPlan(iteration=0, temperature=0.3, samples=args.samples, stage="bench")
    result: dict = {"arrangement": name, "layout": str(holder.layout)}
    with holder:
        started = time.monotonic()
        urls = holder.endpoints(args.model, stage)
        loss_urls = holder.loss_endpoints() or urls
        result["startup_s"] = round(time.monotonic() - started, 1)
        result |= ready_seconds(holder)
        scorer = VLLMLossScorer(loss_urls, recipe.served_model_name, tokenizer, recipe, 4 * recipe.loss_batch_size)
        if name == "after":
            stats = generate_conversations(recipe, examples, urls, stage.generations, plan)
            scored = time.monotonic()
            texts = [t for record in load_records(stage.generations)[0] for t in conversation_texts(record)]
            scorer.score(texts)
            result["scoring_not_hidden_s"] = round(time.monotonic() - scored, 1)
        else:
            with StreamingLosses(scorer.score, stage.losses, args.model) as stream:
                out = stage.generations
                stats = generate_conversations(recipe, examples, urls, out, plan, on_record=stream.submit)
                result["scoring_not_hidden_s"] = stream.finish()["wait_s"]
        result["generation_s"] = round(stats.elapsed_s, 1)
        result["generated_tokens"] = stats.generated_tokens
        result["tokens_per_s"] = round(stats.tokens_per_s, 1)
        result["total_s"] = round(result["generation_s"] + result["scoring_not_hidden_s"], 1)
        if name == "beside" and args.idle_window > 0:
            groups = [holder.loss.server.pgid]
            result["idle_loss_server_cpu_per_s"] = idle_cpu_share(groups, args.idle_window)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    examples = TASKS["arc"].load_train(data_dir=args.data_dir)[: args.questions]
    results = [run_arrangement(args, name, examples, tokenizer) for name in args.only]
    print(f"{args.questions} questions x {args.samples} | {args.max_turns} turns x {args.max_tokens} tokens")
    keys = ["arrangement", "startup_s", "generation_s", "scoring_not_hidden_s", "total_s", "tokens_per_s"]
    print(" | ".join(keys))
    for row in results:
        if row["arrangement"] == "restart":
            continue
        print(" | ".join(str(row.get(k)) for k in keys))
    for row in results:
        if "idle_loss_server_cpu_per_s" in row:
            print(f"idle loss server: {row['idle_loss_server_cpu_per_s']} CPU-seconds per second")
        if row["arrangement"] == "restart":
            print(f"policy start-up {row['start_s']} s | weight reload {row['reload_s']} s (no restart) | idle kept "
                  f"policy {row['idle_policy_cpu_per_s']} CPU-seconds per second")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
