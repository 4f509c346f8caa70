"""The defaults a recipe fills in while it is built (``optima.config.recipes`` calls them in ``validate``).

Below the recipes, so it names only the field groups (``optima.config.rules``, the values derived from a finished
recipe, names the recipe types and sits above them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from optima.methods import DPO

if TYPE_CHECKING:
    from optima.config.groups import RunFields

# Node selections per question of a tree search whose recipe sets no ``mcts_selections`` (docs/method.md D20).
ORIGINAL_MCTS_SELECTIONS = 8


def default_output_dir(recipe: RunFields) -> str:
    """Where a run writes (its vLLM cache, logs) when the recipe sets no ``output_dir``.

    A training loop: ``runs/<dataset_type>_<method>`` (relative to the working directory). An evaluation: its
    output folder (``output_root_path``).
    """
    return getattr(recipe, "output_root_path", None) or f"runs/{recipe.dataset_type}_{recipe.method}"


def default_mcts_selections(method: str, explore_count: int) -> int:
    """Node selections per question when ``mcts_selections`` is null.

    iDPO reads ``explore_count`` (docs/method.md, D20); in iSFT-DPO ``explore_count`` belongs to the SFT stage, so
    the search keeps 8 (``ORIGINAL_MCTS_SELECTIONS``).
    """
    return explore_count if method == DPO else ORIGINAL_MCTS_SELECTIONS
