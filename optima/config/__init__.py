"""Recipes: what a run is asked to do, validated before anything starts.

    from optima.config import load_recipe, SFTRecipe
    recipe = load_recipe(SFTRecipe, "train/sft_recipes/arc.yaml", ["seed=1"])

* ``recipes``: the five method recipes (iSFT, iDPO, iSFT-DPO, checkpoint sweep, self-consistency);
* ``loading``: ``load_recipe`` and the legacy keys of the released recipes it reads;
* ``groups``: the field groups they are built from (run, serving, conversation, generation, loop, reward);
  ``training_groups``: the training, SFT and DPO groups;
* ``types``: what a signature names for the recipe it takes (a group, a composite such as ``LoopRecipe``, a union);
* ``fields``: the generic machinery (typed fields, type checks, ``RecipeError``);
* ``rules``: the values derived from a recipe (loss model, temperature, selection range, training start, ...), one
  function each; the reward's ``T_max`` lives with the formula (``optima.reward``).
"""

from optima.config.fields import RecipeError, parse_override, resolve_path
from optima.config.loading import ALIASES, LEGACY_OUTPUT_KEYS, load_recipe
from optima.config.recipes import (
    DATA_DIR_ENV,
    DPORecipe,
    InferenceRecipe,
    MultiSCRecipe,
    SFTDPORecipe,
    SFTRecipe,
    known_tasks,
)

__all__ = [
    "ALIASES",
    "DATA_DIR_ENV",
    "LEGACY_OUTPUT_KEYS",
    "DPORecipe",
    "InferenceRecipe",
    "MultiSCRecipe",
    "RecipeError",
    "SFTDPORecipe",
    "SFTRecipe",
    "known_tasks",
    "load_recipe",
    "parse_override",
    "resolve_path",
]
