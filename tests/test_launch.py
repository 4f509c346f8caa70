"""Trainer launch: accelerate configs, per-iteration trainer YAML, the command line, handbook recipe keys."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import yaml

from optima.environments import resolve_env
from optima.hardware.machine import ACCELERATE_CONFIGS, resolve_accelerate_config
from optima.training.launch import TrainingError, run_training
from optima.training.launch_config import TrainLaunch, render_trainer_config, write_trainer_config
from tests._task_fixtures import resolve_test_data_dir
from tests.conftest import requires_vllm
from tests.helpers import tiny_trainer_yaml

REPO = Path(__file__).resolve().parent.parent
VLLM_ENV = REPO / ".venvs" / "vllm"
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


# ---------------------------------------------------------------- the preflight


def preflight_values(tmp_path: Path, model: Path) -> dict:
    """An iSFT recipe over a tiny trainer YAML (max_length 64), writing to ``tmp_path/run``."""
    base = tiny_trainer_yaml(tmp_path / "base.yaml", model, tmp_path / "unused", tmp_path / "unused_out")
    return {
        "dataset_type": "arc",
        "initial_model_path": str(model),
        "data_dir": str(resolve_test_data_dir()),
        "output_dir": str(tmp_path / "run"),
        "origin_yaml_path": str(base),
        "accelerate_config": "cpu",
        "loss_backend": "hf",
    }


def test_preflight_rows_fill_the_length_limits(tiny_model):
    """SFT: max_length tokens, all trained; DPO: the prompt at its limit, prompt + completion past max_length (the
    trainer cuts them); one optimizer step of rows (batch x accumulation x processes)."""
    pytest.importorskip("datasets")
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from optima.training.common import preflight_rows

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    args = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=3, world_size=2)
    sft = preflight_rows(tokenizer, args, 64)
    assert len(sft) == 12 and {len(row["input_ids"]) for row in sft} == {64}
    assert all(row["labels"] == row["input_ids"] and -100 not in row["labels"] for row in sft)
    dpo = preflight_rows(tokenizer, args, 64, 24)
    prompt = tokenizer.apply_chat_template(dpo[0]["prompt"], add_generation_prompt=True)["input_ids"]
    chosen = tokenizer.apply_chat_template(dpo[0]["prompt"] + dpo[0]["chosen"])["input_ids"]
    assert len(dpo) == 12 and 24 <= len(prompt) < 64 < len(chosen) - len(prompt)


@pytest.mark.slow
def test_the_preflight_takes_one_step_records_its_peak_and_a_rerun_skips_it(tiny_model, tmp_path, caplog):
    from optima.config import SFTRecipe, load_recipe
    from optima.run import build_run
    from optima.training.launch import read_preflight, run_preflight

    recipe = load_recipe(SFTRecipe, None, preflight_values(tmp_path, tiny_model), check_paths=False)
    ctx = build_run(recipe, {"train": resolve_env(sys.executable, "train")}, gpu=False)
    record = run_preflight(recipe, ctx.envs["train"], ctx.hardware, ctx.paths)
    assert record == read_preflight(ctx.paths.output_dir)
    sft = record["trainers"]["sft"]
    assert sft["processes"] == 1 and record["peak_rss_bytes"] == sft["peak_rss_bytes"] > 200 * 2**20  # torch alone
    assert not (ctx.paths.output_dir / "preflight").exists()  # the work folder goes, nothing was saved
    log = ctx.paths.driver_log.parent / "preflight_sft.log"
    text = log.read_text()
    assert "'train_runtime'" in text and "train | process 1 of 1" in text  # it trained, under accelerate
    assert "'epoch'" in text and "max_steps" not in text  # one step ("epoch" logged), no error
    before = log.stat().st_mtime_ns
    with caplog.at_level(logging.INFO):
        assert run_preflight(recipe, ctx.envs["train"], ctx.hardware, ctx.paths) == record
    assert "skipped" in caplog.text and log.stat().st_mtime_ns == before  # the rerun started nothing


@requires_vllm
def test_a_trainer_that_cannot_take_a_step_stops_the_run_before_the_first_generation(tiny_model, tmp_path, capsys):
    """A trainer key TRL rejects (``--trainer_set``): the run stops in the preflight, with the trainer's own error,
    before any server starts or any conversation is generated."""
    import time

    import sft_script

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(preflight_values(tmp_path, tiny_model)))
    argv = ["--train_config_path", str(path), "--vllm_env", str(VLLM_ENV), "--alignment_env", sys.executable]
    started = time.monotonic()
    assert sft_script.main([*argv, "--trainer_set", "no_such_trl_key=1"]) == 1
    assert time.monotonic() - started < 120  # imports and one parse: not a generation
    err, run = capsys.readouterr().err, tmp_path / "run"
    assert "preflight sft: sft training exited with 1" in err and str(run / "logs" / "preflight_sft.log") in err
    assert "no_such_trl_key" in err  # TRL's own message, quoted from the trainer's log
    assert not list(run.rglob("generations.jsonl")) and not list(run.rglob("vllm_*.log"))
    assert not (run / "logs" / "loss_server.log").exists() and not (run / "preflight.json").exists()


SMOLLM2 = REPO / "models" / "SmolLM2-135M-Instruct"
# The training env's python with its address space limited to ~6 GB (RLIMIT_AS): accelerate and the trainer run
# under it, as a trainer on a machine with that much memory would.
LIMITED_PYTHON = """#!/bin/sh
ulimit -v 6000000
exec {python} "$@"
"""


@pytest.mark.slow
@requires_vllm
@pytest.mark.skipif(not SMOLLM2.is_dir(), reason=f"no {SMOLLM2} (make setup)")
def test_a_max_length_the_trainer_has_no_memory_for_stops_the_run_in_the_preflight(tmp_path, capsys):
    """The demo's trainer at max_length 16384 in 6 GB: the step's first large allocation fails, with torch's own
    message, before any server starts or any conversation is generated."""
    import sft_script

    python = tmp_path / "python"
    python.write_text(LIMITED_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    values = preflight_values(tmp_path, SMOLLM2) | {"initial_model_path": str(SMOLLM2)}
    values |= {"origin_yaml_path": str(REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml")}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(values))
    argv = ["--train_config_path", str(tmp_path / "recipe.yaml"), "--vllm_env", str(VLLM_ENV)]
    assert sft_script.main([*argv, "--alignment_env", str(python), "--trainer_set", "max_length=16384"]) == 1
    err, run = capsys.readouterr().err, tmp_path / "run"
    assert "preflight sft: sft training exited with 1" in err and "DefaultCPUAllocator: can't allocate memory" in err
    assert not list(run.rglob("generations.jsonl")) and not list(run.rglob("vllm_*.log"))
