r"""``make gpu-check``: the GPU path on one NVIDIA GPU, each stage PASS, FAIL (reason) or SKIP (reason).

    python3 -m dev.gpu_check                              # = make gpu-check
    python3 -m dev.gpu_check --dry-run [--hardware 1x80GB]  # the stages and their commands; start nothing
    python3 -m dev.gpu_check --skip-setup --output-dir runs/gpu_check

It starts before set-up (the system's python3), so this module imports only the standard library at the top. The
stages: ``setup``; ``trainer-yamls`` (the demo's trainer YAMLs in bf16 with flash-attn asked for); ``plan`` (the
iSFT stage's dry run on this machine, the loss model served after generation so one GPU is enough); the checks of
``dev.gpu_stages`` (``loss-beside-policy``, ``wake-reload``, ``zero3-2proc``); ``isft`` and ``idpo`` (one
iteration each of the arc demo, ZeRO-3 on one process, bf16); ``reload`` (each checkpoint checked, loaded on the GPU
in bf16, asked for a few tokens). A stage whose needs did not pass is skipped (``STAGE_NEEDS``). The last line is
``GPU CHECK: PASS (...)`` (exit 0) or ``GPU CHECK: FAIL (failed: ...)`` (exit 1); logs under ``--output-dir``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MARKER = ".gpu_check_folder"  # the folder gpu-check may delete is one that holds this file
REPO = Path(__file__).resolve().parent.parent
TRAIN_PY = REPO / ".venvs" / "train" / "bin" / "python"
SMOLLM2 = REPO / "alignment-handbook" / "recipes" / "smollm2-135m"
GPU_TRAINER = {"bf16": True, "use_cpu": False, "dtype": "bfloat16", "attn_implementation": "flash_attention_2"}
GPU_RECIPE = {
    "iteration_times": 1,
    "accelerate_config": "deepspeed_zero3",
    "num_processes": 1,
    "loss_placement": "after",
}
SERVE_BF16_ARGS = ["--dtype", "bfloat16"]
SERVE_BF16 = f"vllm_extra_args=[{', '.join(SERVE_BF16_ARGS)}]"
SKIP_EXIT = 77  # an internal stage's "this GPU cannot host the check" (its log says why on a "SKIP: " line)
GPU_STAGES = "dev.gpu_stages"  # the checks that drive the run's servers and saves
# The stages a stage needs to have passed (a stage not listed needs every stage before it; one not run, such as
# setup under --skip-setup, counts as passed).
STAGE_NEEDS = {
    "trainer-yamls": ("setup",),
    "plan": ("trainer-yamls",),
    "loss-beside-policy": ("plan",),
    "isft": ("plan",),
    "wake-reload": ("isft",),
    "idpo": ("isft",),
    "reload": ("isft", "idpo"),
    "zero3-2proc": ("setup",),
}


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
    yamls = [str(TRAIN_PY), "-m", "dev.gpu_check", "--write-trainer-yamls", str(out)]
    isft = [
        str(TRAIN_PY),
        "sft_script.py",
        "--train_config_path",
        "train/sft_recipes/demo_arc.yaml",
        *overrides(sft),
        "--set",
        SERVE_BF16,
    ]
    check = [str(TRAIN_PY), "-m", GPU_STAGES]
    stages += [
        ("trainer-yamls", yamls),
        ("plan", [*isft, "--dry-run", *(["--hardware", hardware] if hardware else [])]),
        ("loss-beside-policy", [*check, "loss-beside-policy", str(out)]),
        ("isft", isft),
        ("wake-reload", [*check, "wake-reload", str(out)]),
        ("idpo", [str(TRAIN_PY), "dpo_script.py", "--train_config_path", "train/dpo_recipes/demo_arc.yaml",
                  *overrides(dpo), "--set", SERVE_BF16]),
        ("reload", [str(TRAIN_PY), "-m", "dev.gpu_check", "--reload", str(sft_checkpoint),
                    str(dpo_checkpoint)]),
        ("zero3-2proc", [*check, "zero3-2proc", str(out)]),
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


def render_allocation(hardware: str) -> list[str]:
    """The hardware allocation of the iSFT stage on ``hardware`` (needs the training env's PyYAML: dry runs only)."""
    from optima.config import SFTRecipe, load_recipe
    from optima.hardware.allocation import allocate_hardware
    from optima.hardware.machine import parse_hardware

    recipe = load_recipe(SFTRecipe, REPO / "train/sft_recipes/demo_arc.yaml", GPU_RECIPE, check_paths=False)
    return allocate_hardware(recipe, parse_hardware(hardware), [0]).render()


@dataclass(frozen=True)
class Outcome:
    """How one stage ended: ``PASS``, ``FAIL`` or ``SKIP``, its seconds, and why (FAIL, SKIP)."""

    name: str
    status: str
    seconds: float = 0.0
    reason: str = ""

    def line(self) -> str:
        """``gpu-check | isft | PASS | 12 s`` / ``... | FAIL (reason) | 3 s``."""
        status = f"{self.status} ({self.reason})" if self.reason else self.status
        return f"gpu-check | {self.name} | {status} | {self.seconds:.0f} s"


def stage_outcome(name: str, code: int, seconds: float, log: Path) -> Outcome:
    """The outcome of a stage that exited with ``code`` (its ``FAIL: ``/``SKIP: `` line, else its last line)."""
    if code == 0:
        return Outcome(name, "PASS", seconds)
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
    if code == SKIP_EXIT:
        said = [ln.removeprefix("SKIP: ") for ln in lines if ln.startswith("SKIP: ")]
        return Outcome(name, "SKIP", seconds, said[-1] if said else f"no reason given, see {log}")
    said = [ln.removeprefix("FAIL: ") for ln in lines if ln.startswith("FAIL: ")] or lines[-1:]
    detail = f"{said[-1][:400]}; " if said else ""
    return Outcome(name, "FAIL", seconds, f"{detail}exit {code}, see {log}")


def unmet_need(name: str, done: dict[str, Outcome]) -> str | None:
    """The earlier stage ``name`` needs that did not pass (None: it may run)."""
    needs = STAGE_NEEDS.get(name, tuple(done))
    for need in needs:
        if need in done and done[need].status != "PASS":
            return need
    return None


def run_stages(stages: list[tuple[str, list[str]]], out: Path) -> list[Outcome]:
    """Run the stages in order, each logged to ``<out>/<name>.log``; a stage whose needs did not pass is skipped."""
    done: dict[str, Outcome] = {}
    for name, argv in stages:
        need = unmet_need(name, done)
        if need is not None:
            done[name] = Outcome(name, "SKIP", 0.0, f"needs {need}, which did not pass")
        else:
            start = time.monotonic()
            log = out / f"{name}.log"
            say(f"gpu-check | {name} | {' '.join(argv)} | log {log}")
            with log.open("w") as handle:
                code = subprocess.run(argv, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, check=False).returncode
            done[name] = stage_outcome(name, code, time.monotonic() - start, log)
        say(done[name].line())
    return list(done.values())


def summarize(outcomes: list[Outcome]) -> tuple[str, int]:
    """The last line of the check and its exit code: PASS (0) when no stage failed, else FAIL (1) naming them."""
    count = {status: sum(o.status == status for o in outcomes) for status in ("PASS", "FAIL", "SKIP")}
    tally = f"{count['PASS']} passed, {count['SKIP']} skipped"
    failed = [o.name for o in outcomes if o.status == "FAIL"]
    if failed:
        return f"GPU CHECK: FAIL (failed: {', '.join(failed)}; {tally})", 1
    return f"GPU CHECK: PASS ({tally}, {sum(o.seconds for o in outcomes):.0f} s)", 0


def say(line: str) -> None:
    """One line of the check's output on stdout (the library never prints through ``print``)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """``python3 -m dev.gpu_check``: the stages, or one internal stage, or ``--dry-run``."""
    from optima.install import SetupError, check_python  # standard library only: works before setup

    try:  # the system's python3 may be older than the optima package needs
        check_python(command="gpu-check")
    except SetupError as error:
        sys.stderr.write(f"gpu-check: {error}\n")
        return 2
    parser = argparse.ArgumentParser(
        prog="python3 -m dev.gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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
            say("\n".join(render_allocation(args.hardware)))
        return 0
    from optima.hardware.machine import has_gpu  # standard library only: works before setup

    if not has_gpu():
        say("GPU CHECK: FAIL (no NVIDIA GPU visible: nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them)")
        return 1
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        say(f"gpu-check: {out} holds files gpu-check did not write (it deletes only its own): pick another")
        return 2
    if out.exists():
        shutil.rmtree(out)  # its own folder, fresh each time: the loop scripts would resume from an old one
    out.mkdir(parents=True)
    (out / MARKER).write_text("written by python -m dev.gpu_check: the next check deletes this folder\n")
    outcomes = run_stages(stages, out)
    say("stages: " + ", ".join(f"{o.name} {o.status} {o.seconds:.0f} s" for o in outcomes))
    line, code = summarize(outcomes)
    say(line)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
