"""The checks of ``make gpu-check`` that drive the run's own servers and saves on one GPU (training environment).

    .venvs/train/bin/python -m dev.gpu_stages wake-reload OUT   # what gpu-check runs; OUT: its --output-dir

Each ends with exit code 0 (PASS), 1 (FAIL, a ``FAIL: reason`` line or the traceback) or ``SKIP_EXIT`` (a ``SKIP:
reason`` line: this GPU cannot host the check):

* ``wake-reload`` (every iteration after the first): a kept policy replica serves the base model, sleeps as for
  training (``/is_sleeping`` must say so, at least half its GPU memory must come back), wakes with the iSFT
  checkpoint's weights in place and must answer the checkpoint's weights probe and a chat request.
* ``loss-beside-policy``: the loss server on GPU 0 beside the policy with the planned memory shares; the policy
  answers a chat request, the loss server LM-loss requests through the run's scorer.
* ``zero3-2proc`` (an 8-GPU trainer's multi-rank save): two ZeRO-3 ranks share GPU 0 over gloo (NCCL refuses two
  ranks on one device), train SmolLM2 two steps (full, then LoRA) with ``tests/sharded_save_driver.py`` and save;
  each checkpoint must pass ``verify_saved_weights``. Skipped when the GPU's free memory is too small or gloo lacks a
  collective on CUDA tensors.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dev.gpu_check import GPU_RECIPE, REPO, SERVE_BF16_ARGS, SKIP_EXIT, say

if TYPE_CHECKING:  # annotations only: this module starts before set-up, with the standard library alone
    from optima.config import LoopRecipe, Recipe

ZERO3_TIMEOUT_S = 600
ZERO3_MODEL = REPO / "models" / "SmolLM2-135M-Instruct"


def query_nvidia_smi(args: list[str], nvidia_smi: str | None = None) -> list[list[str]]:
    """The rows of an ``nvidia-smi --query-...`` in CSV without header or units (empty when it cannot answer)."""
    from optima.hardware.machine import nvidia_smi_lines

    lines = nvidia_smi_lines([*args, "--format=csv,noheader,nounits"], nvidia_smi)
    return [[cell.strip() for cell in line.split(",")] for line in lines if line.strip()]


def gpu_memory_used_mib(gpu: str | None = None, nvidia_smi: str | None = None) -> int | None:
    """Memory in use (MiB) on GPU ``gpu`` (default the first visible one), by all its processes; None: unknown (no
    GPU, no ``nvidia-smi``, or a UUID in ``CUDA_VISIBLE_DEVICES``)."""
    from optima.hardware.machine import visible_gpus

    gpus = [gpu] if gpu is not None else visible_gpus(nvidia_smi=nvidia_smi)[:1]
    if not gpus or not gpus[0].isdigit():
        return None
    rows = query_nvidia_smi(["--query-gpu=memory.used"], nvidia_smi)
    try:
        return int(float(rows[int(gpus[0])][0]))
    except (IndexError, ValueError):
        return None


def process_memory_mib(nvidia_smi: str | None = None) -> dict[int, int]:
    """GPU memory (MiB) of each process that ``nvidia-smi`` lists, by PID (empty: none visible)."""
    memory: dict[int, int] = {}
    for row in query_nvidia_smi(["--query-compute-apps=pid,used_memory"], nvidia_smi):
        if len(row) == 2 and row[0].isdigit() and row[1].replace(".", "", 1).isdigit():
            memory[int(row[0])] = memory.get(int(row[0]), 0) + int(float(row[1]))
    return memory


# What a torch whose gloo lacks a collective on CUDA tensors says ("ProcessGroupGloo does not support ...").
GLOO_UNSUPPORTED = re.compile(
    r"gloo.*(does not support|not supported|no support for|unsupported)|no backend type associated with device type",
    re.IGNORECASE,
)
SCORED_TEXTS = ("The capital of France is Paris.", "Water boils at 100 degrees Celsius at sea level.")


def cuda_refusal(device_count: int) -> str | None:
    """Why the GPU checks cannot run in this environment (None: they can)."""
    if device_count > 0:
        return None
    return (
        "torch in the training environment sees no CUDA device (torch.cuda.device_count() == 0): a CPU build of "
        "torch (run `python3 -m optima setup` on the GPU machine), or CUDA_VISIBLE_DEVICES hides the GPUs"
    )


def fail(reason: str) -> int:
    say(f"FAIL: {reason}")
    return 1


def skip(reason: str) -> int:
    say(f"SKIP: {reason}")
    return SKIP_EXIT


def check_recipe(out: Path, name: str, **values):
    """The iSFT demo recipe with the check's GPU settings (bf16 serving), its run folder ``out/name``."""
    from optima.config import SFTRecipe, load_recipe

    overrides = GPU_RECIPE | {"vllm_extra_args": SERVE_BF16_ARGS, "output_dir": str(out / name)} | values
    return load_recipe(SFTRecipe, REPO / "train" / "sft_recipes" / "demo_arc.yaml", overrides)


