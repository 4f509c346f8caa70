"""A run's ``recipe.yaml``: the validated recipe as the run folder keeps it, secrets redacted.

``load_recipe`` (``optima.config.recipes``) reads a recipe; ``save_recipe`` writes the one a run or an evaluation
uses, and says which fields changed when a resumed run brings another one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optima.store import write_yaml

if TYPE_CHECKING:
    from optima.config.loop_recipes import Recipe

logger = logging.getLogger(__name__)

SECRET_FIELDS = ("api_key",)


def redacted(values: dict[str, Any]) -> dict[str, Any]:
    """A recipe dict fit for disk and logs: secrets replaced by a marker."""
    return {k: ("<redacted>" if k in SECRET_FIELDS and v else v) for k, v in values.items()}


def save_recipe(recipe: Recipe, path: Path) -> None:
    """Write the validated recipe (secrets redacted); say which fields changed when resuming under another one."""
    import yaml

    current = redacted(recipe.to_dict())
    if path.exists():
        previous = yaml.safe_load(path.read_text()) or {}
        changed = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
        if changed:
            logger.warning("resuming %s with changed recipe fields: %s", path.parent, ", ".join(changed))
    write_yaml(path, current)
