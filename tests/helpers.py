"""Test helpers shared by the test modules and the driver scripts (which cannot import conftest)."""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

from optima.config import LOOP_ONLY_KEYS, InferenceRecipe, SFTRecipe, load_recipe
from optima.identity import COMPLETE_MARKER, new_weights_id
from optima.tasks import Example

# Resets SIGINT and SIGTERM to their defaults, then becomes the real command (same pid).
_EXEC_WITH_DEFAULT_SIGNALS = (
    "import os, signal, sys; "
    "[signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGTERM)]; "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def mark_finished(checkpoint: Path) -> Path:
    """Make ``checkpoint`` (created if needed) a finished one: a completion marker with a fresh ``weights_id``, as the
    trainer scripts write it last (the sweep evaluates only those)."""
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / COMPLETE_MARKER).write_text(f'{{"weights_id": "{new_weights_id()}"}}')
    return checkpoint


def with_default_signals(argv: Sequence[str]) -> list[str]:
    """``argv`` started with SIGINT and SIGTERM at their defaults, whatever this test run inherited.

    A suite launched as a background job (``cmd &`` in a non-interactive shell) ignores SIGINT, and an ignored signal
    stays ignored across fork and exec: a driver a test interrupts would never see its Ctrl-C. This wrapper resets
    both signals to SIG_DFL and execs ``argv`` in place (the pid the test signals stays the same), so the Python
    driver installs its usual KeyboardInterrupt handler. (``preexec_fn`` would do the same but is unsafe in a
    process with threads, such as a test with a fake server running.)
    """
    return [sys.executable, "-c", _EXEC_WITH_DEFAULT_SIGNALS, *argv]


def _loop_only_field(f: dataclasses.Field) -> tuple[str, object, dataclasses.Field]:
    """A copy of one of a loop recipe's sampling and loop fields (type, default, help, redoes)."""
    factory = f.default is dataclasses.MISSING
    default = {"default_factory": f.default_factory} if factory else {"default": f.default}
    return f.name, typing.get_type_hints(SFTRecipe)[f.name], dataclasses.field(metadata=f.metadata, **default)


def _check_sampling(recipe) -> None:
    InferenceRecipe.__post_init__(recipe)
    SFTRecipe._check_sampling(recipe)


# An evaluation recipe with the loops' sampling and loop fields too: what the serving and generation tests drive
# (every field of a conversation, the prompt pool, the temperature schedule), without a trainer YAML to provide,
# and without a reward (so no loss server is planned beside the policy).
SamplingTestRecipe = dataclasses.make_dataclass(
    "SamplingTestRecipe",
    [_loop_only_field(f) for f in dataclasses.fields(SFTRecipe) if f.name in LOOP_ONLY_KEYS],
    bases=(InferenceRecipe,),
    kw_only=True,
    namespace={
        "unused_keys": (),  # the loops' keys are this recipe's own
        "folder_fields": ("check_point_root_path",),
        "path_fields": ("prompt_pool_path",),
        "__post_init__": _check_sampling,
    },
)


def build_test_recipe(output_dir: Path, **overrides) -> SamplingTestRecipe:
    """A validated recipe for serving/generation tests (no trainer YAML needed)."""
    values = {
        "dataset_type": "arc",
        "initial_model_path": str(output_dir / "model"),
        "output_dir": str(output_dir),
        "model_root_path": str(output_dir),
        "port": 18600,
        "thread_count": 4,
        "explore_count": 2,
        "max_turns": 4,
        "max_tokens": 32,
        "request_timeout_s": 30.0,
        "max_retries": 2,
        "server_startup_timeout_s": 120.0,
        "cpu_kvcache_space_gb": 1,
    }
    return load_recipe(SamplingTestRecipe, None, values | overrides, check_paths=False)


def arc_examples(count: int) -> list[Example]:
    """``count`` small multiple-choice questions (task ``arc``); ids ``q0``, ``q1``, ..."""
    options = (("A", "3"), ("B", "4"), ("C", "5"))
    return [
        Example(
            id=f"q{i}",
            task="arc",
            question=f"Question {i}: what is 2 + 2?",
            answer="B",
            score_type="choice",
            options=options,
        )
        for i in range(count)
    ]


def read_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a process from /proc, or None if it is gone."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[2])


