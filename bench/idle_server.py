"""Does an idle vLLM server kept through training slow the trainer? SFT launches with the servers idle or frozen.

    .venvs/train/bin/python -m bench.idle_server                   # SmolLM2, demo layout, max_steps 3, 2 rounds
    .venvs/train/bin/python -m bench.idle_server --rounds 1 --max-steps 1

The servers of the CPU demo start once, as a run places them (``ServerHolder`` with the hardware allocation's layout:
policy bound to core 0, the loss server to core 1 on two cores), each answers one request (so that its threads
exist, as after generation), and then stay up while the pipeline's SFT launch (``bench/sft.py``'s ``ours`` side:
``run_sft.py`` under ``accelerate launch``) trains ``--max-steps`` steps. Sides, alternating in every round:

* ``frozen``: both servers stopped with SIGSTOP (no CPU time at all; their memory stays, so only the CPU differs);
* ``loss idle``: the loss server idle, the policy frozen (before the policy was kept: it was stopped for training);
* ``both idle``: the policy kept idle beside the loss server (``sleep_mode`` on CPU).

Prints TRL's ``train_runtime`` and the launch's wall time per run, the servers' CPU seconds during each run, and
the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
from pathlib import Path

from bench.benchlib import REPO, add_model_args, load_average
from bench.serving import child_groups, cpu_seconds
from bench.sft import BASE_YAML, run_side, write_configs
from optima.config import SFTRecipe, load_recipe
from optima.environments import resolve_env
from optima.hardware import place_servers
from optima.paths import RunPaths
from optima.serving.holder import ServerHolder

SIDES = ("frozen", "loss idle", "both idle")
DEMO_RECIPE = REPO / "train" / "sft_recipes" / "demo_arc.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser, data_dir=False)
    parser.add_argument("--dataset", required=True, help="an SFT dataset folder (a run's iteration_N/dataset)")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8400)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def touch(urls: list[str], model: str) -> None:
    """One short request, so that the server's compute threads have run (as after a generation stage)."""
    from openai import OpenAI

    with OpenAI(base_url=urls[0], api_key="EMPTY", timeout=300) as client:
        client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0.0)


def signal_groups(groups: list[int], sig: signal.Signals) -> None:
    for group in groups:
        os.killpg(group, sig)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.base_yaml = str(BASE_YAML)
    workdir = Path(tempfile.mkdtemp(prefix="optima_bench_idle_"))
    config = write_configs(args, workdir)["ours"]
    values = {"initial_model_path": args.model, "output_dir": str(workdir / "run"), "port": args.port}
    recipe = load_recipe(SFTRecipe, DEMO_RECIPE, values)
    layout = place_servers(recipe, [], sorted(os.sched_getaffinity(0)))
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with ServerHolder(recipe, resolve_env(None, "vllm"), args.model, workdir / "logs", layout=layout) as holder:
        touch(holder.serve(args.model, RunPaths.from_recipe(recipe).stage(0)), recipe.served_model_name)
        touch(holder.loss_urls(), recipe.served_model_name)
        holder.release_for_training()  # the kept policy idles
        loss = [holder.loss.server.pgid]
        policy = [group for group in child_groups(os.getpid()) if group not in loss]
        for round_index in range(args.rounds):
            for side in SIDES:
                frozen = {"frozen": loss + policy, "loss idle": policy, "both idle": []}[side]
                signal_groups(frozen, signal.SIGSTOP)
                try:
                    before, cpu = load_average(), cpu_seconds(loss + policy)
                    result = run_side("ours", config, workdir / f"{side.replace(' ', '_')}_{round_index}.log")
                    result |= {"server_cpu_s": round(cpu_seconds(loss + policy) - cpu, 2)}
                    result |= {"load_before": before, "load_after": load_average()}
                finally:
                    signal_groups(frozen, signal.SIGCONT)
                runs[side].append(result)
                print(
                    f"round {round_index + 1} | {side:9s} | train {result['train_runtime']:.1f} s | wall "
                    f"{result['wall_s']:.1f} s | servers' CPU {result['server_cpu_s']} s | load {before} -> "
                    f"{result['load_after']}",
                    flush=True,
                )
    summary = {side: {"train_runtime_s": [round(r["train_runtime"], 1) for r in rs]} for side, rs in runs.items()}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "max_steps": args.max_steps}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
