r"""One-GPU check of the GPU path: set up, one iSFT and one iDPO iteration of SmolLM2 in bf16, reload, PASS/FAIL.

    make gpu-check                                  # = python3 -m optima gpu-check
    python3 -m optima gpu-check --dry-run           # print the stages and their commands; start nothing
    python3 -m optima gpu-check --skip-setup --output-dir runs/gpu_check

For a machine with one NVIDIA GPU and the package registries reachable; it starts before set-up, so this module
imports only the standard library at the top. The stages:

1. ``setup``: ``python3 -m optima setup`` (the CUDA builds of torch and vLLM, DeepSpeed, flash-attn where a
   wheel for the installed torch/CUDA exists, the SmolLM2 folder).
2. ``trainer-yamls``: the demo trainer YAMLs with the GPU settings, written into ``--output-dir``.
   ``plan``: the hardware plan of the iSFT stage on this machine (``sft_script.py --dry-run``: servers, training
   processes, memory per GPU); a plan that cannot run stops the check here, before anything starts. The loss model
   is served after generation (``loss_placement: after``) so that one GPU is enough: a loss server that stays up
   would hold the only GPU the trainer has.
3. ``isft``: one iSFT iteration of the arc demo recipe, trained with ``deepspeed_zero3`` on one process in bf16
   (trainer YAML: the demo's, with ``bf16: true``, ``dtype: bfloat16`` and ``attn_implementation:
   flash_attention_2``; without flash-attn the trainer falls back to ``sdpa`` and says so once), served in bf16.
4. ``idpo``: one iDPO iteration of the arc demo recipe from the iSFT checkpoint, same settings.
5. ``reload``: each checkpoint's files checked (every tensor present, expected shapes, not all zero; the same check
   the trainer runs before marking a checkpoint complete), loaded on the GPU in bf16, and asked for a few tokens.

It prints the seconds each stage took and ends with one line, ``GPU CHECK: PASS`` or ``GPU CHECK: FAIL (...)``
(exit code 0 or 1). Target: under 10 minutes on one H100-class GPU, setup included when the wheels download fast.
The logs of each stage are under ``--output-dir``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
TRAIN_PY = REPO / ".venvs" / "train" / "bin" / "python"
SMOLLM2 = REPO / "alignment-handbook" / "recipes" / "smollm2-135m"
GPU_TRAINER = {"bf16": True, "use_cpu": False, "dtype": "bfloat16", "attn_implementation": "flash_attention_2"}
GPU_RECIPE = {
    "iteration_times": 1,
    "accelerate_config": "deepspeed_zero3",
    "num_processes": 1,
    "loss_placement": "after",
}
SERVE_BF16 = "vllm_extra_args=[--dtype, bfloat16]"


def write_gpu_trainer_yaml(base: Path, path: Path) -> Path:
    """The SmolLM2 demo trainer YAML with the GPU settings (bf16 weights and compute, flash-attn asked for)."""
    import yaml  # PyYAML: from the training env, which the setup stage has built by now

    config = yaml.safe_load(base.read_text()) | GPU_TRAINER
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def overrides(values: dict) -> list[str]:
    """``--set key=value`` flags of the loop scripts."""
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def build_stages(out: Path, skip_setup: bool, hardware: str | None = None) -> list[tuple[str, list[str]]]:
    """(name, command) of every stage, in order; pure, shown by ``--dry-run``."""
    sft_out, dpo_out = out / "isft", out / "idpo"
    sft_checkpoint = sft_out / "checkpoints" / "iteration_0"
    dpo_checkpoint = dpo_out / "checkpoints" / "iteration_0"
    stages = [] if skip_setup else [("setup", [sys.executable, "-m", "optima", "setup"])]
    sft = GPU_RECIPE | {"output_dir": sft_out, "origin_yaml_path": out / "trainer_sft_gpu.yaml"}
    dpo = GPU_RECIPE | {
        "output_dir": dpo_out,
        "initial_model_path": sft_checkpoint,
        "origin_dpo_yaml_path": out / "trainer_dpo_gpu.yaml",
    }
    yamls = [str(TRAIN_PY), "-m", "optima", "gpu-check", "--write-trainer-yamls", str(out)]
    isft = [
        str(TRAIN_PY),
        "sft_script.py",
        "--train_config_path",
        "train/sft_recipes/demo_arc.yaml",
        *overrides(sft),
        "--set",
        SERVE_BF16,
    ]
    stages += [
        ("trainer-yamls", yamls),
        ("plan", [*isft, "--dry-run", *(["--hardware", hardware] if hardware else [])]),
        ("isft", isft),
        ("idpo", [str(TRAIN_PY), "dpo_script.py", "--train_config_path", "train/dpo_recipes/demo_arc.yaml",
                  *overrides(dpo), "--set", SERVE_BF16]),
        ("reload", [str(TRAIN_PY), "-m", "optima", "gpu-check", "--reload", str(sft_checkpoint),
                    str(dpo_checkpoint)]),
    ]  # fmt: skip
    return stages


def write_trainer_yamls(out: Path) -> int:
    """Stage 2 (runs in the training env, which has PyYAML): the iSFT and iDPO trainer YAMLs for the GPU."""
    write_gpu_trainer_yaml(SMOLLM2 / "arc_sft" / "base.yaml", out / "trainer_sft_gpu.yaml")
    write_gpu_trainer_yaml(SMOLLM2 / "arc_dpo" / "base.yaml", out / "trainer_dpo_gpu.yaml")
    return 0


def reload_checkpoints(paths: list[str]) -> int:
    """Stage 5 (runs in the training env): check each checkpoint's files, load it on the GPU, generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optima.training.checkpoint import verify_saved_weights

    for path in paths:
        tensors = verify_saved_weights(Path(path))
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2 + 3 = ?"}], add_generation_prompt=True)
        output = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8, do_sample=False)
        reply = tokenizer.decode(output[0, len(prompt) :], skip_special_tokens=True)
        say(f"reload | {path} | {tensors} tensors checked | bf16 on cuda | reply {reply!r}")
    return 0


