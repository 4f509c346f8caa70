"""The experiment trackers a recipe may name in ``report_to``, and the rule that validates it.

Loading a recipe checks ``report_to`` with this parser; the run (``optima.tracking``) resolves ``auto`` against
the training environment with the same one.
"""

from __future__ import annotations

from optima.config.fields import RecipeError

TRACKERS = ("tensorboard", "wandb")


def parse_report_to(value: str | list[str] | None) -> list[str] | str:
    """Validate the recipe's ``report_to``: ``auto``, ``none``, a tracker, or a list of trackers.

    Returns ``"auto"`` or the list of trackers (empty for ``none``).
    """
    if value in (None, "none", []):
        return []
    if value == "auto":
        return "auto"
    names = [value] if isinstance(value, str) else list(value)
    for name in names:
        if name not in TRACKERS:
            raise RecipeError("report_to", f"expected auto, none or one of {list(TRACKERS)}, got {name!r}")
    return names
