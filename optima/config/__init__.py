"""Recipes: what a run is asked to do, validated before anything starts.

    from optima.config import load_recipe, SFTRecipe
    recipe = load_recipe(SFTRecipe, "train/sft_recipes/arc.yaml", ["seed=1"])

One dataclass per method, like TRL's configs: the loops' ``SFTRecipe``, ``DPORecipe``, ``SFTDPORecipe``
(``loop_recipes``) and the evaluations' ``InferenceRecipe``, ``MultiSCRecipe`` (``recipes``, with the fields every
recipe has). ``load_recipe`` reads one (``loading``, with ``RecipeError`` and the field machinery); ``rules``
derives values from one. A signature names
``LoopRecipe`` (any loop), ``SFTLoopRecipe``/``DPOLoopRecipe`` (the loops with iSFT or tree-search stages) or
``Recipe`` (any recipe).
"""

from optima.config.loading import (
    ALIASES,
    HUB_ID,
    LEGACY_OUTPUT_KEYS,
    RecipeError,
    apply_overrides,
    field,
    is_hub_id,
    load_recipe,
    parse_override,
    resolve_path,
    stage_fields,
)
from optima.config.loop_recipes import (
    ORIGINAL_MCTS_SELECTIONS,
    DPOLoopRecipe,
    DPORecipe,
    LoopRecipe,
    Recipe,
    SFTDPORecipe,
    SFTLoopRecipe,
    SFTRecipe,
)
from optima.config.recipes import (
    DATA_DIR_ENV,
    LOOP_ONLY_KEYS,
    LOOPBACK_HOSTS,
    SC_DEVICE_SPAN,
    SWEEP_DEVICE_SPAN,
    InferenceRecipe,
    MultiSCRecipe,
    expand_device_flag,
    parse_devices,
    parse_report_to,
    save_recipe,
)

__all__ = [
    "ALIASES",
    "DATA_DIR_ENV",
    "HUB_ID",
    "LEGACY_OUTPUT_KEYS",
    "LOOPBACK_HOSTS",
    "LOOP_ONLY_KEYS",
    "ORIGINAL_MCTS_SELECTIONS",
    "SC_DEVICE_SPAN",
    "SWEEP_DEVICE_SPAN",
    "DPOLoopRecipe",
    "DPORecipe",
    "InferenceRecipe",
    "LoopRecipe",
    "MultiSCRecipe",
    "Recipe",
    "RecipeError",
    "SFTDPORecipe",
    "SFTLoopRecipe",
    "SFTRecipe",
    "apply_overrides",
    "expand_device_flag",
    "field",
    "is_hub_id",
    "load_recipe",
    "parse_devices",
    "parse_override",
    "parse_report_to",
    "resolve_path",
    "save_recipe",
    "stage_fields",
]