def ask(url: str, recipe: Recipe) -> str:
    """One greedy chat request to ``url`` through the run's chat client; its reply."""
    from optima.serving.client import ReplicaPool, Sampling

    pool = ReplicaPool([url], recipe)
    try:
        reply = pool.chat(0, [{"role": "user", "content": "2 + 3 = ?"}], Sampling(temperature=0.0, max_tokens=8))
    finally:
        pool.close()
    return reply.text


def is_sleeping(url: str, recipe: Recipe) -> bool:
    """vLLM's ``GET /is_sleeping`` (a development route, open with sleep mode)."""
    import requests

    from optima.serving.client import auth_headers, server_root

    response = requests.get(server_root(url) + "/is_sleeping", headers=auth_headers(recipe.api_key), timeout=30)
    response.raise_for_status()
    return bool(response.json()["is_sleeping"])


def new_holder(recipe: LoopRecipe, layout, logs: Path):
    """The run's server holder for ``recipe`` with the planned ``layout``."""
    from optima.config.rules import loss_model
    from optima.environments import resolve_env
    from optima.serving.holder import ServerHolder

    return ServerHolder(recipe, resolve_env(None, "vllm"), loss_model(recipe), logs, layout=layout)


def sleep_freed_problem(idle: int | None, awake: int | None, asleep: int | None) -> str | None:
    """Whether a sleep gave back at least half of what the server held on the GPU (MiB; unknown: not judged)."""
    if None in (idle, awake, asleep):
        return None
    held, freed = awake - idle, awake - asleep
    if held > 0 and freed < held / 2:
        return f"the sleeping server still holds {asleep - idle} MiB of the {held} MiB it held awake"
    return None


def check_wake_reload(out: Path) -> int:
    """``wake-reload``: serve the base model, sleep, wake with the iSFT checkpoint in place, probe, ask."""
    import torch

    from optima.identity import read_probe
    from optima.paths import RunPaths
    from optima.serving.reload import probe_mismatch

    refusal = cuda_refusal(torch.cuda.device_count())
    if refusal:
        return fail(refusal)
    checkpoint = out / "isft" / "checkpoints" / "iteration_0"
    probe = read_probe(checkpoint)
    if probe is None:
        return fail(f"{checkpoint} has no recorded weights probe (the isft stage did not complete it)")
    recipe = check_recipe(out, "wake_reload")
    allocation = server_allocation(recipe)
    if allocation.problems:
        return fail("the servers' allocation refuses: " + "; ".join(allocation.problems))
    if not allocation.layout.policy[0].carry_over:
        return fail("the allocation does not keep the policy replica across checkpoints (sleep_mode off?)")
    base, idle = str(recipe.initial_model_path), gpu_memory_used_mib()
    with new_holder(recipe, allocation.layout, out / "wake_reload" / "logs") as holder:
        url = holder.serve(base, RunPaths.from_recipe(recipe).stage(0))[0]
        say(f"wake-reload | {base} served on {url} | reply {ask(url, recipe)!r}")
        control = probe_mismatch(url, probe, recipe, None)
        verdict = f"differs ({control})" if control else "indistinguishable at bf16 tolerance (the probe proves less)"
        say(f"wake-reload | the base model against the checkpoint's probe: {verdict}")
        awake = gpu_memory_used_mib()
        holder.release_for_training()
        if not holder.asleep:
            return fail("the policy replica did not go to sleep (stopped instead; see the driver's warning)")
        asleep = gpu_memory_used_mib()
        say(f"wake-reload | GPU memory used (MiB): before start {idle}, awake {awake}, asleep {asleep}")
        if not is_sleeping(url, recipe):
            return fail("/is_sleeping says the server is awake after /sleep")
        problem = sleep_freed_problem(idle, awake, asleep)
        if problem:
            return fail(problem)
        started = time.monotonic()
        holder.load_in_place(str(checkpoint))  # wake, reload in place, cache reset; raises unless the probe matches
        say(f"wake-reload | woke with {checkpoint} in {time.monotonic() - started:.1f} s, weights probe matched")
        say(f"wake-reload | reply after the wake {ask(url, recipe)!r}")
    return 0


