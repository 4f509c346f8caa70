"""Reading a recipe: ``load_recipe`` (YAML, then ``--set`` overrides, then the checks) and the legacy keys it reads.

The keys of the released Optima recipes are all accepted: their misspellings (``initial_episilon``) through
``ALIASES``, old switches through ``LEGACY_SWITCHES`` and old output locations (``LEGACY_OUTPUT_KEYS``), each
with a warning. The recipe dataclasses themselves are in ``optima.config.recipes``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from optima.config.fields import RecipeError, apply_overrides, build, check_keys, parse_override, require

if TYPE_CHECKING:
    from optima.config.recipes import _BaseRecipe

logger = logging.getLogger(__name__)

# Legacy spellings and names of the released recipes, read as ours (warns once per key and load).
ALIASES = {
    "initial_episilon": "initial_epsilon",
    "initial_dpo_episilon": "initial_dpo_epsilon",
    "origin_sft_yaml_path": "origin_yaml_path",
    "explore_time": "mcts_selections",
}
# Keys that became a value of another field: old key -> (new key, old value -> new value). Read with a warning.
LEGACY_SWITCHES = {"prefill_answer_iteration0": ("answer_bootstrap", {True: "prefill", False: "off"})}
# Original output-location keys: accepted, superseded by ``output_dir`` (one run directory per recipe).
LEGACY_OUTPUT_KEYS = (
    "mid_yaml_root_path",
    "mid_jsonl_root_path",
    "mid_dataset_root_path",
    "mid_sft_jsonl_root_path",
    "mid_sft_dataset_root_path",
    "mid_dpo_jsonl_root_path",
    "mid_dpo_dataset_root_path",
    "initial_dataset_path",
)
R = TypeVar("R", bound="_BaseRecipe")


def translate_legacy_switches(raw: dict[str, Any], where: str) -> None:
    """Replace each key of ``LEGACY_SWITCHES`` in ``raw`` by its new key and value (warning once each).

    Raises:
        RecipeError: both the old and the new key are set, or the old key has a value it never took.
    """
    for old, (new, values) in LEGACY_SWITCHES.items():
        if old not in raw:
            continue
        value = raw.pop(old)
        if new in raw:
            raise RecipeError(old, f"both {old!r} and its new form {new!r} are set; keep {new!r}")
        if not isinstance(value, (bool, int)) or value not in values:
            raise RecipeError(old, f"expected one of {sorted(values)}, got {value!r}")
        raw[new] = values[bool(value)]
        logger.warning("%s: %s=%r is a legacy switch; read as %s=%r", where, old, value, new, raw[new])


def drop_empty_mix_dataset(raw: dict[str, Any]) -> None:
    """Accept the released recipes' ``mix_dataset: []`` (the sub-tasks of its ``mix`` loader, empty everywhere).

    Optima's ``dataset_type: mix`` always mixes the four information-exchange tasks, so a non-empty list would be
    silently ignored: it is rejected instead.
    """
    from optima.tasks import TASKS

    value = raw.pop("mix_dataset", None)
    mixed = ", ".join(task.name for task in TASKS["mix"].tasks)
    require(
        value is None or value == [],
        "mix_dataset",
        f"only an empty list is accepted (dataset_type: mix always mixes {mixed}), got {value!r}",
    )


def load_recipe(
    cls: type[R],
    path: str | Path | None,
    overrides: list[str] | dict[str, Any] | None = None,
    check_paths: bool = True,
) -> R:
    """Read, validate and build a recipe.

    Args:
        cls: Recipe class (`SFTRecipe`, `DPORecipe`, ...).
        path: YAML file (``None``: overrides only).
        overrides: ``["key=value", ...]`` from ``--set``, or a dict; applied over the YAML.
        check_paths: Fail when a local input (model, data, base YAML, pool) is missing. ``--dry-run`` passes
            False and reports them in the plan instead.

    Raises:
        RecipeError: naming the file, the field and the value.
    """
    import yaml

    where = str(path) if path is not None else "<overrides>"
    raw: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise RecipeError(None, "recipe file not found", path)
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as exc:
            raise RecipeError(None, f"not valid YAML: {exc}", path) from exc
        except UnicodeDecodeError as exc:
            raise RecipeError(None, f"not a UTF-8 text file: {exc}", path) from exc
        if not isinstance(raw, dict):
            raise RecipeError(None, f"must be a mapping of key: value, got {type(raw).__name__}", path)
    try:
        items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides or [])
        raw = apply_overrides(raw, items)
        for key in LEGACY_OUTPUT_KEYS:
            if key in raw:
                logger.warning(
                    "%s: %s=%r is a legacy output location; outputs go under output_dir",
                    where,
                    key,
                    raw.pop(key),
                )
        drop_empty_mix_dataset(raw)
        translate_legacy_switches(raw, where)
        recipe = build(cls, check_keys(raw, cls, ALIASES, cls.unused_keys, where))
        if check_paths:
            missing = recipe.missing_inputs()
            if missing:
                name, value = next(iter(missing.items()))
                raise RecipeError(name, f"input path does not exist: {value}")
    except RecipeError as exc:
        raise exc.with_path(where) from None
    return recipe
