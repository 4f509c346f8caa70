"""How to use the cores during generation + LM-loss scoring: the arrangements side by side, same questions.

    .venvs/train/bin/python -m bench.serving                                   # 6 ARC questions x 4, demo settings
    .venvs/train/bin/python -m bench.serving --only both two beside_pinned beside --rounds 2 --json /tmp/s.json

Arrangements (each generates the same conversations with the demo's recipe (``train/sft_recipes/demo_arc.yaml``,
iteration 0) and SmolLM2, and has every utterance's LM loss scored; the loss model is the policy model, as at
iteration 0 of the demo):

* ``after``: one policy server with vLLM's automatic binding (its OpenMP threads on core 0, core 1 left to the
  engine loop); generation, then scoring on that server (the ``loss_placement: after`` flow; from iteration 1 on
  it also pays a loss-server start-up, not counted here);
* ``both``: one policy server whose OpenMP threads use both cores; scoring after generation on it;
* ``two``: two single-core policy replicas (cores 0 and 1), each with its API server and engine core pinned to
  the other core; conversations alternate between them; scoring after generation on both;
* ``beside``: policy OpenMP threads on core 0, a loss server's on core 1, API servers and engine cores wherever
  the kernel puts them; each conversation is scored as soon as it finishes (``loss_placement: beside``);
* ``beside_pinned``: the same, with both servers' API server and engine core pinned to core 1 (the policy's
  compute core is left to its worker);
* ``beside_unbound``: the same two servers, both with vLLM's automatic binding.

Every policy server gets a ``--policy-kv-gb`` KV cache and the loss server ``--loss-kv-gb`` (sized from the memory
available, as a run does, they would differ with the load on the box, and so would the conversations in flight).
For each: start-up, generation seconds, scoring seconds not hidden behind generation, total, and a hash of the
conversations (every arrangement must write the same ones: requests are seeded). ``--rounds`` interleaves the
arrangements (A, B, C, A, B, C); the load average is recorded before and after. With ``beside``: the CPU time an
idle loss server takes over ``--idle-window`` seconds. ``restart``: a policy start-up against loading new weights
into the running process (``sleep_mode: true``). ``threads``: the same questions on one server with ``--threads``
and with 4 conversations in flight; the two hashes must be equal (more in flight changes timing, not outputs).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.benchlib import REPO, add_model_args
from optima.agents.generation import GenerationHooks, generate_conversations, generation_settings
from optima.config import SFTRecipe, load_recipe
from optima.environments import resolve_env
from optima.hardware import Placement, ServerLayout, allocate_this_machine
from optima.lm_loss import StreamingLosses, VLLMLossScorer, conversation_texts
from optima.logging_utils import setup_logging
from optima.paths import RunPaths
from optima.serving.holder import ServerHolder
from optima.serving.processes import group_members
from optima.store import load_records
from optima.tasks import TASKS

ARRANGEMENTS = ("after", "both", "two", "beside", "beside_pinned", "beside_unbound", "restart", "threads")
AFTER = ("after", "both", "two", "restart", "threads")  # arrangements that score on the policy server(s)
# Placements each arrangement forces (the others: the one the run itself would plan from the recipe).
LAYOUTS = {
    "both": ServerLayout((Placement(cpu_bind="0,1"),), None),
    "two": ServerLayout((Placement(cpu_bind="0", service_bind="1"), Placement(cpu_bind="1", service_bind="0")), None),
    "beside": ServerLayout((Placement(cpu_bind="0"),), Placement(cpu_bind="1")),
    "beside_pinned": ServerLayout(
        (Placement(cpu_bind="0", service_bind="1"),), Placement(cpu_bind="1", service_bind="1")
    ),
    "beside_unbound": ServerLayout((Placement(),), Placement()),
}
DEMO_RECIPE = REPO / "train/sft_recipes/demo_arc.yaml"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--idle-window", type=float, default=10.0)
    parser.add_argument("--only", nargs="+", choices=ARRANGEMENTS, default=["after", "both", "two", "beside"])
    parser.add_argument("--policy-kv-gb", type=int, default=3, help="KV cache of every policy server (GiB)")
    parser.add_argument("--loss-kv-gb", type=int, default=1, help="KV cache of the loss server (GiB)")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def build_recipe(args, run_dir: Path, name: str, **extra):
    """The demo's recipe, with this benchmark's questions, threads, port and run folder."""
    values = {
        "initial_model_path": args.model,
        "data_dir": args.data_dir,
        "origin_yaml_path": str(REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml"),
        "output_dir": str(run_dir),
        "port": args.port,
        "thread_count": args.threads,
        "explore_count": args.samples,
        "request_timeout_s": 600.0,
        "loss_placement": "after" if name in AFTER else "beside",
    }
    return load_recipe(SFTRecipe, DEMO_RECIPE, values | extra)


def conversations_sha1(path: Path) -> str:
    """Hash of every conversation's utterances, by question and sample (independent of the order written)."""
    records = sorted(load_records(path)[0], key=lambda r: (str(r["task_id"]), r["sample_index"]))
    text = json.dumps([[r["task_id"], r["sample_index"], conversation_texts(r)] for r in records])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


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


