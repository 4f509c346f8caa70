"""Reading a recipe: ``load_recipe`` (YAML, then ``--set``, then the checks), the field machinery and ``RecipeError``.

Every key of the original's recipes is accepted: its misspellings (``initial_episilon``) through ``ALIASES``, an
old switch through ``LEGACY_SWITCHES``, its output roots (``LEGACY_OUTPUT_KEYS``), each with a warning. Nothing
here knows a recipe's fields: the dataclasses are in ``optima.config.recipes`` and ``optima.config.loop_recipes``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import os
import re
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from optima.methods import TRAINERS, Stage, stage_tags

logger = logging.getLogger(__name__)

# A Hugging Face hub id such as "meta-llama/Meta-Llama-3-8B-Instruct" (and not a local-looking path).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class RecipeError(ValueError):
    """A recipe that cannot run: names the file (``path``, filled in by ``load_recipe``), the field and the value."""

    def __init__(self, field: str | None, message: str, path: str | Path | None = None):
        self.field, self.message, self.path = field, message, path
        super().__init__(self._render())

    def _render(self) -> str:
        where = f"{self.path}: " if self.path else ""
        what = f"{self.field}: " if self.field else ""
        return f"{where}{what}{self.message}"

    def with_path(self, path: str | Path) -> RecipeError:
        """The same error, located in ``path``."""
        return RecipeError(self.field, self.message, path)


def field(default: Any = dataclasses.MISSING, help: str = "", redoes: tuple[Stage, ...] = (), **kwargs: Any) -> Any:  # noqa: A002
    """A dataclass field with ``metadata={"help": ..., "redoes": ...}``; list and dict defaults are copied each time.

    ``redoes`` names the stages whose output the field decides: changing it on a finished run redoes them (and the
    stages after them); a field that only changes how fast or where a run goes names none. A tag that names no
    ``Stage`` raises ``ValueError`` when the recipe class is defined (at import).
    """
    metadata = {"help": help, "redoes": stage_tags(tuple(redoes))}
    if isinstance(default, list | dict):
        value = copy.deepcopy(default)
        return dataclasses.field(default_factory=lambda: copy.deepcopy(value), metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def stage_fields(stage: Stage, *groups: type) -> tuple[str, ...]:
    """The fields of ``groups`` (recipe classes or field groups) whose change redoes ``stage``, in field order."""
    names: dict[str, None] = {}
    for group in groups:
        for f in dataclasses.fields(group):
            if stage in f.metadata.get("redoes", ()):
                names[f.name] = None
    return tuple(names)


def require(condition: bool, name: str, message: str) -> None:
    """Raise ``RecipeError(name, message)`` unless ``condition`` holds."""
    if not condition:
        raise RecipeError(name, message)


def require_in(name: str, value: float, low: float, high: float) -> None:
    """Raise ``RecipeError`` unless ``low <= value <= high``."""
    require(low <= value <= high, name, f"must be in [{low}, {high}], got {value!r}")


def require_positive(recipe: object, *names: str) -> None:
    """Raise ``RecipeError`` for the first of the fields ``names`` of ``recipe`` that is below 1."""
    for name in names:
        value = getattr(recipe, name)
        require(value >= 1, name, f"must be >= 1, got {value!r}")


def _matches(value: Any, tp: Any) -> bool:
    """True when ``value`` (already coerced) is an instance of the annotation ``tp``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def coerce(name: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against ``tp``, with the few coercions YAML recipes need.

    The released recipes write booleans as ``0``/``1`` (``cal_ppl: 1``) and floats as ints (``lambda2: 1``);
    both are accepted. Anything else of the wrong type raises ``RecipeError``.
    """
    if tp is bool or (typing.get_origin(tp) in (Union, types.UnionType) and bool in typing.get_args(tp)):
        if value in (0, 1) and not isinstance(value, bool):
            value = bool(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not _matches(value, tp):
        raise RecipeError(name, f"expected {_describe(tp)}, got {value!r} ({type(value).__name__})")
    return value


def check_keys(
    raw: dict[str, Any], cls: type, aliases: dict[str, str], unused: tuple[str, ...] = (), where: str = "recipe"
) -> dict[str, Any]:
    """Rename aliased keys (warning once each), drop keys ``cls`` accepts but ignores, reject unknown ones.

    An ignored key warns, naming ``where`` (the recipe file), the key and its value.
    """
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise RecipeError(None, f"keys must be strings, got {key!r}")
        if key in aliases:
            target = aliases[key]
            logger.warning("recipe key %r is a legacy spelling; read as %r", key, target)
            if target in raw:
                raise RecipeError(key, f"both {key!r} and its new name {target!r} are set; keep {target!r}")
            key = target
        if key in unused:
            logger.warning("%s: %s=%r is not used by %s; ignored", where, key, value, cls.__name__)
            continue
        if key not in names:
            guess = difflib.get_close_matches(key, names + list(aliases), n=1)
            hint = f"; did you mean {guess[0]!r}?" if guess else ""
            raise RecipeError(key, f"unknown key for {cls.__name__} (value {value!r}){hint}")
        out[key] = value
    return out


def build(cls: type, values: dict[str, Any]) -> Any:
    """Type-check ``values`` against the annotations of ``cls`` and construct it."""
    hints = typing.get_type_hints(cls)
    kwargs = {k: coerce(k, v, hints[k]) for k, v in values.items()}
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kwargs and _required(f)]
    if missing:
        raise RecipeError(missing[0], f"is required by {cls.__name__} but missing")
    return cls(**kwargs)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def documented(cls: type) -> type:
    """``cls`` (a dataclass) with its own fields listed in its docstring in TRL's format, from their ``help``."""
    own = vars(cls).get("__annotations__", {})
    lines = [
        f"        {f.name} (`{f.type}`{'' if _required(f) else f', defaults to `{field_default(f)!r}`'}):\n"
        f"            {f.metadata['help'][:1].upper()}{f.metadata['help'][1:]}."
        for f in dataclasses.fields(cls)
        if f.name in own
    ]
    cls.__doc__ = f"{(cls.__doc__ or '').rstrip()}\n\n    Parameters:\n" + "\n".join(lines) + "\n"
    return cls


def field_default(f: dataclasses.Field) -> Any:
    """The default of a recipe field (a fresh copy for list and dict defaults)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def resolve_path(value: str | None, name: str | None = None) -> str | None:
    """Absolute form of the recipe path ``value`` of field ``name``: ``~`` expanded, relative to the working dir."""
    if value is None or value == "":
        return value
    if "\x00" in value:  # the OS refuses it (ValueError deep in os.stat): say which field at load time
        raise RecipeError(name, f"not a valid path (contains a NUL byte): {value!r}")
    return str(Path(os.path.expanduser(value)).resolve())


def is_hub_id(value: str) -> bool:
    """True for ``org/name`` strings that do not exist locally (loaders then use the hub)."""
    return bool(HUB_ID.match(value)) and not Path(value).exists() and not value.startswith(".")


def parse_override(item: str) -> tuple[str, Any]:
    """``key=value`` from ``--set``; the value is read as YAML (so ``3``, ``0.5``, ``[0, 1]`` keep types)."""
    import yaml

    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError(None, f"--set expects key=value, got {item!r}")
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise RecipeError(key.strip(), f"--set value {raw!r} is not valid YAML: {exc}") from exc


def apply_overrides(raw: dict[str, Any], items: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``raw`` with ``--set`` items on top; a dotted key ``a.b=v`` sets key ``b`` inside the mapping ``a``
    (``--set trainer_overrides.learning_rate=1e-5`` adds one trainer key and keeps the recipe's others)."""
    out = copy.deepcopy(raw)
    for key, value in items:
        *parents, leaf = key.split(".")
        target = out
        for depth, name in enumerate(parents):
            inner = target.setdefault(name, {})
            if not isinstance(inner, dict):
                where = ".".join(parents[: depth + 1])
                raise RecipeError(key, f"--set {key}: {where} is {inner!r}, not a mapping")
            target = inner
        target[leaf] = value
    return out


# The trainer keys the orchestrator sets itself, with the recipe field to use instead.
MANAGED_TRAINER_KEYS = {
    "model_name_or_path": "initial_model_path (each iteration starts from the previous checkpoint)",
    "dataset_name": "the iteration's training set",
    "output_dir": "output_dir / check_point_root_path",
    "seed": "seed (the trainer gets seed + iteration)",
    "report_to": "report_to",
    "run_name": "the run directory's name (one run name per iteration)",
    "rpo_alpha": "rpo_alpha",
}

# Scientific notation PyYAML (YAML 1.1) reads as a string: 2e-5, 1E3 (it wants 2.0e-5).
YAML11_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def yaml_numbers(overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` with ``2e-5``-style strings read as the floats a user means (``learning_rate=2e-5``)."""
    fixed = {}
    for key, value in overrides.items():
        if isinstance(value, dict):
            value = yaml_numbers(value)
        elif isinstance(value, str) and YAML11_FLOAT.match(value):
            value = float(value)
        fixed[key] = value
    return fixed


def check_trainer_overrides(overrides: dict[str, Any], kinds: tuple[str, ...]) -> None:
    """Reject a trainer key the orchestrator sets, and a ``sft:``/``dpo:`` mapping of a trainer the loop lacks."""
    for key, value in overrides.items():
        if key in TRAINERS:
            require(key in kinds, "trainer_overrides", f"{key}: this loop runs no {key} trainer (only {kinds})")
            require(isinstance(value, dict), "trainer_overrides", f"{key}: must be a mapping, got {value!r}")
            check_trainer_overrides(value, ())
            continue
        require(
            isinstance(key, str) and key not in MANAGED_TRAINER_KEYS,
            "trainer_overrides",
            f"{key!r} is set by the orchestrator; use {MANAGED_TRAINER_KEYS.get(key, 'a trainer key')}",
        )


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
R = TypeVar("R")  # a recipe class


def translate_legacy_switches(raw: dict[str, Any], where: str) -> None:
    """Replace each key of ``LEGACY_SWITCHES`` in ``raw`` by its new key and value (warning once each)."""
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
    """Accept the original's ``mix_dataset: []``; ``dataset_type: mix`` always mixes the four information-exchange
    tasks, so a non-empty list (which would be ignored) is rejected."""
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
