"""A function names the recipe as narrowly as it reads it: one that names a whole recipe (a composite or a union of
``optima.config.types``) needs it, since it reads fields of more than one group, hands the recipe to a function that
does, or uses it some other way (tells kinds apart, stores it). One that reads the fields of one group only, and
hands the recipe only to functions that take that group, names the group (``recipe: TrainingFields``): the value
passed stays the recipe, an instance of each of its groups.

Narrowing is checked only where it is safe for every caller: the group must be a base of every type the current
annotation admits (``Recipe`` admits an evaluation recipe, which has no ``RewardFields``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
from pathlib import Path
from types import UnionType

import pytest

import optima.config.groups as groups
import optima.config.training_groups as training_groups
from tests.test_recipe_types import REPO, members, module_name, names_any, optima_sources, reads, resolve

# The field groups: the dataclasses of optima.config.groups and optima.config.training_groups that the composite
# recipes inherit from.
GROUPS = tuple(
    v
    for module in (groups, training_groups)
    for k, v in vars(module).items()
    if k.endswith("Fields") and dataclasses.is_dataclass(v) and v.__module__ == module.__name__
)


def classes_of(tp: object) -> list[object]:
    return [c for c in (tp.__args__ if isinstance(tp, UnionType) else (tp,)) if c is not type(None)]


@functools.cache
def module_defs(module: str) -> dict[str, ast.AST]:
    """Top-level functions and classes of an ``optima`` module ({} for a package or anything else)."""
    spec = importlib.util.find_spec(module) if module.startswith("optima") else None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return {}
    return defs_of(ast.parse(Path(spec.origin).read_text()))


def defs_of(tree: ast.Module) -> dict[str, ast.AST]:
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}


def imported_names(tree: ast.Module) -> dict[str, str]:
    """``{local name: dotted source}`` of every import in the module (function-local ones too)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.asname or a.name: a.name for a in node.names if a.asname or "." not in a.name}
    return names


def lookup(dotted: str) -> tuple[str, ast.AST] | None:
    """``optima.x.name`` -> (module, its def), or (module, None) when ``dotted`` is a module itself."""
    module, _, name = dotted.rpartition(".")
    if name in module_defs(module):
        return module, module_defs(module)[name]
    return (dotted, None) if module_defs(dotted) else None


def call_target(func: ast.expr, module: str, tree: ast.Module) -> tuple[str, ast.FunctionDef] | None:
    """The function (module, def) a call reaches: a name defined or imported here, ``module.name`` or
    ``Class.method``; a class call reaches its own ``__init__``. None when it cannot be told."""
    local, imports = defs_of(tree), imported_names(tree)
    found = None
    if isinstance(func, ast.Name):
        found = (module, local[func.id]) if func.id in local else lookup(imports.get(func.id, ""))
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner = func.value.id
        base = (module, local[owner]) if owner in local else lookup(imports.get(owner, ""))
        if base is not None and base[1] is None:
            found = lookup(f"{base[0]}.{func.attr}")
        elif base is not None and isinstance(base[1], ast.ClassDef):
            methods = defs_of(ast.Module(body=base[1].body, type_ignores=[]))
            found = (base[0], methods[func.attr]) if func.attr in methods else None
    if found is not None and isinstance(found[1], ast.ClassDef):
        init = defs_of(ast.Module(body=found[1].body, type_ignores=[])).get("__init__")
        found = (found[0], init) if init is not None else None
    return found if found is not None and isinstance(found[1], ast.FunctionDef) else None


def passed_to(call: ast.Call, arg: ast.AST, module: str, tree: ast.Module) -> object | None:
    """The type the called function asks of ``arg`` (None: the callee or its annotation cannot be told)."""
    target = call_target(call.func, module, tree)
    if target is None:
        return None
    callee_module, callee = target
    if isinstance(arg, ast.keyword):
        every = callee.args.posonlyargs + callee.args.args + callee.args.kwonlyargs
        param = next((a for a in every if a.arg == arg.arg), None)
    else:
        positional = [a for a in callee.args.posonlyargs + callee.args.args if a.arg not in ("self", "cls")]
        index = call.args.index(arg)
        param = positional[index] if index < len(positional) else None
    if param is None or param.annotation is None:
        return None
    return resolve(ast.unparse(param.annotation), callee_module)


