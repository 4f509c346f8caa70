"""Trainer settings from the recipe (``trainer_overrides``) and the command line (``--trainer_set``).

They reach the rendered trainer YAML over the base YAML (with a warning per base key replaced), show in
``--dry-run``, and are part of the train stage's identity. The LoRA recipe for one GPU parses with TRL.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import yaml

from optima.config import RecipeError, SFTDPORecipe, SFTRecipe, apply_overrides, load_recipe, stage_fields
from optima.config.rules import trainer_overrides_for
from optima.hardware.machine import ACCELERATE_CONFIGS
from optima.lineage import fields_hash
from optima.training.launch_config import describe_trainer_overrides, render_trainer_config

REPO = Path(__file__).resolve().parent.parent
SFT_BASE = REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml"
LORA = REPO / "alignment-handbook/recipes/llama3-8b/arc_sft_lora/base.yaml"


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_dotted_set_adds_one_key_to_a_mapping_and_keeps_the_others():
    raw = {"trainer_overrides": {"learning_rate": 1e-5}, "seed": 1}
    out = apply_overrides(raw, [("trainer_overrides.num_train_epochs", 2), ("trainer_overrides.dpo.beta", 0.1)])
    assert out["trainer_overrides"] == {"learning_rate": 1e-5, "num_train_epochs": 2, "dpo": {"beta": 0.1}}
    assert raw["trainer_overrides"] == {"learning_rate": 1e-5}  # the recipe read from YAML is not changed
    with pytest.raises(RecipeError, match="seed is 1, not a mapping"):
        apply_overrides(raw, [("seed.x", 2)])


def test_trainer_set_merges_over_the_recipes_mapping(in_repo):
    from optima.cli import trainer_set_overrides

    sets = trainer_set_overrides(["learning_rate=2e-5", "dpo.beta=0.3", "lora_target_modules=[q_proj, v_proj]"])
    recipe = load_recipe(
        SFTDPORecipe,
        REPO / "train/sft_dpo_recipes/arc.yaml",
        ["trainer_overrides={num_train_epochs: 1, learning_rate: 1.0e-6}", *sets],
        check_paths=False,
    )
    assert trainer_overrides_for(recipe, "sft") == {
        "num_train_epochs": 1,
        "learning_rate": 2e-5,  # the command line wins
        "lora_target_modules": ["q_proj", "v_proj"],
    }
    assert trainer_overrides_for(recipe, "dpo")["beta"] == 0.3
    assert "beta" not in trainer_overrides_for(recipe, "sft")
    with pytest.raises(RecipeError, match="--trainer_set expects key=value"):
        trainer_set_overrides(["learning_rate"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"output_dir": "/elsewhere"}, "set by the orchestrator; use output_dir"),
        ({"seed": 3}, "use seed"),
        ({"dpo": {"beta": 0.1}}, "this loop runs no dpo trainer"),
        ({"sft": 3}, "must be a mapping"),
        ({"sft": {"model_name_or_path": "x"}}, "set by the orchestrator"),
    ],
)
def test_bad_trainer_overrides_name_the_field(in_repo, overrides, message):
    with pytest.raises(RecipeError, match=message) as info:
        load_recipe(SFTRecipe, REPO / "train/sft_recipes/arc.yaml", {"trainer_overrides": overrides}, False)
    assert "trainer_overrides" in str(info.value) and "arc.yaml" in str(info.value)


def test_overrides_are_rendered_between_the_base_and_the_iteration_values(caplog):
    user = {"learning_rate": 1e-4, "use_peft": True, "num_train_epochs": 3}  # epochs: same as the base
    with caplog.at_level(logging.WARNING, logger="optima.training.launch_config"):
        config = render_trainer_config(SFT_BASE, {"output_dir": "/o"}, user)
    assert (config["learning_rate"], config["use_peft"], config["output_dir"]) == (1e-4, True, "/o")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "learning_rate=0.0001 replaces the base value 5e-05" in warnings[0]
    assert describe_trainer_overrides(SFT_BASE, {"learning_rate": 1e-4, "use_peft": True}) == (
        "learning_rate=0.0001 (base: 5e-05), use_peft=True (new)"
    )


def test_trainer_overrides_are_part_of_the_train_stages_identity(in_repo):
    assert "trainer_overrides" in stage_fields("train", SFTRecipe)
    assert "trainer_overrides" not in stage_fields("select", SFTRecipe)
    path = REPO / "train/sft_recipes/arc.yaml"
    plain = load_recipe(SFTRecipe, path, check_paths=False)
    changed = load_recipe(SFTRecipe, path, ["trainer_overrides.learning_rate=1e-5"], check_paths=False)
    train = stage_fields("train", SFTRecipe)
    assert fields_hash(plain, train) != fields_hash(changed, train)
    select = stage_fields("select", SFTRecipe)
    assert fields_hash(plain, select) == fields_hash(changed, select)  # the data stages are kept


def test_dry_run_shows_the_overrides(in_repo, capsys):
    import sft_script

    argv = ["--train_config_path", "train/sft_recipes/demo_arc.yaml", "--vllm_env", sys.executable]
    argv += ["--alignment_env", sys.executable, "--dry-run", "--trainer_set", "learning_rate=1e-4"]
    assert sft_script.main(argv) == 0
    assert "trainer overrides: learning_rate=0.0001 (base: 5e-05)" in capsys.readouterr().out


def test_lora_recipe_for_one_gpu_builds_a_lora_config():
    trl = pytest.importorskip("trl")
    from optima.training.args import OptimaSFTArguments

    values = yaml.safe_load(LORA.read_text()) | {"output_dir": "/tmp/unused", "dataset_name": "/tmp/unused"}
    values |= {"bf16": False, "use_cpu": True}  # a GPU recipe; its keys are what is checked here
    parser = trl.TrlParser((trl.ScriptArguments, trl.SFTConfig, trl.ModelConfig, OptimaSFTArguments))
    _, config, model_args, _ = parser.parse_dict(values, allow_extra_keys=False)
    lora = trl.get_peft_config(model_args)
    modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert (lora.r, lora.lora_alpha, set(lora.target_modules)) == (16, 32, modules)
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == 16
    accelerate = yaml.safe_load((ACCELERATE_CONFIGS / "single_gpu.yaml").read_text())
    assert (accelerate["distributed_type"], accelerate["num_processes"]) == ("NO", 1)
