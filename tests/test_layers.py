"""The layers of docs/layers.md hold: every import of optima/, bench/, dev/ and the five scripts points down the layer
map, no import circle exists, pure modules start no process, and only the process code imports subprocess.

The layer map is read from the table of docs/layers.md (one source: the page a newcomer reads is the one checked).
Every import counts: at the top of a module, inside a function, and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYERS_DOC = REPO / "docs" / "layers.md"
# A row of the layer table: | 3 | config | `optima/config/` |
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*([a-z]+)\s*\|([^|]*)\|", re.MULTILINE)
CODE = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Import:
    """One import statement's edge: the importing file and line, and the module it loads."""

    importer: str
    imported: str
    path: Path
    line: int

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root).as_posix()}:{self.line}"


def read_layer_map(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """``[(layer, module prefixes), ...]`` bottom up, from the layer table of docs/layers.md.

    A cell names files and folders (`` `optima/paths.py` ``, `` `optima/tasks/` ``): a file is its module alone, a
    folder every module under it (written ``optima.tasks.*``).
    """
    layers = []
    for number, name, cell in ROW.findall(text):
        assert int(number) == len(layers) + 1, (
            f"docs/layers.md: layer {name} is numbered {number}, not {len(layers) + 1}"
        )
        items = CODE.findall(cell)
        prefixes = tuple(module_of(Path(i.rstrip("/"))) + (".*" if i.endswith("/") else "") for i in items)
        layers.append((name, prefixes))
    return layers


def module_of(relative: Path) -> str:
    """``optima/serving/client.py`` -> ``optima.serving.client``; ``optima/__init__.py`` -> ``optima``."""
    parts = relative.with_suffix("").parts if relative.suffix == ".py" else relative.parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files(root: Path) -> list[Path]:
    """Every Python file the map covers: optima/, bench/, dev/ and the top-level scripts."""
    found = [*sorted(root.glob("*.py"))]
    for folder in ("optima", "bench", "dev"):
        found += sorted(p for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts)
    return found


def imports_of(path: Path, root: Path, modules: set[str]) -> list[Import]:
    """Every import of ``path`` that loads one of ``modules`` (relative imports resolved; at any depth)."""
    importer = module_of(path.relative_to(root))
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    # A folder of scripts (no __init__.py, run with the folder on sys.path): `import x` may load the file beside it.
    script_folder = bool(package) and not (path.parent / "__init__.py").is_file()
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        for name, line in lazy_exports(node, package):
            if name in modules:
                found.append(Import(importer, name, path, line))
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [node.module])])
            else:
                base = node.module or ""
            # `from optima import store` loads optima.store; `from optima.store import x` loads optima.store.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            if script_folder and f"{package}.{name}" in modules:  # `import benchlib` in bench/: the file beside it
                name = f"{package}.{name}"
            target = known_prefix(name, modules)
            if target and target != importer:
                found.append(Import(importer, target, path, node.lineno))
    return found


def lazy_exports(node: ast.AST, package: str) -> list[tuple[str, int]]:
    """The modules a package's ``_EXPORTS`` map names (``optima.lazy_exports``: imported on first use), with lines."""
    if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)):
        return []
    if not any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
        return []
    found = []
    for value in node.value.values:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            module = value.value if value.value.startswith("optima.") else f"{package}.{value.value}"
            found.append((module, value.lineno))
    return found


