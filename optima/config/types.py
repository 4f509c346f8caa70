"""The recipe types a signature names: the field groups, the composites the recipes are built from, a few unions.

A function that takes the recipe names what it reads, as narrowly as one type says it:

* one field group (``optima.config.groups``): ``ServingFields`` (how the model is served), ``RunFields`` (task,
  model, tokenizers, data, output, seed), ``ConversationFields`` (turn and token limits), ``GenerationFields`` (the
  loops' sampling), ``LoopFields`` (iterations, checkpoints, ``compat``), ``RewardFields``, ``TrainingFields``,
  ``SFTFields``, ``DPOFields``;
* a composite (``optima.config.recipes``), when it reads several groups: ``BaseRecipe`` (run + serving +
  conversation: what every recipe has, loop or evaluation), ``LoopRecipe`` (every group of a training loop),
  ``InferenceRecipe`` (the checkpoint sweep), ``MultiSCRecipe`` (self-consistency);
* a union below, when only some loops have what it reads (``SFTLoopRecipe``, ``DPOLoopRecipe``), or when it takes
  any recipe and tells the kinds apart itself (``MethodRecipe`` in the run and stage contexts, ``Recipe``).

Import them under ``TYPE_CHECKING`` (nothing here is needed at run time). ``tests/test_recipe_types.py`` checks that
every ``recipe`` parameter of ``optima/`` is annotated, and that each ``recipe.<field>`` it reads exists on its type;
``tests/test_recipe_groups.py`` that one naming a composite or a union needs more than one group (a function that
reads one group's fields, and hands the recipe only to functions taking that group, names the group).
"""

from __future__ import annotations

from optima.config.groups import (
    ConversationFields,
    GenerationFields,
    LoopFields,
    RewardFields,
    RunFields,
    ServingFields,
)
from optima.config.recipes import (
    BaseRecipe,
    DPORecipe,
    InferenceRecipe,
    LoopRecipe,
    MultiSCRecipe,
    SFTDPORecipe,
    SFTRecipe,
)
from optima.config.training_groups import DPOFields, SFTFields, TrainingFields

# The loops with iSFT stages (generation, scoring, selection): they have ``SFTFields``.
SFTLoopRecipe = SFTRecipe | SFTDPORecipe
# The loops with a tree search and preference pairs: they have ``DPOFields``.
DPOLoopRecipe = DPORecipe | SFTDPORecipe
# One of the three loops' recipes, as a run's and a stage's context carry it: the stage that reads it (an iSFT or a
# DPO stage) is what tells which groups it has.
MethodRecipe = SFTRecipe | DPORecipe | SFTDPORecipe
# Any recipe, loop or evaluation, for the code that tells them apart (the hardware allocation, the server layout).
Recipe = LoopRecipe | InferenceRecipe

__all__ = [
    "MethodRecipe",
    "BaseRecipe",
    "ConversationFields",
    "DPOFields",
    "DPOLoopRecipe",
    "DPORecipe",
    "GenerationFields",
    "InferenceRecipe",
    "LoopFields",
    "LoopRecipe",
    "MultiSCRecipe",
    "Recipe",
    "RewardFields",
    "RunFields",
    "SFTDPORecipe",
    "SFTFields",
    "SFTLoopRecipe",
    "SFTRecipe",
    "ServingFields",
    "TrainingFields",
]