def child_groups(parent: int) -> list[int]:
    """Process groups led by live children of ``parent`` (the servers a driver started)."""
    groups = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = read_stat(int(entry.name))
            if stat and stat[0] != "Z" and stat[1] == parent and stat[2] == int(entry.name):
                groups.append(int(entry.name))
    return groups


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll ``condition()`` until it returns something truthy (returned) or ``timeout_s`` passes (fails)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def assert_ran_what_the_dry_run_printed(script: Path, recipe: Path, run: Path) -> None:
    """The stages a finished run recorded, in order, are the stages ``--dry-run`` printed for the same recipe."""
    import json
    import re
    import subprocess
    import sys

    argv = [sys.executable, str(script), "--train_config_path", str(recipe), "--dry-run"]
    printed = subprocess.run(argv, capture_output=True, text=True, cwd=script.parent, check=True, timeout=300).stdout
    planned = [name for name in re.findall(r"^  \[(\w+)\]$", printed, flags=re.MULTILINE) if name != "serve"]
    ran = []
    for folder in sorted(run.glob("iteration_*"), key=lambda p: int(p.name.rpartition("_")[2])):
        parts = [folder] if (folder / "manifest.json").exists() else [folder / "sft", folder / "dpo"]
        for part in parts:
            ran += list(json.loads((part / "manifest.json").read_text())["stages"])
    assert planned and ran == planned, (ran, planned)


def tiny_trainer_yaml(path: Path, model: Path, dataset: Path, output: Path, **extra) -> Path:
    """A handbook-style trainer YAML for a tiny model on CPU (SFT keys; DPO tests add theirs in ``extra``)."""
    import yaml

    config = {
        "model_name_or_path": str(model),
        "dataset_name": str(dataset),
        "output_dir": str(output),
        "dtype": "float32",
        "bf16": False,
        "use_cpu": True,
        "activation_checkpointing": False,
        "per_device_train_batch_size": 2,
        "max_steps": 3,
        "learning_rate": 1.0e-2,
        "lr_scheduler_type": "constant",
        "save_strategy": "no",
        "eval_strategy": "no",
        "logging_steps": 1,
        "report_to": "none",
        "seed": 0,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "max_length": 64,
    } | extra
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def finished_stages(manifest: Path) -> list[str]:
    """The stages that ``manifest`` records as finished (a started stage has an entry too, without a result)."""
    import json

    stages = json.loads(manifest.read_text())["stages"] if manifest.exists() else {}
    return [name for name, entry in stages.items() if "result" in entry]


FAKE_SRUN = '''#!{python}
"""Stands in for srun inside a Slurm allocation of this machine's "nodes": srun [OPTIONS] COMMAND runs COMMAND once
per node of the step (SLURM_NODEID, SLURM_PROCID set; the caller's environment goes along, as srun's --export=ALL),
and records its arguments, one JSON list a line."""
import json, os, subprocess, sys
args = sys.argv[1:]
with open({calls!r}, "a") as calls:
    calls.write(json.dumps(args) + "\\n")
nodes, relative = 1, 0
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if "=" not in flag and flag not in ("--overlap",):
        value = args.pop(0)
        nodes = int(value) if flag == "--nodes" else nodes
        relative = int(value) if flag == "--relative" else relative
env = dict(os.environ)
procs = [subprocess.Popen(args, env=env | {{"SLURM_NODEID": str(relative + i), "SLURM_PROCID": str(i)}})
         for i in range(nodes)]
codes = [proc.wait() for proc in procs]
raise SystemExit(next((code for code in codes if code), 0))
'''
FAKE_SCONTROL = """#!/bin/sh
# scontrol show hostnames: every node of the fake allocation is this machine's loopback
for i in $(seq {nodes}); do echo 127.0.0.1; done
"""


def write_fake_slurm(folder: Path, nodes: int) -> tuple[Path, Path]:
    """``srun`` and ``scontrol`` stand-ins in ``folder`` (put it first on PATH); returns (folder, the calls file)."""
    folder.mkdir(parents=True, exist_ok=True)
    calls = folder / "srun_calls.jsonl"
    (folder / "srun").write_text(FAKE_SRUN.format(python=sys.executable, calls=str(calls)))
    (folder / "scontrol").write_text(FAKE_SCONTROL.format(nodes=nodes))
    for name in ("srun", "scontrol"):
        (folder / name).chmod(0o755)
    return folder, calls


def slurm_env(folder: Path) -> dict[str, str]:
    """The environment of a driver inside the fake allocation: the stand-ins first on PATH, node 0's name."""
    path = os.pathsep.join([str(folder), os.environ.get("PATH", "")])
    return {"PATH": path, "SLURMD_NODENAME": "127.0.0.1", "SLURM_JOB_NODELIST": "127.0.0.1"}