def known_prefix(name: str, modules: set[str]) -> str | None:
    """The longest module of ``modules`` that ``name`` is or lies in (None: outside the repository)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def matches(module: str, entry: str) -> bool:
    """Whether a layer table entry holds the module: the module itself, or a folder (``x.*``) it lies in."""
    folder = entry.removesuffix(".*")
    return module == folder or (entry.endswith(".*") and module.startswith(folder + "."))


def layer_index(module: str, layers: list[tuple[str, tuple[str, ...]]]) -> int:
    """The position of the layer the module belongs to: the one whose entry holds it most narrowly."""
    best = max(
        (
            (len(p.removesuffix(".*")), i)
            for i, (_, prefixes) in enumerate(layers)
            for p in prefixes
            if matches(module, p)
        ),
        default=None,
    )
    if best is None:
        raise AssertionError(f"{module} belongs to no layer of docs/layers.md")
    return best[1]


def all_imports(root: Path) -> list[Import]:
    files = source_files(root)
    modules = {module_of(p.relative_to(root)) for p in files}
    return [edge for path in files for edge in imports_of(path, root, modules)]


def upward_imports(root: Path, layers: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """``file:line: a (layer) imports b (layer above it)`` for every import that points up the map."""
    bad = []
    for edge in all_imports(root):
        source, target = layer_index(edge.importer, layers), layer_index(edge.imported, layers)
        if target > source:
            bad.append(
                f"{edge.where(root)}: {edge.importer} ({layers[source][0]}) imports {edge.imported} "
                f"({layers[target][0]}, a layer above it)"
            )
    return bad


def import_circles(root: Path) -> list[str]:
    """Every strongly connected component of more than one module (Tarjan), with the imports that close it."""
    edges = all_imports(root)
    graph: dict[str, list[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, []).append(edge.imported)
        graph.setdefault(edge.imported, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    report = []
    for component in components:
        inside = set(component)
        closing = sorted(
            {
                f"{e.where(root)}: {e.importer} imports {e.imported}"
                for e in edges
                if {e.importer, e.imported} <= inside
            }
        )
        report.append(f"import circle through {len(component)} modules: " + "; ".join(closing))
    return report


LAYERS = read_layer_map(LAYERS_DOC.read_text())


def test_the_layer_table_is_read_and_covers_every_file():
    names = [name for name, _ in LAYERS]
    assert names[:3] == ["base", "tasks", "config"] and names[-1] == "bench" and len(set(names)) == len(names)
    modules = {module_of(p.relative_to(REPO)) for p in source_files(REPO)}
    for module in modules:
        layer_index(module, LAYERS)  # raises for a module no row names
    named = [p for _, prefixes in LAYERS for p in prefixes]
    missing = [p for p in named if not any(matches(m, p) for m in modules)]
    assert missing == [], "docs/layers.md names files that do not exist"


def test_imports_point_down_the_layer_map():
    assert upward_imports(REPO, LAYERS) == []


def test_no_import_circle():
    assert import_circles(REPO) == []


def test_every_kind_of_import_is_seen(tmp_path):
    """Module-level, function-local, TYPE_CHECKING and relative imports are all edges."""
    modules = {module_of(p.relative_to(REPO)) for p in source_files(REPO)}
    edges = {(e.importer, e.imported) for e in imports_of(REPO / "optima" / "lm_loss.py", REPO, modules)}
    assert ("optima.lm_loss", "optima.config.rules") in edges  # at the top
    assert ("optima.lm_loss", "optima.config") in edges  # under TYPE_CHECKING
    root = plant(tmp_path, {"optima/__init__.py": "", "optima/a.py": "def f():\n    from optima.b import x\n"})
    edges = {(e.importer, e.imported) for e in imports_of(root / "optima" / "a.py", root, {"optima.a", "optima.b"})}
    assert ("optima.a", "optima.b") in edges  # inside a function
    edges = {(e.importer, e.imported) for e in imports_of(REPO / "optima" / "hardware" / "__init__.py", REPO, modules)}
    assert ("optima.hardware", "optima.hardware.allocation") in edges  # a lazy export (optima.lazy_exports)
    edges = {(e.importer, e.imported) for e in imports_of(REPO / "optima" / "training" / "__init__.py", REPO, modules)}
    assert ("optima.training", "optima.hardware.machine") in edges  # a lazy export from another package


def plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


PLANTED_MAP = """
| layer | name | files |
|---|---|---|
| 1 | base | `optima/__init__.py`, `optima/paths.py` |
| 2 | serving | `optima/serving/` |
| 3 | entry | `optima/cli.py`, `run.py` |
| 4 | bench | `bench/` |
"""


def test_a_planted_upward_import_is_reported_with_its_file_and_line(tmp_path):
    root = plant(
        tmp_path,
        {
            "optima/__init__.py": '_EXPORTS = {\n    "serve": "optima.serving.replicas",\n}\n',
            "optima/paths.py": "import os\n\n\ndef f():\n    from optima.serving.replicas import serve\n",
            "optima/serving/__init__.py": "",
            "optima/serving/replicas.py": "from optima import paths\n",
            "optima/cli.py": "from optima.serving import replicas\n",
            "run.py": "from optima.cli import main\n",
            "bench/tool.py": "from .helper import x\n",
            "bench/helper.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from run import main\n",
        },
    )
    layers = read_layer_map(PLANTED_MAP)
    assert [name for name, _ in layers] == ["base", "serving", "entry", "bench"]
    assert upward_imports(root, layers) == [
        "optima/__init__.py:2: optima (base) imports optima.serving.replicas (serving, a layer above it)",
        "optima/paths.py:5: optima.paths (base) imports optima.serving.replicas (serving, a layer above it)",
    ]
    (root / "optima" / "serving" / "replicas.py").write_text("import os\nfrom ..cli import main\n")
    assert upward_imports(root, layers)[-1] == (
        "optima/serving/replicas.py:2: optima.serving.replicas (serving) imports optima.cli (entry, a layer above it)"
    )


def test_a_planted_circle_is_reported_with_its_imports(tmp_path):
    root = plant(
        tmp_path,
        {
            "optima/__init__.py": "",
            "optima/a.py": "from optima import b\n",
            "optima/b.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from optima.c import C\n",
            "optima/c.py": "def f():\n    import optima.a\n",
            "optima/d.py": "from optima import a\n",
            "bench/x.py": "import y\n",
            "bench/y.py": "import x\n",
        },
    )
    assert import_circles(root) == [
        "import circle through 2 modules: bench/x.py:1: bench.x imports bench.y; bench/y.py:1: bench.y imports "
        "bench.x",
        "import circle through 3 modules: optima/a.py:1: optima.a imports optima.b; optima/b.py:4: optima.b imports "
        "optima.c; optima/c.py:2: optima.c imports optima.a",
    ]


# Modules that compute and never start a process (not even through what they import).
PURE = ("optima.selection", "optima.agents", "optima.tasks", "optima.reward", "optima.config", "optima.store")
# The code that starts processes: serving, the trainer launch, the GPU probe and the setup code.
PROCESS_CODE = (
    "serving/",
    "training/launch.py",
    "hardware/machine.py",
    "install.py",
    "environments.py",
    "models.py",
)


def pure_modules() -> list[str]:
    names = []
    for path in sorted((REPO / "optima").rglob("*.py")):
        name = module_of(path.relative_to(REPO))
        if any(name == p or name.startswith(p + ".") for p in PURE):
            names.append(name)
    return names


def test_the_pure_list_covers_the_packages():
    names = pure_modules()
    assert {"optima.selection.mcts", "optima.agents.generation", "optima.tasks.math_equiv", "optima.reward"} <= set(
        names
    )


@pytest.mark.parametrize("package", PURE)
def test_pure_modules_do_not_import_process_code(package):
    """Each pure module, imported in a fresh interpreter, leaves ``subprocess`` and the process code unimported."""
    modules = [m for m in pure_modules() if m == package or m.startswith(package + ".")]
    code = (
        "import importlib, sys\n"
        "bad = {}\n"
        "for name in sys.argv[1:]:\n"
        "    before = set(sys.modules)\n"
        "    importlib.import_module(name)\n"
        "    new = set(sys.modules) - before\n"
        "    hits = sorted(m for m in new if m == 'subprocess' or m.startswith(('optima.serving.holder',"
        " 'optima.serving.vllm_server', 'optima.serving.processes', 'optima.training.launch', 'optima.install',"
        " 'optima.environments', 'optima.loop', 'optima.stages')))\n"
        "    if hits: bad[name] = hits\n"
        "print(bad)\n"
    )
    # Each module on its own would need one interpreter each; in one interpreter a module that pulls process code
    # is named because the first module to import it gets the blame (and the check fails either way).
    result = subprocess.run(
        [sys.executable, "-c", code, *modules], capture_output=True, text=True, cwd=REPO, check=True, timeout=300
    )
    assert result.stdout.strip() == "{}", result.stdout


def imports_subprocess(path: Path) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "subprocess" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "subprocess":
            return True
    return False


def test_only_the_process_code_imports_subprocess():
    package = REPO / "optima"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if imports_subprocess(path) and not relative.startswith(PROCESS_CODE):
            offenders.append(relative)
    assert offenders == []
    assert imports_subprocess(package / "training" / "launch.py")  # the check sees a real import
