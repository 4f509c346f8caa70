"""Multi-process training on the CPU with the real trainer scripts: sharded saves, resume, who writes.

Every run here is ``alignment-handbook/scripts/run_{sft,dpo}.py`` under ``accelerate launch`` with 2 processes
(gloo), built by ``TrainLaunch`` and run by ``run_training`` as a pipeline stage does, on the tiny Llama:

* An FSDP config, which accelerate runs unsharded on CPU processes (the trainer warns; see ``SHARDING_ON_CPU``):
  the checkpoint holds the full weights, equal to those of a plain data-parallel 2-process run with the same seed
  and data (every rank holds every weight there, so nothing can be lost) and different from the start; the
  completion marker counts the tensors checked. DeepSpeed ZeRO-3 (where ``deepspeed`` is importable) runs the same
  checks as a strict expected failure: on CPU ranks accelerate 1.15 and DeepSpeed disagree on the world size.
* A run killed after it saved ``checkpoint-N`` resumes from it (``save_strategy: steps`` +
  ``resume_from_checkpoint: true``) and ends with the weights of a run that was never interrupted.
* Only rank 0 writes the final checkpoint; no rank writes into the dataset folder
  (``tests/write_audit/sitecustomize.py`` records each process's writes).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from optima.environments import resolve_env
from optima.hardware.machine import ACCELERATE_CONFIGS
from optima.serving.processes import stop_group
from optima.store import save_splits
from optima.training.checkpoint import clear_partial_output, trainer_checkpoints
from optima.training.common import is_complete, read_completion
from optima.training.launch import TrainingError, run_training
from optima.training.launch_config import TrainLaunch
from tests.helpers import tiny_trainer_yaml
from tests.test_dpo_train import PAIRS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
AUDIT_PATH = Path(__file__).resolve().parent / "write_audit"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STRATEGIES = [
    "fsdp",
    pytest.param(
        "zero3",
        marks=[
            pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed"),
            # Found on this machine (deepspeed 0.19.8 beside accelerate 1.15): without an accelerator device
            # accelerate's state counts one process while DeepSpeed's CPU accelerator counts two, so DeepSpeed's
            # batch-size check stops every rank before the first step. Passes once accelerate counts CPU ranks.
            pytest.mark.xfail(
                strict=True,
                raises=TrainingError,
                reason="accelerate 1.15 runs DeepSpeed only on accelerator devices (CPU ranks: world size 1 vs 2)",
            ),
        ],
    ),
]
SFT_ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Alice and Bob answer ."},
            {"role": "user", "content": f"Bob : the answer of {a} + {b} is"},
            {"role": "assistant", "content": f"Alice : the answer is <A> {(a + b) % 10} </A>"},
        ]
    }
    for a in range(4)
    for b in range(4)
]


def cpu_accelerate_config(folder: Path, name: str) -> Path:
    """A shipped accelerate config made to run 2 processes on this CPU (fp32, no device-only options)."""
    source = {"ddp": "cpu", "fsdp": "fsdp", "zero3": "deepspeed_zero3"}[name]
    config = yaml.safe_load((ACCELERATE_CONFIGS / f"{source}.yaml").read_text())
    config |= {"use_cpu": name != "zero3", "mixed_precision": "no", "num_processes": 2}
    if name == "fsdp":  # it moves parameters to an accelerator device, which the CPU has none of
        config["fsdp_config"] |= {"fsdp_cpu_ram_efficient_loading": False}
    path = folder / f"accelerate_{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch_env(audit: Path) -> dict[str, str]:
    audit.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(REPO), str(AUDIT_PATH), os.environ.get("PYTHONPATH", "")) if p)
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    return env | {"OPTIMA_TEST_WRITE_AUDIT": str(audit), "DS_ACCELERATOR": "cpu"}


def train(kind: str, accelerate: Path, config: Path, work: Path) -> Path:
    """Run one trainer script through the pipeline's launcher; return the audit folder of its writes."""
    launch = TrainLaunch(kind, resolve_env(sys.executable, "train"), accelerate, config)
    audit = work / f"audit_{config.stem}"
    run_training(launch, work / f"{config.stem}.log", extra_env=launch_env(audit))
    return audit


