"""Every function that takes the recipe says which fields it reads: its ``recipe`` parameter names a recipe class or
a union of them from ``optima.config`` (never ``Any``), and each ``recipe.<field>`` it reads exists on that type; so
does each ``self.recipe.<field>`` in a class whose ``__init__`` takes the recipe, each ``ctx.recipe.<field>`` of a
context whose ``recipe`` field is annotated (``Run``) or whose ``recipe`` property returns one (``Part``).

A union (``Recipe``, ``SFTLoopRecipe``, ...) is taken by code that tells the kinds apart itself (``isinstance``,
``hasattr``, ``getattr`` with a default): a field read through it must exist on at least one member of the union.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import types
from pathlib import Path

import pytest

import optima.config as recipe_types

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "optima"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(annotation: str, module: str) -> object:
    """The type an annotation names: from ``optima.config``, else from the annotating module itself."""
    namespace = {"object": object} | vars(recipe_types)
    names = {n.id for n in ast.walk(ast.parse(annotation, mode="eval")) if isinstance(n, ast.Name)}
    if names - set(namespace):
        namespace = vars(importlib.import_module(module)) | namespace
    return eval(annotation, namespace)  # noqa: S307 (our own source's annotations)


def members(tp: object) -> list[set[str]]:
    """Per member of ``tp`` (one, or each of a union): the names it has (fields, protocol attributes, methods)."""
    classes = list(tp.__args__) if isinstance(tp, types.UnionType) else [tp]
    out = []
    for cls in classes:
        names = set(dir(cls))
        for klass in cls.__mro__:
            names |= set(vars(klass).get("__annotations__", {}))
        if dataclasses.is_dataclass(cls):
            names |= {f.name for f in dataclasses.fields(cls)}
        out.append(names)
    return out


def reads(node: ast.AST, owner: str, attr: str | None = None) -> list[tuple[int, str]]:
    """``owner.<name>`` (``self.recipe.<name>`` with ``attr``) under ``node``, not in a nested function of its own
    ``recipe``."""
    found = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and attr is None:
            if "recipe" in {a.arg for a in child.args.posonlyargs + child.args.args + child.args.kwonlyargs}:
                continue
        if isinstance(child, ast.Attribute):
            base = child.value
            if attr is None and isinstance(base, ast.Name) and base.id == owner:
                found.append((child.lineno, child.attr))
            if (
                attr is not None
                and isinstance(base, ast.Attribute)
                and base.attr == attr
                and isinstance(base.value, ast.Name)
                and base.value.id == owner
            ):
                found.append((child.lineno, child.attr))
        found += reads(child, owner, attr)
    return found


def check_reads(tp: object, found: list[tuple[int, str]], where: str) -> list[str]:
    have = members(tp)
    return [
        f"{where}:{line}: reads .{name}, which {tp} does not have"
        for line, name in found
        if not any(name in m for m in have)
    ]


def names_any(annotation: ast.expr) -> bool:
    """True when the annotation is, or contains, ``Any`` (``Any``, ``typing.Any``, ``Any | None``, ...)."""
    return any(
        (isinstance(n, ast.Name) and n.id == "Any") or (isinstance(n, ast.Attribute) and n.attr == "Any")
        for n in ast.walk(annotation)
    )


def check_attribute(cls_node: ast.ClassDef, module: str, path: str) -> list[str]:
    """A class-level ``recipe: T`` (a dataclass field) names a real type, not ``Any``."""
    problems = []
    for item in cls_node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == "recipe":
            if names_any(item.annotation):
                problems.append(f"{path}:{item.lineno}: {cls_node.name}.recipe is annotated Any")
            else:
                resolve(ast.unparse(item.annotation), module)  # raises NameError on a name that is no type
    return problems


def check_function(node: ast.FunctionDef | ast.AsyncFunctionDef, module: str, path: str) -> list[str]:
    """The function's ``recipe`` parameter is annotated, not ``Any``, and has every field the body reads."""
    args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
    where = f"{path}:{node.lineno} {node.name}"
    for arg in args:
        if arg.arg != "recipe":
            continue
        if arg.annotation is None:
            return [f"{where}: recipe is not annotated"]
        if names_any(arg.annotation):
            return [f"{where}: recipe is annotated Any"]
        return check_reads(resolve(ast.unparse(arg.annotation), module), reads(node, "recipe"), path)
    return []


