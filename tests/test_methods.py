"""One method table (``optima.methods``): every place that tells the methods apart reads it, and no other file of
``optima/`` or the scripts spells a method's name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from optima import config, loop
from optima.__main__ import RECIPE_CLASSES
from optima.hardware.allocation import trainer_yamls
from optima.methods import (
    DPO,
    METHODS,
    PART_FOLDERS,
    SFT,
    SFT_DPO,
    TRAINER_STAGES,
    TRAINER_YAML_FIELDS,
    method_of_trainers,
    runs,
)
from optima.paths import RunPaths

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "optima" / "methods.py"


def docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def method_literals(source: str, filename: str) -> list[str]:
    """``file:line: 'name'`` for each string in the code (docstrings aside) that is a method's name."""
    tree = ast.parse(source, filename)
    docs = docstring_nodes(tree)
    return [
        f"{filename}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in METHODS and id(node) not in docs
    ]


def test_method_names_are_spelled_only_in_the_table():
    files = [*sorted((REPO / "optima").rglob("*.py")), *sorted(REPO.glob("*.py"))]
    found = []
    for path in files:
        if path != TABLE:
            found += method_literals(path.read_text(), path.relative_to(REPO).as_posix())
    assert found == []
    assert len(method_literals(TABLE.read_text(), "methods.py")) >= len(METHODS)  # the check sees the table's own


def test_a_planted_method_name_is_found():
    source = '"""A docstring may say sft."""\n\ndef f(kind):\n    """So may this: dpo."""\n    return kind == "dpo"\n'
    assert method_literals(source, "x.py") == ["x.py:5: 'dpo'"]


def test_every_reader_follows_the_table():
    assert set(METHODS) == {SFT, DPO, SFT_DPO}
    for name, method in METHODS.items():
        recipe_class = getattr(config, method.recipe)
        assert recipe_class.method == name and RECIPE_CLASSES[name] == method.recipe
        parts = loop.iteration_parts(recipe_class, RunPaths(Path("/run")), 0)
        assert [(part, trainer) for part, trainer, _ in parts] == list(method.parts)
        assert method_of_trainers(set(method.trainers)) is method
    assert set(loop.LOOPS) == set(TRAINER_STAGES) == {SFT, DPO}  # a part runs its trainer's loop
    assert [name for name in METHODS if runs(name, DPO)] == [DPO, SFT_DPO] and not runs("inference", SFT)
    assert PART_FOLDERS == ("", SFT, DPO)  # the iteration's own folder, then iSFT-DPO's two parts, in run order
    names = {f.name for cls in (config.SFTRecipe, config.DPORecipe) for f in dataclasses.fields(cls)}
    assert set(TRAINER_YAML_FIELDS.values()) <= names


def test_the_hardware_allocation_reads_each_trainers_yaml(tmp_path):
    (tmp_path / "sft.yaml").write_text("max_length: 11\n")
    (tmp_path / "dpo.yaml").write_text("max_length: 22\n")
    values = {"origin_yaml_path": str(tmp_path / "sft.yaml"), "origin_dpo_yaml_path": str(tmp_path / "dpo.yaml")}
    values |= {"dataset_type": "arc", "initial_model_path": "/models/base"}
    recipe = config.load_recipe(config.SFTDPORecipe, None, values, check_paths=False)
    assert [(y["max_length"], y["_dpo"]) for y in trainer_yamls(recipe)] == [(11, False), (22, True)]