def new_holder(args, recipe: SFTRecipe, run_dir: Path, arrange=lambda layout: layout) -> ServerHolder:
    """The servers of ``recipe``, placed as the hardware allocation of this machine says (``arrange`` changes them)."""
    layout = arrange(allocate_this_machine(recipe).layout)
    return ServerHolder(recipe, resolve_env(None, "vllm"), args.model, run_dir / "logs", layout=layout)


def measure_restart(args) -> dict:
    """Seconds to start a policy server, and to load weights into it instead (no restart)."""
    run_dir = Path(tempfile.mkdtemp(prefix="optima_serving_restart_"))
    recipe = build_recipe(args, run_dir, "restart", sleep_mode=True)
    stage = RunPaths.from_recipe(recipe).stage(0)
    with new_holder(args, recipe, run_dir) as holder:
        started = time.monotonic()
        holder.serve(args.model, stage)
        start_s = time.monotonic() - started
        holder.release_for_training()
        groups = child_groups(os.getpid())  # the policy (no loss server in this arrangement)
        idle = idle_cpu_share(groups, args.idle_window) if args.idle_window > 0 else None
        started = time.monotonic()
        holder.serve(args.model, stage)
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


def generate_and_score(name: str, recipe, examples, tokenizer, holder: ServerHolder, stage) -> dict:
    """Generation with the LM-loss scoring of this arrangement; seconds, tokens and the conversations' hash."""
    result: dict = {}
    model = str(recipe.initial_model_path)
    urls = holder.serve(model, stage)
    loss_urls = holder.loss_urls() or urls
    scorer = VLLMLossScorer(loss_urls, recipe.served_model_name, tokenizer, recipe)
    generation = generation_settings(recipe, 0)
    if name in AFTER:
        stats = generate_conversations(recipe, examples, urls, stage.generations, generation)
        scored = time.monotonic()
        scorer.score([t for record in load_records(stage.generations)[0] for t in conversation_texts(record)])
        result["scoring_not_hidden_s"] = round(time.monotonic() - scored, 1)
    else:
        with StreamingLosses(scorer.score, stage.losses, model) as stream:
            out = stage.generations
            stats = generate_conversations(
                recipe, examples, urls, out, generation, GenerationHooks(on_record=stream.submit)
            )
            result["scoring_not_hidden_s"] = stream.finish()["wait_s"]
    result["generation_s"] = round(stats.elapsed_s, 1)
    result["generated_tokens"] = stats.generated_tokens
    result["tokens_per_s"] = round(stats.tokens_per_s, 1)
    result["total_s"] = round(result["generation_s"] + result["scoring_not_hidden_s"], 1)
    result["conversations_sha1"] = conversations_sha1(stage.generations)
    return result