def context_routes(annotation: ast.expr, module: str) -> dict[str, object]:
    """``route -> recipe type`` for a parameter: ``.recipe`` when its class carries an annotated ``recipe`` field or
    property (the run's context), ``.ctx.recipe`` when its ``ctx`` field is such a class (a stage's context); empty
    for any other parameter, or a type only imported under ``TYPE_CHECKING``."""
    try:
        cls = resolve(ast.unparse(annotation), module)
    except NameError:
        return {}
    own = class_recipe(cls)
    if own is not None:
        return {".recipe": own}
    for klass in cls.__mro__ if isinstance(cls, type) else ():
        annotations = vars(klass).get("__annotations__")
        text = annotations.get("ctx") if isinstance(annotations, dict) else None
        if isinstance(text, str):
            try:
                inner = class_recipe(resolve(text, klass.__module__))
            except NameError:
                return {}
            return {".ctx.recipe": inner} if inner is not None else {}
    return {}


def class_recipe(cls: object) -> object | None:
    """The type of ``cls``'s annotated ``recipe`` field or property, else None."""
    for klass in cls.__mro__ if isinstance(cls, type) else ():
        annotations = vars(klass).get("__annotations__")
        text = annotations.get("recipe") if isinstance(annotations, dict) else None
        prop = vars(klass).get("recipe")
        if text is None and isinstance(prop, property):  # a context that forwards its run's recipe
            text = prop.fget.__annotations__.get("return")
        if text is not None:
            return resolve(text, klass.__module__)
    return None


def aliases_recipe(node: ast.AST, route: str) -> bool:
    """True when the function names ``route`` ``recipe`` (``recipe = ctx.recipe``, ``ctx, recipe = ...``)."""
    for statement in ast.walk(node):
        if not isinstance(statement, ast.Assign) or len(statement.targets) != 1:
            continue
        target, value = statement.targets[0], statement.value
        if isinstance(value, ast.Tuple) != isinstance(target, ast.Tuple):
            continue
        pairs = zip(target.elts, value.elts, strict=False) if isinstance(target, ast.Tuple) else [(target, value)]
        for name, source in pairs:
            if isinstance(name, ast.Name) and name.id == "recipe" and ast.unparse(source) == route:
                return True
    return False


def route_reads(node: ast.AST, route: str) -> list[tuple[int, str]]:
    """``<route>.<name>`` under ``node`` (``call.ctx.recipe.seed`` for the route ``call.ctx.recipe``)."""
    return [
        (child.lineno, child.attr)
        for child in ast.walk(node)
        if isinstance(child, ast.Attribute) and ast.unparse(child.value) == route
    ]


def check_context_reads(node: ast.FunctionDef | ast.AsyncFunctionDef, module: str, path: str) -> list[str]:
    """``ctx.recipe.<field>`` / ``call.ctx.recipe.<field>`` (and ``recipe.<field>`` after ``recipe = ...`` of one)
    exists on the type of the context's ``recipe``, for each parameter whose class reaches one."""
    problems = []
    for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
        if arg.arg in ("self", "recipe") or arg.annotation is None:
            continue
        for suffix, tp in context_routes(arg.annotation, module).items():
            route = arg.arg + suffix
            problems += check_reads(tp, route_reads(node, route), path)
            if aliases_recipe(node, route):
                problems += check_reads(tp, reads(node, "recipe"), path)
    return problems


def check_self_reads(cls_node: ast.ClassDef, module: str, path: str) -> list[str]:
    """``self.recipe.<field>`` in a class's methods exists on the type its ``__init__`` (own or inherited) takes."""
    found = reads(cls_node, "self", "recipe")
    if not found:
        return []
    annotation = init_annotation(cls_node, module)
    if annotation is None:
        return [f"{path}: {cls_node.name} reads self.recipe but its __init__ takes no annotated recipe"]
    return check_reads(resolve(annotation, module), found, path)


