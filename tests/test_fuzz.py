"""Property tests (hypothesis): the recipe loader and the answer parsers/scorers are total.

* ``load_recipe`` on any YAML-able mapping, any ``--set`` string and any file content either returns a recipe or
  raises ``RecipeError`` (which the scripts turn into exit code 2 and one message), never another exception.
* Every answer parser takes any text and returns a string or None; every scorer returns a number in [0, 1], in both
  scoring modes. Model output is adversarial by nature: a parser that raises would crash a stage.

Fast settings (a few hundred examples each, no deadline, no network); the symbolic MATH backend is replaced by an
instant checker (its own time limits are tested in ``test_scoring.py``).
"""

from __future__ import annotations

import dataclasses
import math
import string

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optima.config import (
    ALIASES,
    LEGACY_OUTPUT_KEYS,
    DPORecipe,
    InferenceRecipe,
    MultiSCRecipe,
    RecipeError,
    SFTDPORecipe,
    SFTRecipe,
    load_recipe,
)
from optima.tasks import TASKS, Example, get_task
from optima.tasks.answers import AnswerTracker, normalize_final_answer, parse_boxed, parse_math_answer, parse_tag
from optima.tasks.math_equiv import MathVerifier, canonical_answer, fast_equivalence, numeric_value
from optima.tasks.scoring import ScoreContext, score_by_type, score_example
from tests._task_fixtures import echo_check, resolve_test_data_dir

# No example database: nothing is written into the source tree (a failure prints its reproducing example).
FAST = settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
DATA = resolve_test_data_dir()

# ---------------------------------------------------------------- recipe loader

# Leaves a YAML file (or a --set value) can hold, then lists and mappings of them.
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
    | st.sampled_from(["0,1", "²", "٣", "~", "~nobody/x", "./rel", "/abs/x", "a\x00b", "org/name", "", " "])
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def recipe_keys(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[type, dict]:
    """A valid recipe of each class, its input paths on disk."""
    root = tmp_path_factory.mktemp("fuzz")
    model, trainer = root / "model", root / "base.yaml"
    model.mkdir()
    trainer.write_text("learning_rate: 1.0e-5\n")
    common = {"dataset_type": "arc", "initial_model_path": str(model), "output_dir": str(root / "run")}
    loop = common | {"origin_yaml_path": str(trainer), "origin_dpo_yaml_path": str(trainer)}
    return {
        SFTRecipe: common | {"origin_yaml_path": str(trainer)},
        DPORecipe: common | {"origin_dpo_yaml_path": str(trainer)},
        SFTDPORecipe: loop,
        InferenceRecipe: common | {"model_root_path": str(model)},
        MultiSCRecipe: common | {"model_root_path": str(model)},
    }


CLASSES = st.sampled_from([SFTRecipe, DPORecipe, SFTDPORecipe, InferenceRecipe, MultiSCRecipe])


def load_or_recipe_error(cls: type, path, overrides, check_paths: bool = True) -> None:
    """``load_recipe`` may succeed or raise ``RecipeError``; any other exception fails the test."""
    try:
        recipe = load_recipe(cls, path, overrides, check_paths=check_paths)
    except RecipeError as exc:
        assert str(exc)  # a message, naming what is wrong
        return
    assert isinstance(recipe, cls)


@FAST
@given(cls=CLASSES, data=st.data(), check_paths=st.booleans())
def test_any_overrides_give_a_recipe_or_a_recipe_error(bases, cls, data, check_paths):
    known = recipe_keys(cls) + list(ALIASES) + list(LEGACY_OUTPUT_KEYS)
    keys = st.sampled_from(known) | st.text(max_size=12)
    changes = data.draw(st.dictionaries(keys, VALUES, max_size=5))
    dropped = data.draw(st.sets(st.sampled_from(sorted(bases[cls])), max_size=2))
    values = {k: v for k, v in bases[cls].items() if k not in dropped} | changes
    load_or_recipe_error(cls, None, values, check_paths)


TRICKY = ["a\x00b", "\x00", "²", "٣", "0,²", "~", "~nobody/x", "./", "..", "org/name", " ", "\udcff", "1e999", "0x10"]


@FAST
@given(cls=CLASSES, data=st.data())
def test_any_string_in_any_field(bases, cls, data):
    """Strings reach the path, device and enum fields (where the OS or int() would raise) more often."""
    keys = data.draw(st.lists(st.sampled_from(recipe_keys(cls)), min_size=1, max_size=3))
    changes = {key: data.draw(st.sampled_from(TRICKY) | st.text(max_size=12)) for key in keys}
    load_or_recipe_error(cls, None, bases[cls] | changes)


@FAST
@given(cls=CLASSES, sets=st.lists(st.text(max_size=30), max_size=4))
def test_any_set_strings_give_a_recipe_or_a_recipe_error(bases, tmp_path, cls, sets):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(bases[cls]))
    load_or_recipe_error(cls, path, sets)