def measure_threads(args, examples, tokenizer) -> dict:
    """The same conversations on one server with ``--threads`` and with 4 in flight (their hashes must match)."""
    result: dict = {"arrangement": "threads"}
    for threads in (args.threads, 4):
        run_dir = Path(tempfile.mkdtemp(prefix=f"optima_serving_threads{threads}_"))
        recipe = build_recipe(args, run_dir, "threads", thread_count=threads)
        stage = RunPaths.from_recipe(recipe).stage(0)
        with new_holder(args, recipe, run_dir, lambda layout: fixed_kv(layout, args)) as holder:
            run = generate_and_score("threads", recipe, examples, tokenizer, holder, stage)
        result[f"sha1_threads_{threads}"] = run["conversations_sha1"]
        result[f"generation_s_threads_{threads}"] = run["generation_s"]
    result["identical"] = result[f"sha1_threads_{args.threads}"] == result["sha1_threads_4"]
    return result


def run_arrangement(args, name: str, examples, tokenizer) -> dict:
    if name == "restart":
        return measure_restart(args)
    if name == "threads":
        return measure_threads(args, examples, tokenizer)
    run_dir = Path(tempfile.mkdtemp(prefix=f"optima_serving_{name}_"))
    recipe = build_recipe(args, run_dir, name)
    holder = new_holder(args, recipe, run_dir, lambda layout: fixed_kv(LAYOUTS.get(name, layout), args))
    result: dict = {"arrangement": name, "layout": str(holder.layout), "load_before": load_average()}
    stage = RunPaths.from_recipe(recipe).stage(0)
    with holder:
        started = time.monotonic()
        holder.serve(str(recipe.initial_model_path), stage)
        holder.loss_urls()
        result["startup_s"] = round(time.monotonic() - started, 1)
        result |= generate_and_score(name, recipe, examples, tokenizer, holder, stage)
        if name == "beside" and args.idle_window > 0:
            result["idle_loss_server_cpu_per_s"] = idle_cpu_share([holder.loss.server.pgid], args.idle_window)
    result["load_after"] = load_average()
    return result


def fixed_kv(layout: ServerLayout, args) -> ServerLayout:
    """The same KV caches in every arrangement (sized from the memory available, they would differ with the load)."""
    policy = tuple(dataclasses.replace(p, cpu_kvcache_gb=args.policy_kv_gb) for p in layout.policy)
    loss = dataclasses.replace(layout.loss, cpu_kvcache_gb=args.loss_kv_gb) if layout.loss else None
    return ServerLayout(policy, loss)


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def print_results(args, results: list[dict]) -> None:
    print(f"{args.questions} questions x {args.samples} | demo recipe | {args.rounds} round(s), interleaved")
    keys = ["arrangement", "startup_s", "generation_s", "scoring_not_hidden_s", "total_s", "tokens_per_s",
            "generated_tokens", "conversations_sha1", "load_before", "load_after"]  # fmt: skip
    print(" | ".join(keys))
    for row in results:
        if row["arrangement"] not in ("restart", "threads"):
            print(" | ".join(str(row.get(k)) for k in keys))
    for row in results:
        if "idle_loss_server_cpu_per_s" in row:
            print(f"idle loss server: {row['idle_loss_server_cpu_per_s']} CPU-seconds per second")
        if row["arrangement"] in ("restart", "threads"):
            print(json.dumps(row))


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    examples = TASKS["arc"].load_train(data_dir=args.data_dir)[: args.questions]
    results = []
    for _ in range(args.rounds):
        for name in args.only:
            results.append(run_arrangement(args, name, examples, tokenizer))
            print(json.dumps(results[-1]), flush=True)  # each row as it comes: a long run may be cut short
            if args.json:
                Path(args.json).write_text(json.dumps({"settings": vars(args), "results": results}, indent=2) + "\n")
    print_results(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