def recipe_uses(node: ast.FunctionDef, module: str, tree: ast.Module) -> list[object] | None:
    """The types asked of ``recipe`` where the function hands it on; None when it is used any other way."""
    parents = {child: parent for parent in ast.walk(node) for child in ast.iter_child_nodes(parent)}
    asked = []
    for name in ast.walk(node):
        if not (isinstance(name, ast.Name) and name.id == "recipe") or isinstance(parents[name], ast.Attribute):
            continue
        parent = parents[name]
        call = parents.get(parent) if isinstance(parent, ast.keyword) else parent
        arg = parent if isinstance(parent, ast.keyword) else name
        tp = passed_to(call, arg, module, tree) if isinstance(call, ast.Call) and call.func is not name else None
        if tp is None:
            return None
        asked.append(tp)
    return asked


def narrower_group(node: ast.FunctionDef, module: str, tree: ast.Module) -> type | None:
    """The field group a whole-recipe ``recipe`` parameter could name instead, or None when it needs more."""
    arg = next((a for a in node.args.args + node.args.kwonlyargs if a.arg == "recipe"), None)
    if arg is None or arg.annotation is None or names_any(arg.annotation):
        return None
    tp = resolve(ast.unparse(arg.annotation), module)
    if any(c in GROUPS for c in classes_of(tp)):
        return None  # a group already
    asked = recipe_uses(node, module, tree)
    if asked is None:
        return None
    fields = {name for _, name in reads(node, "recipe")}
    fits = [
        group
        for group in GROUPS
        if all(isinstance(c, type) and issubclass(c, group) for c in classes_of(tp))  # every caller's value has it
        and all(any(f in m for m in members(group)) for f in fields)
        and all(any(isinstance(c, type) and issubclass(group, c) for c in classes_of(a)) for a in asked)
    ]
    # The most general of them (TrainingFields rather than SFTFields); none when unrelated groups would all do.
    return next((g for g in fits if all(issubclass(other, g) for other in fits)), None)


def whole_recipe_problems(source: str, module: str, path: str) -> list[str]:
    tree = ast.parse(source)
    return [
        f"{path}:{node.lineno} {node.name}: reads only {group.__name__} (name it instead of the whole recipe)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and (group := narrower_group(node, module, tree)) is not None
    ]


def test_a_function_that_reads_one_group_names_it():
    problems = []
    for path in optima_sources():
        problems += whole_recipe_problems(path.read_text(), module_name(path), str(path.relative_to(REPO)))
    assert problems == []


@pytest.mark.parametrize(
    ("source", "group"),
    [
        ("def f(recipe: LoopRecipe):\n    return recipe.port, recipe.host\n", "ServingFields"),
        ("def f(recipe: SFTRecipe):\n    return recipe.num_processes\n", "TrainingFields"),
        (
            "def g(recipe: RewardFields):\n    return recipe.lambda1\n"
            "def f(recipe: MethodRecipe):\n    return g(recipe) * recipe.lambda2\n",
            "RewardFields",
        ),
        (
            "from optima.serving.endpoints import sync_endpoints\n"
            "def f(recipe: BaseRecipe):\n    return sync_endpoints([], recipe=recipe, needed='m'), recipe.port\n",
            "ServingFields",
        ),
    ],
)
def test_a_whole_recipe_read_for_one_group_is_reported(source, group):
    """A planted function that reads one group's fields (itself, or through a callee that takes the group)."""
    problems = whole_recipe_problems(source, "optima.config.types", "example.py")
    assert len(problems) == 1 and f"reads only {group}" in problems[0]


@pytest.mark.parametrize(
    "source",
    [
        "def f(recipe: LoopRecipe):\n    return recipe.port, recipe.seed\n",  # two groups
        "def f(recipe: Recipe):\n    return recipe.loss_devices\n",  # an evaluation recipe has no RewardFields
        (  # a callee that needs two groups
            "def g(recipe: LoopRecipe):\n    return recipe.seed, recipe.port\n"
            "def f(recipe: LoopRecipe):\n    return g(recipe), recipe.port\n"
        ),
        "def f(recipe: LoopRecipe):\n    return getattr(recipe, 'port')\n",  # used another way
        "def f(recipe: LoopRecipe):\n    return unknown(recipe), recipe.port\n",
        "from optima.serving.vllm_server import build_serve_command\n"  # a callee that needs RunFields too
        "def f(recipe: BaseRecipe):\n    return build_serve_command(recipe, 'm', 1, None), recipe.port\n",
        "def f(recipe: ServingFields):\n    return recipe.port\n",
    ],
)
def test_a_recipe_that_is_needed_whole_is_not_reported(source):
    assert whole_recipe_problems(source, "optima.config.types", "example.py") == []
