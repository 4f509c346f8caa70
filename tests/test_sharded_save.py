"""Really sharded saves on CPU processes: FSDP2 and DeepSpeed ZeRO-3 through Optima's own save path.

``tests/sharded_save_driver.py`` runs one rank (gloo, 2 processes, no accelerate launcher: accelerate shards only
on accelerator devices) and saves with ``optima.training.common.save_checkpoint``. The checkpoint must hold the
same weights as the same training unsharded, and the ranks must really have held shards.

ZeRO-3 on rank 0 alone: ``verify_saved_weights`` and ``merge_lora`` build models while accelerate's HF DeepSpeed
config is set. Built inside ``deepspeed.zero.Init``, such a model enters a broadcast the other ranks never join (the
save hung until the collective timeout and wrote no completion marker). The default suite proves without DeepSpeed
that neither enters ``zero.Init`` or a collective; with DeepSpeed importable, a real 2-process ZeRO-3 run (full and
LoRA in one process group, about 10 s once DeepSpeed has built its CPU communication op) saves, checks and merges.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import types
from pathlib import Path

import pytest

from optima.identity import TOLERANCES, compare_probe, read_probe, score_ids
from optima.serving.vllm_server import find_free_port
from optima.training import launch
from optima.training.common import is_complete, read_completion
from tests.sharded_save_driver import VARIANTS, train_reference

REPO = Path(__file__).resolve().parent.parent
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
RUN_TIMEOUT_S = 240  # both ranks together; a rank left alone in a collective fails after the driver's TIMEOUT_S


def run_ranks(strategy: str, model: Path, out: Path, world_size: int = 2) -> None:
    """Run every rank of the driver (``optima.training.launch.run_ranks``, as ``make gpu-check`` does); fail with the
    logs when one fails or the run outlives its deadline."""
    port = find_free_port("127.0.0.1", 29500 + os.getpid() % 3000)
    argv = [sys.executable, "-m", "tests.sharded_save_driver", "--strategy", strategy, "--model", str(model)]
    argv += ["--out", str(out)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env |= {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    logs = [out.parent / f"{out.name}.rank{rank}.log" for rank in range(world_size)]
    codes = launch.run_ranks(argv, env, logs, RUN_TIMEOUT_S)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-2500:]}" for log in logs)
    assert codes == [0] * world_size, f"ranks ended with {codes} (None: still running at the deadline)\n{tails}"


def assert_equals_reference(out: Path, model: Path, lora: bool) -> None:
    """The saved checkpoint holds the unsharded run's weights, and they moved from the start."""
    import torch
    from safetensors.torch import load_file

    assert is_complete(out)
    marker = read_completion(out)
    assert marker["sharded"] is True and marker["rank"] == 0  # the ranks held shards; rank 0 wrote the marker
    saved, start = load_file(out / "model.safetensors"), load_file(model / "model.safetensors")
    trained = train_reference(str(model), world_size=2, lora=lora)
    # The weights probe that the sharded model recorded (its forwards gather shards) is what the unsharded one says.
    probe = read_probe(out)
    assert compare_probe(probe, *score_ids(trained, probe.input_ids), TOLERANCES["float32"]) is None
    reference = trained.state_dict()
    assert set(saved) == set(start) and marker["tensors"] == len(start)
    for name in start:
        close = {"atol": 2e-4, "rtol": 1e-3}  # Adam turns rounding in near-zero gradients into ~1e-5 differences
        torch.testing.assert_close(saved[name], reference[name], **close, msg=lambda m, name=name: f"{name}: {m}")
    moved = {name for name in start if not torch.equal(saved[name], start[name])}
    assert moved if not lora else moved and all(".q_proj." in n or ".v_proj." in n for n in moved)


def test_fsdp2_on_two_cpu_processes_saves_the_full_weights(tiny_model, tmp_path):
    run_ranks("fsdp2", tiny_model, tmp_path / "fsdp2")
    for variant in VARIANTS:
        assert_equals_reference(tmp_path / "fsdp2" / variant, tiny_model, lora=variant == "lora")


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (run `make setup`)")
@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")),
    reason="no C++ compiler: DeepSpeed builds its CPU communication op on first use (install g++)",
)
def test_zero3_on_two_cpu_processes_saves_verifies_and_merges_without_hanging(tiny_model, tmp_path):
    run_ranks("zero3", tiny_model, tmp_path / "zero3")
    for variant in VARIANTS:
        assert_equals_reference(tmp_path / "zero3" / variant, tiny_model, lora=variant == "lora")


class ZeroThreeConfig:
    """Stands for accelerate's ``HfDeepSpeedConfig`` with ZeRO-3 (transformers only asks ``is_zero3``)."""

    config = {"zero_optimization": {"stage": 3}}

    def is_zero3(self) -> bool:
        return True


@contextlib.contextmanager
def zero3_everywhere(monkeypatch):
    """A ZeRO-3 HF config set as accelerate sets it, a ``deepspeed`` whose ``zero.Init`` fails, no collectives.

    Inside, anything that would build a partitioned model or wait for the other ranks raises ``AssertionError``.
    """
    import torch.distributed as dist
    from transformers.integrations import deepspeed as hf_deepspeed

    def refuse(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"rank 0 alone entered {what}: the other ranks would never join")

        return fail

    fake = types.ModuleType("deepspeed")
    fake.zero = types.SimpleNamespace(Init=refuse("deepspeed.zero.Init"), GatheredParameters=refuse("gather"))
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    for name in ("broadcast", "all_gather", "all_reduce", "barrier", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, refuse(f"torch.distributed.{name}"))
    config = ZeroThreeConfig()
    hf_deepspeed.set_hf_deepspeed_config(config)
    try:
        yield
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()


def test_rank0_checks_and_merges_outside_zero3(monkeypatch, tiny_model):
    """Rank 0's own work after the gather (check the files, merge LoRA) builds models whole, then sets ZeRO-3 back."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    from optima.training.checkpoint import merge_lora, verify_saved_weights

    # What the trainer holds after the gather: its LoRA model and the full tensors (built before ZeRO-3 is faked).
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    gathered = {name: tensor.clone() for name, tensor in peft_model.state_dict().items()}
    with zero3_everywhere(monkeypatch):
        assert is_deepspeed_zero3_enabled()
        assert verify_saved_weights(tiny_model) == 21
        merged = merge_lora(peft_model, gathered)
        assert is_deepspeed_zero3_enabled()  # the trainer's ZeRO-3 setting is back for whatever follows
    expected = peft_model.merge_and_unload().state_dict()
    assert set(merged.state_dict()) == set(expected)
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], msg=lambda m, name=name: f"{name}: {m}")


def test_the_shipped_fsdp_config_is_fsdp2_as_accelerate_reads_it(monkeypatch):
    """``fsdp.yaml`` through accelerate's own launcher code (config -> environment -> plugin): FSDP2, sharded state."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    from optima.hardware.machine import ACCELERATE_CONFIGS

    args = launch_command_parser().parse_args(["--config_file", str(ACCELERATE_CONFIGS / "fsdp.yaml"), "train.py"])
    args, _, _ = _validate_launch_command(args)
    for name, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(name, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"  # resumable trainer checkpoints; the final save gathers