def init_annotation(cls_node: ast.ClassDef, module: str) -> str | None:
    """The annotation of the ``recipe`` its ``__init__`` takes: from the source, else (inherited) the class's own."""
    for item in cls_node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            arg = next((a for a in item.args.args + item.args.kwonlyargs if a.arg == "recipe"), None)
            return ast.unparse(arg.annotation) if arg is not None and arg.annotation is not None else None
    init = getattr(getattr(importlib.import_module(module), cls_node.name, None), "__init__", None)
    parameter = inspect.signature(init).parameters.get("recipe") if init is not None else None
    return None if parameter is None or parameter.annotation is inspect.Parameter.empty else parameter.annotation


def check_source(source: str, module: str, path: str) -> list[str]:
    """Every problem with the ``recipe`` annotations of one module's source."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            problems += check_attribute(node, module, path) + check_self_reads(node, module, path)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            problems += check_function(node, module, path) + check_context_reads(node, module, path)
    return problems


def optima_sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_recipe_parameter_names_the_fields_it_reads():
    problems = []
    for path in optima_sources():
        problems += check_source(path.read_text(), module_name(path), str(path.relative_to(REPO)))
    assert problems == []


def test_the_check_covers_the_recipe_functions():
    """The scan finds the recipe's functions (about a hundred), so an empty problem list means something."""
    count = 0
    for path in optima_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                count += any(a.arg == "recipe" for a in node.args.args + node.args.kwonlyargs)
    assert count >= 100


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("def f(recipe):\n    return recipe.port\n", "not annotated"),
        ("def f(recipe: Any):\n    return recipe.port\n", "annotated Any"),
        ("def f(recipe: InferenceRecipe):\n    return recipe.lambda1\n", "reads .lambda1"),
        ("def f(recipe: SFTLoopRecipe):\n    return recipe.port, recipe.model_root_path\n", "reads .model_root_path"),
        ("def f(recipe: InferenceRecipe):\n    return recipe.temperature\n", "reads .temperature"),
        ("class C:\n    recipe: Any\n", "C.recipe is annotated Any"),
        ("def f(recipe: LoopRecipe | Any):\n    return recipe.lambda1\n", "annotated Any"),
        (
            "class C:\n    def __init__(self, recipe: InferenceRecipe):\n        self.recipe = recipe\n"
            "    def f(self):\n        return self.recipe.iteration_times\n",
            "reads .iteration_times",
        ),
    ],
)
def test_a_wrong_annotation_is_reported(source, problem):
    problems = check_source(source, "optima.config", "example.py")
    assert len(problems) == 1 and problem in problems[0]


def test_a_right_annotation_passes():
    source = (
        "def f(recipe: LoopRecipe):\n    return recipe.lambda1 * recipe.min_tokens\n"
        "def g(recipe: Recipe):\n    return recipe.cal_ppl if hasattr(recipe, 'cal_ppl') else recipe.port\n"
        "def h(recipe: LoopRecipe):\n    def inner(recipe: Recipe):\n        return recipe.port\n"
        "    return recipe.compat, inner(recipe)\n"
    )
    assert check_source(source, "optima.config", "example.py") == []


@pytest.mark.parametrize(
    "body",
    [
        "    return part.recipe.model_root_path\n",
        "    run, recipe = part.run, part.recipe\n    return recipe.limit\n",
        "    return len(part.recipe.limit)\n",
    ],
)
def test_a_field_read_through_a_stage_context_is_checked(body):
    """A part's recipe (``Part.recipe``, its run's) is a loop's recipe: an evaluation's field read through it is
    reported."""
    problems = check_source("def f(part: Part):\n" + body, "optima.run", "example.py")
    assert len(problems) == 1 and "does not have" in problems[0]
    fine = "def f(part: Part):\n    recipe = part.recipe\n    return recipe.initial_epsilon, part.recipe.port\n"
    assert check_source(fine, "optima.run", "example.py") == []


def test_a_field_read_through_the_run_context_is_checked():
    problems = check_source("def f(run: Run):\n    return run.recipe.limit\n", "optima.run", "x.py")
    assert len(problems) == 1 and "reads .limit" in problems[0]
