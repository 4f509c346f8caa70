"""Checkpoint saving and checking, resume points, the multi-CPU launch and the flash-attn fallback (no training).

The real multi-process runs (FSDP, ZeRO-3, a killed run resumed) are in ``tests/test_sharded_training.py``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from optima.environments import resolve_env
from optima.hardware.machine import ACCELERATE_CONFIGS
from optima.identity import PROBE_KEY, record_probe
from optima.training.checkpoint import (
    CheckpointError,
    clear_partial_output,
    find_weight_problems,
    resume_checkpoint,
    trainer_checkpoints,
)
from optima.training.common import (
    COMPLETE_MARKER,
    is_complete,
    read_completion,
    resolve_attn_implementation,
    save_checkpoint,
)
from optima.training.launch_config import CPU_ALLOCATOR_ENV, TrainLaunch, cpu_allocator_env


@pytest.mark.parametrize(
    ("saved_shape", "fill", "problem"),
    [
        ((4, 3), 1.0, None),
        (None, None, "w: missing"),
        ((3, 4), 1.0, "w: shape (3, 4), expected (4, 3)"),
        ((0,), None, "w: shape (0,), expected (4, 3)"),  # a ZeRO-3 placeholder saved without gathering
        ((4, 3), 0.0, "w: all zeros"),
    ],
)
def test_find_weight_problems(saved_shape, fill, problem):
    import torch

    saved = {} if saved_shape is None else {"w": torch.full(saved_shape, fill) if fill is not None else torch.empty(0)}
    saved["norm"] = torch.zeros(3)  # a 1-D tensor may be zero (biases)
    problems = find_weight_problems({"w": (4, 3), "norm": (3,)}, saved)
    assert problems == ([] if problem is None else [problem])


def make_checkpoints(output_dir: Path, steps: list[int], complete: bool = True) -> None:
    for step in steps:
        folder = output_dir / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        if complete:
            (folder / "trainer_state.json").write_text("{}")


def test_resume_checkpoint_picks_the_newest_complete_trainer_state(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path), resume_from_checkpoint=None)
    make_checkpoints(tmp_path, [2, 10, 4])
    make_checkpoints(tmp_path, [12], complete=False)  # killed while saving: no trainer_state.json yet
    assert resume_checkpoint(args) is None  # not asked to resume
    for value in (True, "true", "latest"):
        args.resume_from_checkpoint = value
        assert resume_checkpoint(args) == str(tmp_path / "checkpoint-10")
    args.resume_from_checkpoint = str(tmp_path / "checkpoint-2")
    assert resume_checkpoint(args) == str(tmp_path / "checkpoint-2")
    args.resume_from_checkpoint = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="resume_from_checkpoint: .*nowhere.* is not a folder"):
        resume_checkpoint(args)
    assert resume_checkpoint(SimpleNamespace(output_dir=str(tmp_path / "empty"), resume_from_checkpoint=True)) is None


def test_clear_partial_output_keeps_the_trainer_checkpoints(tmp_path):
    out = tmp_path / "checkpoint"
    make_checkpoints(out, [3, 1])
    (out / "model.safetensors").write_text("half a file")
    (out / "runs").mkdir()
    assert clear_partial_output(out) == [out / "checkpoint-1", out / "checkpoint-3"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "checkpoint-3"]
    assert clear_partial_output(tmp_path / "missing") == [] and trainer_checkpoints(tmp_path / "missing") == []


class FakeAccelerator:
    """What ``save_checkpoint`` uses of accelerate: a gathered state dict, the main-process flag, a barrier."""

    is_main_process = True

    def __init__(self, state_dict):
        self.state_dict = state_dict

    def get_state_dict(self, model):
        return self.state_dict

    def unwrap_model(self, model):
        return model

    def wait_for_everyone(self):
        pass


def fake_trainer(model, state_dict):
    return SimpleNamespace(model=model, model_wrapped=model, accelerator=FakeAccelerator(state_dict))


def test_a_gathered_save_is_verified_then_marked(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    save_checkpoint(fake_trainer(model, model.state_dict()), tokenizer, str(tmp_path / "ok"), {"train_rows": 4})
    assert is_complete(tmp_path / "ok")
    assert '"tensors": ' + str(len(list(model.parameters()))) in (tmp_path / "ok" / COMPLETE_MARKER).read_text()
    marker = json.loads((tmp_path / "ok" / COMPLETE_MARKER).read_text())
    assert marker[PROBE_KEY] == record_probe(model, tokenizer).to_json()  # the trained model's probe, recorded
    assert PROBE_KEY not in read_completion(tmp_path / "ok")  # the stage's metrics do not carry it


def test_a_save_of_unsharded_placeholders_is_never_marked_complete(tiny_model, tmp_path):
    """Rank 0's own view of a ZeRO-3 model: every parameter an empty placeholder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    placeholders = {name: torch.empty(0) for name in model.state_dict()}
    with pytest.raises(CheckpointError, match=r"incomplete .*model.embed_tokens.weight: shape \(0,\)"):
        save_checkpoint(fake_trainer(model, placeholders), tokenizer, str(tmp_path / "bad"), {})
    assert not is_complete(tmp_path / "bad")