def read_writes(audit: Path) -> list[tuple[str, str]]:
    """(rank, path) of every file opened for writing by the processes of one run."""
    rows = []
    for path in audit.glob("*.tsv"):
        rows += [tuple(line.split("\t", 1)) for line in path.read_text().splitlines()]
    return rows


def folder_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
        if p.is_file()
    }


def load_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


# What each strategy really does on CPU processes. accelerate 1.15 turns an FSDP config into FSDP only for
# accelerator device types (CUDA, XPU, NPU, ...): CPU processes train the whole model on each rank, and the
# trainer says so. DeepSpeed brings its own CPU accelerator, so ZeRO-3 really shards here.
SHARDING_ON_CPU = {"fsdp": "replicated (multi_cpu)", "zero3": "deepspeed zero-3"}


def assert_sharded(log: Path, strategy: str) -> None:
    """Both processes report the sharding ``strategy`` really gets on CPU, and an FSDP fallback is warned about."""
    sharding, text = SHARDING_ON_CPU[strategy], log.read_text()
    assert f"train | process 1 of 2 | {sharding}" in text and f"train | process 2 of 2 | {sharding}" in text
    if strategy == "fsdp":
        assert "asks for FSDP, but accelerate runs the model whole on every process" in text


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    work = tmp_path_factory.mktemp("sharded")
    save_splits({"train": SFT_ROWS}, work / "sft_data")
    save_splits({"train": PAIRS * 2}, work / "dpo_data")
    return work


@pytest.fixture(scope="module")
def data_parallel_reference(workspace, tiny_model):
    """Each method trained once by 2 plain data-parallel CPU processes (the default ``cpu`` config, 2 processes)."""
    accelerate = cpu_accelerate_config(workspace, "ddp")
    outputs = {}
    # The SFT run asks for flash-attn, as the Llama-3 YAMLs do: not installed here, so it trains with sdpa.
    for kind, extra in (("sft", {"attn_implementation": "flash_attention_2"}), ("dpo", {"beta": 0.1})):
        out = workspace / f"{kind}_ddp"
        config = tiny_trainer_yaml(
            workspace / f"{kind}_ddp.yaml", tiny_model, workspace / f"{kind}_data", out, **extra
        )
        train(kind, accelerate, config, workspace)
        outputs[kind] = out
    return outputs


def test_two_cpu_processes_start_and_flash_attention_falls_back_to_sdpa(workspace, data_parallel_reference):
    log = (workspace / "sft_ddp.log").read_text()
    launch = TrainLaunch("sft", resolve_env(sys.executable, "train"), ACCELERATE_CONFIGS / "cpu.yaml", Path("t"), 2)
    assert "--multi_gpu" in launch.argv()  # accelerate's torchrun launcher, not its one-process one
    for rank in (1, 2):  # one process group of two, each holding the whole model
        assert f"train | process {rank} of 2 | replicated (multi_cpu)" in log
    assert log.count("flash_attention_2 was asked for") == 1  # one warning, from the main process, then sdpa