def render_plan(hardware: str) -> list[str]:
    """The hardware plan of the iSFT stage on ``hardware`` (needs the training env's PyYAML: dry runs only)."""
    from optima.config import SFTRecipe, load_recipe
    from optima.hardware.plan import plan_hardware
    from optima.hardware.spec import parse_hardware

    recipe = load_recipe(SFTRecipe, REPO / "train/sft_recipes/demo_arc.yaml", GPU_RECIPE, check_paths=False)
    return plan_hardware(recipe, parse_hardware(hardware), [0]).render()


def run_stages(stages: list[tuple[str, list[str]]], out: Path) -> tuple[dict[str, float], str | None]:
    """Run the stages in order, each logged to ``<out>/<name>.log``; stop at the first failure."""
    from optima.serving import run_to_end  # standard library only: works before setup

    times: dict[str, float] = {}
    for name, argv in stages:
        start = time.monotonic()
        log = out / f"{name}.log"
        say(f"gpu-check | {name} | {' '.join(argv)} | log {log}")
        code = run_to_end(argv, cwd=REPO, log=log)
        times[name] = time.monotonic() - start
        say(f"gpu-check | {name} | {times[name]:.0f} s | exit {code}")
        if code != 0:
            return times, f"{name} exited with {code}, see {log}"
    return times, None


def say(line: str) -> None:
    """One line of the check's output on stdout (the library never prints through ``print``)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_gpu_check_command(argv: list[str] | None = None) -> int:
    """``python3 -m optima gpu-check``: the stages below, or one internal stage, or ``--dry-run``."""
    parser = argparse.ArgumentParser(
        prog="python3 -m optima gpu-check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, default=REPO / "runs" / "gpu_check", help="logs and checkpoints")
    parser.add_argument("--skip-setup", action="store_true", help="use the environments as they are")
    parser.add_argument("--dry-run", action="store_true", help="print the stages and their commands; start nothing")
    parser.add_argument("--hardware", help="plan for this hardware (e.g. 1x80GB) instead of the detected GPUs")
    parser.add_argument("--write-trainer-yamls", type=Path, help=argparse.SUPPRESS)  # internal stage
    parser.add_argument("--reload", nargs="+", metavar="CHECKPOINT", help=argparse.SUPPRESS)  # internal stage
    args = parser.parse_args(argv)
    if args.write_trainer_yamls:
        return write_trainer_yamls(args.write_trainer_yamls)
    if args.reload:
        return reload_checkpoints(args.reload)
    out = args.output_dir.resolve()
    stages = build_stages(out, args.skip_setup, args.hardware)
    if args.dry_run:
        say(f"gpu-check (dry run) | output {out} | trainer YAML settings {GPU_TRAINER} | recipe {GPU_RECIPE}")
        for name, command in stages:
            say(f"{name}: {' '.join(command)}")
        if args.hardware:
            say("\n".join(render_plan(args.hardware)))
        return 0
    from optima.hardware.gpus import has_gpu  # standard library only: works before setup

    if not has_gpu():
        say("GPU CHECK: FAIL (no NVIDIA GPU visible: nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them)")
        return 1
    if out.exists():
        shutil.rmtree(out)  # a fresh run each time: the loop scripts would resume from an old one
    out.mkdir(parents=True)
    times, failure = run_stages(stages, out)
    say("stage times: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in times.items()))
    say(f"GPU CHECK: FAIL ({failure})" if failure else f"GPU CHECK: PASS ({sum(times.values()):.0f} s)")
    return 1 if failure else 0