@FAST
@given(cls=CLASSES, content=st.one_of(VALUES.map(lambda v: yaml.safe_dump(v).encode()), st.text().map(str.encode)))
def test_any_yaml_file_gives_a_recipe_or_a_recipe_error(tmp_path, cls, content):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(content)
    load_or_recipe_error(cls, path, None)


@FAST
@given(content=st.binary(max_size=200))
def test_any_bytes_give_a_recipe_error(tmp_path, content):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(content + b"\xff")  # never valid UTF-8
    with pytest.raises(RecipeError, match="recipe.yaml"):
        load_recipe(SFTRecipe, path)


# ---------------------------------------------------------------- answer parsers and scorers

# Text built from the pieces parsers look for, mixed with arbitrary unicode (no surrogates: a str from a reply).
PIECES = [
    "<A>",
    "</A>",
    "<a>",
    "\\boxed{",
    "{",
    "}",
    "$",
    "=",
    "\\frac",
    "\\sqrt",
    "\\text{",
    "\\left(",
    "\\right)",
    "1,000",
    "-3.5",
    "1/2",
    "B",
    "(B)",
    "B) ",
    "option ",
    "answer: ",
    "the ",
    "an ",
    " ",
    "\n",
    "\\",
    "^\\circ",
    "%",
    "Alice:",
    "\x00",
    "\ufffd",
]
TEXT = st.one_of(st.text(), st.lists(st.sampled_from(PIECES) | st.text(max_size=5), max_size=40).map("".join))
TASK_NAMES = sorted(set(TASKS) - {"mix"})


@pytest.fixture(scope="module")
def verifier():
    """A MATH verifier whose symbolic step answers at once (string equality)."""
    with MathVerifier(max_workers=1, check=echo_check) as checker:
        yield checker


def is_unit(value: float) -> bool:
    return isinstance(value, float) and not math.isnan(value) and 0.0 <= value <= 1.0


@FAST
@given(text=TEXT)
def test_parsers_take_any_text(text):
    for parse in (parse_tag, parse_boxed, parse_math_answer):
        assert parse(text) is None or isinstance(parse(text), str)
    assert isinstance(normalize_final_answer(text), str) and isinstance(canonical_answer(text), str)
    assert fast_equivalence(text, "42") in (True, False, None)
    numeric_value(text)
    tracker = AnswerTracker()
    for name in TASK_NAMES:
        answer = get_task(name).parse_answer(text)
        assert answer is None or isinstance(answer, str)
        tracker.update(answer)
    assert isinstance(tracker.final_answer, str)


@FAST
@given(score_type=st.sampled_from(["f1", "choice", "number", "math"]), prediction=TEXT, gold=TEXT, data=st.data())
def test_scores_are_in_unit_interval(verifier, score_type, prediction, gold, data):
    mode = data.draw(st.sampled_from(["default", "original"]))
    options = data.draw(st.lists(st.tuples(st.sampled_from(string.ascii_uppercase), TEXT), max_size=4).map(tuple))
    context = ScoreContext(mode=mode, tokenize=str.split, options=options, verifier=verifier)
    assert is_unit(score_by_type(score_type, prediction, gold, context))
    assert is_unit(score_by_type(score_type, prediction, [gold, prediction[:3]], context))


@FAST
@given(task_name=st.sampled_from(TASK_NAMES), utterance=TEXT, gold=TEXT)
def test_parse_then_score_any_utterance(verifier, task_name, utterance, gold):
    task = get_task(task_name)
    options = (("A", gold), ("B", "iron"), ("C", utterance[:10])) if task.score_type == "choice" else ()
    example = Example("q", task_name, "question?", gold or "x", task.score_type, options=options)
    for mode in ("default", "original"):
        score = score_example(example, task.parse_answer(utterance), mode, str.split, verifier=verifier)
        assert is_unit(score)