@pytest.mark.parametrize(
    ("config", "processes", "multi_cpu"),
    [("cpu", 2, True), ("cpu", None, False), ("cpu", 1, False), ("multi_gpu", 2, False), ("fsdp", 2, False)],
)
def test_a_cpu_config_with_several_processes_uses_the_torchrun_launcher(config, processes, multi_cpu):
    launch = TrainLaunch(
        "sft", resolve_env(sys.executable, "train"), ACCELERATE_CONFIGS / f"{config}.yaml", Path("t.yaml"), processes
    )
    assert ("--multi_gpu" in launch.argv()) is multi_cpu
    env = launch.env_vars()
    assert ("ACCELERATE_USE_CPU" in env) is multi_cpu
    allocator = {k: v for k, v in env.items() if k.startswith("MALLOC_")}
    assert allocator == (cpu_allocator_env() if config == "cpu" else {})  # the CPU trainer's heap settings


def test_the_users_allocator_settings_win(monkeypatch):
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TOP_PAD_", raising=False)
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")
    assert sorted(cpu_allocator_env()) == ["MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_"]
    assert (
        cpu_allocator_env({})
        == CPU_ALLOCATOR_ENV
        == {
            "MALLOC_MMAP_MAX_": "0",
            "MALLOC_TRIM_THRESHOLD_": str(64 * 1024**3),
            "MALLOC_TOP_PAD_": str(1024**3),
        }
    )


def test_flash_attention_falls_back_to_sdpa_with_one_warning(caplog):
    pytest.importorskip("transformers")
    from transformers.utils import is_flash_attn_2_available

    if is_flash_attn_2_available():
        pytest.skip("flash-attn runs here: nothing to fall back from")
    with caplog.at_level(logging.WARNING, logger="optima.training.common"):
        assert resolve_attn_implementation("flash_attention_2") == "sdpa"
        assert resolve_attn_implementation("flash_attention_2", warn=False) == "sdpa"  # other ranks stay quiet
        assert resolve_attn_implementation("eager") == "eager"
    assert [r.message for r in caplog.records].count(
        "attn_implementation: flash_attention_2 was asked for, but flash-attn is not installed or no CUDA GPU is "
        "visible; using sdpa instead"
    ) == 1


def test_the_saved_files_are_checked_by_their_headers_without_reading_the_weights(tiny_model, tmp_path):
    """What was saved is checked in memory; the files must declare every parameter and be as long as declared."""
    import shutil

    from transformers import AutoModelForCausalLM

    from optima.training.checkpoint import saved_headers, verify_saved_checkpoint

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    state = model.state_dict()
    folder = tmp_path / "ck"
    shutil.copytree(tiny_model, folder)
    assert verify_saved_checkpoint(folder, state) == len(list(model.parameters()))
    assert saved_headers(folder)["model.norm.weight"] == tuple(state["model.norm.weight"].shape)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])  # a write cut short (disk full, killed)
    with pytest.raises(CheckpointError, match=r"model.safetensors: \d+ bytes, its header describes \d+"):
        verify_saved_checkpoint(folder, state)
    from safetensors.torch import save_file

    kept = {name: tensor for name, tensor in state.items() if name != "model.norm.weight"}
    save_file({k: v.contiguous() for k, v in kept.items() if k != "lm_head.weight"}, weights)
    with pytest.raises(CheckpointError, match=r"model.norm.weight: not in the saved files"):
        verify_saved_checkpoint(folder, state)
