"""Trainer launch: accelerate configs, per-iteration trainer YAML, the command line, handbook recipe keys."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from optima.environments import resolve_env
from optima.hardware.machine import ACCELERATE_CONFIGS, resolve_accelerate_config
from optima.training.launch import TrainingError, run_training
from optima.training.launch_config import TrainLaunch, render_trainer_config, write_trainer_config

REPO = Path(__file__).resolve().parent.parent
BASE_YAMLS = sorted((REPO / "alignment-handbook/recipes").glob("*/*/base.yaml")) + sorted(
    (REPO / "alignment-handbook/recipes").glob("*/*/*/base.yaml")
)


def test_shipped_accelerate_configs():
    assert {p.stem for p in ACCELERATE_CONFIGS.glob("*.yaml")} >= {"cpu", "multi_gpu", "deepspeed_zero3", "fsdp"}
    assert yaml.safe_load((ACCELERATE_CONFIGS / "cpu.yaml").read_text())["use_cpu"] is True


@pytest.mark.parametrize(
    ("name", "gpu", "stem"), [(None, False, "cpu"), (None, True, "deepspeed_zero3"), ("fsdp", False, "fsdp")]
)
def test_resolve_accelerate_config(name, gpu, stem):
    assert resolve_accelerate_config(name, gpu) == ACCELERATE_CONFIGS / f"{stem}.yaml"


def test_accelerate_config_by_path_and_unknown(tmp_path):
    custom = tmp_path / "mine.yaml"
    custom.write_text("distributed_type: 'NO'\n")
    assert resolve_accelerate_config(str(custom), False) == custom
    with pytest.raises(FileNotFoundError, match="neither one of"):
        resolve_accelerate_config("tpu_pod", False)


def test_render_and_write_trainer_yaml(tmp_path):
    base = REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml"
    config = render_trainer_config(
        base, {"model_name_or_path": "/m", "dataset_name": "/d", "output_dir": "/o", "seed": None}
    )
    assert (config["model_name_or_path"], config["dataset_name"], config["output_dir"]) == ("/m", "/d", "/o")
    assert "seed" not in config and config["use_cpu"] is True
    out = write_trainer_config(config, tmp_path / "it0" / "trainer.yaml")
    assert yaml.safe_load(out.read_text()) == config
    assert not list(out.parent.glob("*.tmp"))


def test_launch_argv():
    env = resolve_env(sys.executable, "train")
    launch = TrainLaunch(
        "dpo", env, ACCELERATE_CONFIGS / "multi_gpu.yaml", Path("/run/trainer.yaml"), 4, ("--num_machines", "2")
    )
    assert launch.argv() == [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ACCELERATE_CONFIGS / "multi_gpu.yaml"),
        "--num_processes",
        "4",
        "--num_machines",
        "2",
        str(REPO / "alignment-handbook/scripts/run_dpo.py"),
        "--config",
        "/run/trainer.yaml",
    ]


def test_failed_training_names_its_log(tmp_path):
    fake_env = tmp_path / "py"
    fake_env.write_text("#!/bin/sh\necho 'Traceback: CUDA out of memory' >&2\nexit 3\n")
    fake_env.chmod(0o755)
    launch = TrainLaunch(
        "sft", resolve_env(str(fake_env), "train"), ACCELERATE_CONFIGS / "cpu.yaml", tmp_path / "t.yaml"
    )
    log = tmp_path / "logs" / "train.log"
    with pytest.raises(TrainingError, match="exited with 3") as info:
        run_training(launch, log)
    assert str(log) in str(info.value) and "CUDA out of memory" in str(info.value)


@pytest.mark.parametrize("path", BASE_YAMLS, ids=lambda p: str(p.relative_to(REPO / "alignment-handbook/recipes")))
def test_handbook_recipes_parse_with_installed_trl(path):
    """Every key of every base.yaml is a field of the installed TRL's dataclasses (or Optima's extras)."""
    trl = pytest.importorskip("trl")
    from optima.training.args import OptimaDPOArguments, OptimaSFTArguments

    is_dpo = path.parent.name.endswith("_dpo") and path.parent.name != "sft" or path.parent.name == "dpo"
    config_cls, extra = (trl.DPOConfig, OptimaDPOArguments) if is_dpo else (trl.SFTConfig, OptimaSFTArguments)
    values = yaml.safe_load(path.read_text())
    # bf16 recipes are for GPUs; the key set is what is checked here.
    values |= {"output_dir": "/tmp/unused", "dataset_name": "/tmp/unused", "bf16": False, "use_cpu": True}
    parser = trl.TrlParser((trl.ScriptArguments, config_cls, trl.ModelConfig, extra))
    _, config, model, extras = parser.parse_dict(values, allow_extra_keys=False)
    assert config.learning_rate > 0 and model.model_name_or_path
    if is_dpo:
        assert extras.max_prompt_length < config.max_length  # enforced for every shipped DPO recipe