def server_allocation(recipe: LoopRecipe, hardware=None):
    """The servers' part of the hardware allocation of ``recipe`` on ``hardware`` (default: this machine's), training
    excluded."""
    from optima.hardware.allocation import allocate_this_machine

    return allocate_this_machine(recipe, hardware, training=False)


def group_memory_mib(pgid: int | None) -> tuple[int | None, int | None]:
    """(MiB held by the processes of group ``pgid``, MiB held by the other processes) on the GPU; None: unknown."""
    inside, others = 0, 0
    memory = process_memory_mib()
    if not memory or pgid is None:
        return None, None
    for pid, mib in memory.items():
        try:
            mine = os.getpgid(pid) == pgid
        except OSError:  # gone, or a PID of another namespace
            mine = False
        inside, others = (inside + mib, others) if mine else (inside, others + mib)
    return inside, others


def check_loss_beside_policy(out: Path) -> int:
    """``loss-beside-policy``: both servers on GPU 0 with the planned shares, each answering its kind of request."""
    import torch
    from transformers import AutoTokenizer

    from optima.config.rules import loss_model
    from optima.lm_loss import VLLMLossScorer
    from optima.paths import RunPaths

    refusal = cuda_refusal(torch.cuda.device_count())
    if refusal:
        return fail(refusal)
    recipe = check_recipe(out, "loss_beside", loss_placement="beside")
    allocation = server_allocation(recipe)
    if allocation.problems:
        return fail("the servers' allocation refuses: " + "; ".join(allocation.problems))
    layout = allocation.layout
    if layout.loss is None or not layout.loss_resident or layout.loss.gpus != layout.policy[0].gpus[:1]:
        return fail(f"the allocation does not put a resident loss server beside the policy on its GPU: {layout}")
    gib = allocation.hardware.gpu_gib
    shares = {name: p.gpu_memory_utilization or recipe.gpu_memory_utilization
              for name, p in (("policy", layout.policy[0]), ("loss server", layout.loss))}  # fmt: skip
    with new_holder(recipe, layout, out / "loss_beside" / "logs") as holder:
        url = holder.serve(str(recipe.initial_model_path), RunPaths.from_recipe(recipe).stage(0))[0]
        loss_urls = holder.loss_urls()
        say(f"loss-beside-policy | policy {url} reply {ask(url, recipe)!r}")
        tokenizer = AutoTokenizer.from_pretrained(loss_model(recipe))
        losses = VLLMLossScorer(loss_urls, recipe.served_model_name, tokenizer, recipe).score(list(SCORED_TEXTS))
        say(f"loss-beside-policy | loss server {loss_urls[0]} LM losses {[round(x, 3) for x in losses]}")
        loss_mib, policy_mib = group_memory_mib(holder.loss.server.pgid)
    for name, used in (("policy", policy_mib), ("loss server", loss_mib)):
        measured = f"{used} MiB held by its processes" if used is not None else "use not visible (nvidia-smi)"
        say(f"loss-beside-policy | {name}: share {shares[name]} = {shares[name] * gib:.1f} GiB planned, {measured}")
    if not all(math.isfinite(x) and x > 0 for x in losses):
        return fail(f"the loss server's LM losses are not positive numbers: {losses}")
    return 0