@pytest.mark.parametrize("kind", ["sft", "dpo"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_run_saves_the_gathered_weights(kind, strategy, workspace, tiny_model, data_parallel_reference):
    import torch

    dataset = workspace / f"{kind}_data"
    before_data = folder_digest(dataset)
    out = workspace / f"{kind}_{strategy}"
    extra = {"beta": 0.1} if kind == "dpo" else {}
    if strategy == "zero3":
        extra |= {"use_cpu": False}  # DeepSpeed's own CPU accelerator (DS_ACCELERATOR=cpu) runs it
    config = tiny_trainer_yaml(workspace / f"{kind}_{strategy}.yaml", tiny_model, dataset, out, **extra)
    audit = train(kind, cpu_accelerate_config(workspace, strategy), config, workspace)

    assert_sharded(workspace / f"{kind}_{strategy}.log", strategy)
    assert is_complete(out)
    start, reference, saved = (load_weights(p) for p in (tiny_model, data_parallel_reference[kind], out))
    assert read_completion(out)["tensors"] == len(saved) == len(start)
    assert all(saved[name].shape == start[name].shape for name in start)
    for name in start:  # the same training as the data-parallel run, shard by shard
        torch.testing.assert_close(saved[name], reference[name], atol=2e-4, rtol=1e-3, msg=name)
    assert max(float((saved[n] - start[n]).abs().max()) for n in start) > 1e-3  # and it did train

    assert folder_digest(dataset) == before_data  # nobody wrote into the dataset
    writes = read_writes(audit)
    assert not [path for _, path in writes if path.startswith(str(dataset))]
    final = {rank for rank, path in writes if Path(path).parent == out}
    assert final == {"0"}, writes  # config, tokenizer and marker: rank 0 only


def test_killed_run_resumes_from_its_last_trainer_checkpoint(workspace, tiny_model):
    accelerate = cpu_accelerate_config(workspace, "ddp")
    steps = {"max_steps": 60, "learning_rate": 1.0e-3}
    reference = workspace / "resume_reference"
    config = tiny_trainer_yaml(
        workspace / "resume_reference.yaml", tiny_model, workspace / "sft_data", reference, **steps
    )
    train("sft", accelerate, config, workspace)

    out = workspace / "resumed"
    saving = steps | {"save_strategy": "steps", "save_steps": 2, "save_total_limit": 2, "resume_from_checkpoint": True}
    config = tiny_trainer_yaml(workspace / "resumed.yaml", tiny_model, workspace / "sft_data", out, **saving)
    launch = TrainLaunch("sft", resolve_env(sys.executable, "train"), accelerate, config)
    env = (
        os.environ
        | launch.env_vars()
        | launch_env(workspace / "audit_killed")
        | {"PYTHONPATH": launch_env(workspace)["PYTHONPATH"]}
    )
    with (workspace / "killed.log").open("wb") as log:
        proc = subprocess.Popen(
            launch.argv(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True,
        )  # fmt: skip
        deadline_polls = 0
        while not [p for p in trainer_checkpoints(out) if (p / "trainer_state.json").is_file()]:
            assert proc.poll() is None, (workspace / "killed.log").read_text()[-3000:]
            deadline_polls += 1
            assert deadline_polls < 6000, "no trainer checkpoint within 10 minutes"
            try:
                proc.wait(timeout=0.1)  # poll interval of a wait with a deadline
            except subprocess.TimeoutExpired:
                pass
        stop_group(proc, 30, "the trainer")  # what the driver does when it is stopped mid-training
    assert proc.returncode != 0, proc.returncode
    assert not is_complete(out)

    kept = clear_partial_output(out)  # what the stage does before it reruns a killed training
    assert kept and kept == trainer_checkpoints(out)
    resumed_from = int(kept[-1].name.split("-")[1])
    assert resumed_from < 60
    train("sft", accelerate, config, workspace)
    log = (workspace / "resumed.log").read_text()
    assert f"train | resuming from {kept[-1]}" in log
    logged_steps = [line for line in log.splitlines() if line.startswith("{") and "'loss':" in line]
    assert len(logged_steps) == 60 - resumed_from  # it went on from step N instead of starting over
    assert is_complete(out) and not trainer_checkpoints(out)  # intermediate states go once the result is whole
    import torch

    saved, expected = load_weights(out), load_weights(reference)
    for name in expected:  # the same rows in the same steps as a run that was never interrupted
        torch.testing.assert_close(saved[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_lora_run_saves_the_merged_weights(strategy, workspace, tiny_model):
    """LoRA, sharded: the adapter is gathered and merged on the main process, as in a data-parallel run."""
    import torch

    lora = {"use_peft": True, "lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"]}
    outputs = {}
    for run in ("ddp", strategy):
        out = workspace / f"lora_{run}"
        extra = lora | ({"use_cpu": False} if run == "zero3" else {})
        config = tiny_trainer_yaml(workspace / f"lora_{run}.yaml", tiny_model, workspace / "sft_data", out, **extra)
        if not (run == "ddp" and is_complete(out)):  # the reference is shared by both strategies
            train("sft", cpu_accelerate_config(workspace, run), config, workspace)
        assert is_complete(out) and not (out / "adapter_config.json").exists()  # a plain, servable model
        outputs[run] = load_weights(out)
    assert_sharded(workspace / f"lora_{strategy}.log", strategy)
    start = load_weights(tiny_model)
    assert set(outputs[strategy]) == set(start)
    for name in start:
        torch.testing.assert_close(outputs[strategy][name], outputs["ddp"][name], atol=2e-4, rtol=1e-3, msg=name)
    changed = {name for name in start if not torch.equal(outputs[strategy][name], start[name])}
    assert changed and all(".q_proj." in name or ".v_proj." in name for name in changed)  # LoRA merged there only
