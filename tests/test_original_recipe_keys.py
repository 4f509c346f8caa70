"""Recipes written for the original keep loading: its key spellings, its output keys and ``mix_dataset: []``."""

from __future__ import annotations

from pathlib import Path

import pytest

from optima.config import RecipeError, SFTRecipe, load_recipe

REPO = Path(__file__).resolve().parent.parent
# The original's iSFT MATH recipe, key for key (its output roots, misspelling and empty mix list included).
ORIGINAL_MATH_SFT = """\
iteration_times: 6
initial_model_path: meta-llama/Meta-Llama-3-8B-Instruct
origin_sft_yaml_path: alignment-handbook/recipes/llama3-8b/math_sft/base.yaml
mid_yaml_root_path: ./alignment-handbook/recipes/Llama3-8b/math_sft_yaml
mid_jsonl_root_path: ./mid_jsonl/math_sft
mid_dataset_root_path: ./mid_dataset/math_sft
check_point_root_path: ./checkpoints/math_sft
dataset_type: math
mix_dataset: []
sample_count: 7500
explore_count: 10
thread_count: 128
initial_episilon: 0.6
prompt_pool_path: ./utils/prompts_math_first.jsonl
cal_ppl: 1
from_initial: true
lambda1: -0.4
lambda2: 0.8
port: 8000
devices: 7
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "math.yaml"
    path.write_text(text)
    return path


def test_an_original_recipe_with_an_empty_mix_dataset_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    recipe = load_recipe(SFTRecipe, write(tmp_path, ORIGINAL_MATH_SFT), check_paths=False)
    assert (recipe.dataset_type, recipe.sample_count, recipe.initial_epsilon) == ("math", 7500, 0.6)
    assert recipe.origin_yaml_path.endswith("alignment-handbook/recipes/llama3-8b/math_sft/base.yaml")
    assert recipe.prompt_pool_path is None  # the original's pool file is not here: our built-in pool


@pytest.mark.parametrize("value", ["[hotpot_qa, cbt]", "hotpot_qa"])
def test_a_non_empty_mix_dataset_is_rejected_by_name(tmp_path, monkeypatch, value):
    monkeypatch.chdir(REPO)
    path = write(tmp_path, ORIGINAL_MATH_SFT.replace("mix_dataset: []", f"mix_dataset: {value}"))
    with pytest.raises(RecipeError) as info:
        load_recipe(SFTRecipe, path, check_paths=False)
    message = str(info.value)
    assert "math.yaml" in message and "mix_dataset" in message and "hotpot_qa" in message