def zero3_need_bytes(ranks: int = 2) -> int | None:
    """GPU memory of ``ranks`` ZeRO-3 ranks of SmolLM2 sharing one GPU: each rank's model states by DeepSpeed's
    estimator (None: the model's size is unknown)."""
    from optima.hardware.memory import model_size, zero3_states_bytes

    size = model_size(ZERO3_MODEL)
    return None if size is None else ranks * zero3_states_bytes(size, ranks, 1)


def zero3_skip_reason(free_mib: int | None, need_bytes: int | None) -> str | None:
    """Why two ZeRO-3 ranks cannot share this GPU (None: they fit, or the free memory or the need is unknown)."""
    if free_mib is None or need_bytes is None or free_mib * 2**20 >= need_bytes:
        return None
    return (
        f"GPU 0 has {free_mib / 1024:.1f} GiB free, two ZeRO-3 ranks of SmolLM2 need ~{need_bytes / 2**30:.1f} GiB "
        "(DeepSpeed's ZeRO-3 estimator)"
    )


def unsupported_collective(logs: list[Path]) -> str | None:
    """The line of a rank's log saying that gloo lacks a collective on CUDA tensors (None: no such line)."""
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if GLOO_UNSUPPORTED.search(line):
                return line.strip()[:300]
    return None


def check_zero3_two_processes(out: Path) -> int:
    """``zero3-2proc``: two ZeRO-3 ranks on GPU 0 train SmolLM2 and save; each checkpoint must pass the check."""
    import torch

    from optima.hardware.machine import gpu_memory_mib
    from optima.serving.vllm_server import find_free_port
    from optima.training.checkpoint import verify_saved_weights
    from optima.training.common import is_complete, read_completion
    from optima.training.launch import run_ranks

    refusal = cuda_refusal(torch.cuda.device_count())
    if refusal:
        return fail(refusal)
    total, used = (gpu_memory_mib() or [None])[0], gpu_memory_used_mib()
    reason = zero3_skip_reason(None if None in (total, used) else total - used, zero3_need_bytes())
    if reason:
        return skip(reason)
    target = out / "zero3_2proc"
    target.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "tests.sharded_save_driver", "--strategy", "zero3", "--device", "cuda"]
    argv += ["--model", str(ZERO3_MODEL), "--out", str(target)]
    port = find_free_port("127.0.0.1", 29500)
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cuda"}
    logs = [target.parent / f"zero3_2proc.rank{rank}.log" for rank in range(2)]
    codes = run_ranks(argv, env | {"TOKENIZERS_PARALLELISM": "false"}, logs, ZERO3_TIMEOUT_S, local_ranks=[0, 0])
    if codes != [0, 0]:
        unsupported = unsupported_collective(logs)
        if unsupported:
            return skip(f"gloo cannot run ZeRO-3's collectives on CUDA tensors with this torch: {unsupported}")
        return fail(f"the ranks ended with {codes} (None: still running after {ZERO3_TIMEOUT_S} s); logs {logs}")
    for variant in ("full", "lora"):
        saved = target / variant
        if not is_complete(saved) or read_completion(saved).get("sharded") is not True:
            return fail(f"{saved}: no completion marker, or the ranks did not hold shards")
        say(f"zero3-2proc | {saved} | {verify_saved_weights(saved)} tensors checked | saved by 2 ranks on GPU 0")
    return 0


CHECKS = {
    "wake-reload": check_wake_reload,
    "loss-beside-policy": check_loss_beside_policy,
    "zero3-2proc": check_zero3_two_processes,
}


def main(argv: list[str] | None = None) -> int:
    """``python -m dev.gpu_stages CHECK OUT``: run one check with ``OUT`` as gpu-check's output folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dev.gpu_stages", description=__doc__.split("\n")[0])
    parser.add_argument("check", choices=list(CHECKS))
    parser.add_argument("out", type=Path, help="gpu-check's --output-dir (the iSFT checkpoint is under it)")
    args = parser.parse_args(argv)
    from optima.logging_utils import setup_logging

    setup_logging()  # the servers' and the holder's lines go to the stage's log with the check's own
    return CHECKS[args.check](args.out.resolve())


if __name__ == "__main__":
    raise SystemExit(main())
