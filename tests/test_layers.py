"""The layers say what they are: pure modules start no process, only the process layer imports subprocess, and
every import follows the layer map of docs/layers.md."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from optima.hardware.gpus import has_gpu, visible_gpus

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "optima"
# Modules that compute and never start a process (not even through what they import).
PURE = ("optima.selection", "optima.agents", "optima.tasks", "optima.reward", "optima.config", "optima.store")
# The process layer: serving, the trainer launch, and the setup code (environments, `make setup`, model preparation).
PROCESS_LAYER = (
    "serving/",
    "training/launch.py",
    "training/warm.py",
    "training/nodes.py",
    "install.py",
    "environments.py",
    "models.py",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def pure_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
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
    """Each pure module, imported in a fresh interpreter, leaves ``subprocess`` and the process layer unimported."""
    modules = [m for m in pure_modules() if m == package or m.startswith(package + ".")]
    code = (
        "import importlib, sys\n"
        "bad = {}\n"
        "for name in sys.argv[1:]:\n"
        "    before = set(sys.modules)\n"
        "    importlib.import_module(name)\n"
        "    new = set(sys.modules) - before\n"
        "    hits = sorted(m for m in new if m == 'subprocess' or m.startswith(('optima.serving.replicas',"
        " 'optima.serving.vllm_server', 'optima.serving.processes', 'optima.training.launch', 'optima.install',"
        " 'optima.environments', 'optima.plan', 'optima.pipeline')))\n"
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


def test_only_the_process_layer_imports_subprocess():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if imports_subprocess(path) and not relative.startswith(PROCESS_LAYER):
            offenders.append(relative)
    assert offenders == []
    assert imports_subprocess(PACKAGE / "training" / "launch.py")  # the check sees a real import


def fake_nvidia_smi(folder: Path, gpus: int) -> Path:
    script = folder / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: Fake GPU (UUID: GPU-{i})'\n" for i in range(gpus))
    script.write_text("#!/bin/sh\n" + lines)
    script.chmod(0o755)
    return script


def test_visible_gpus_honours_cuda_visible_devices(tmp_path):
    smi = fake_nvidia_smi(tmp_path, 4)
    assert visible_gpus({}, str(smi)) == ["0", "1", "2", "3"]  # unset: what nvidia-smi lists
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, str(smi)) == []  # set to nothing: no GPU
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, str(smi)) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}, str(smi)) == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}, str(smi)) == ["2", "3"]


def test_visible_gpus_finds_nvidia_smi_on_path(tmp_path):
    fake_nvidia_smi(tmp_path, 2)
    assert visible_gpus({"PATH": str(tmp_path)}) == ["0", "1"]
    assert has_gpu({"PATH": str(tmp_path)})
    assert not has_gpu({"PATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""})
    empty = tmp_path / "empty"
    empty.mkdir()
    assert visible_gpus({"PATH": str(empty)}) == []  # no nvidia-smi: a CPU machine


# The layer map of docs/layers.md, once, as data: each layer's modules (a module belongs to the layer of its longest
# matching prefix) and the layers it may import (its own layer always). Checked against every import in optima/.
LAYERS = {
    "tasks": ("optima.tasks",),
    "base": (
        "optima",
        "optima.paths",
        "optima.store",
        "optima.identity",
        "optima.manifest",
        "optima.logging_utils",
        "optima.weights_probe",
    ),
    "config": ("optima.config",),
    "clients": ("optima.serving.client", "optima.serving.kv_monitor", "optima.serving.capacity"),
    "agents": ("optima.agents", "optima.reward", "optima.loss_stream"),
    "selection": ("optima.selection",),
    "process": (
        "optima.serving",
        "optima.hardware",
        "optima.training",
        "optima.lm_loss",
        "optima.environments",
        "optima.install",
        "optima.models",
    ),
    "reports": (
        "optima.evaluation",
        "optima.browser",
        "optima.reporting",
        "optima.tracking",
        "optima.wandb_tracking",
        "optima.hub",
        "optima.run_context",
    ),
    "stages": ("optima.stages", "optima.stage_identity", "optima.plan", "optima.pipeline"),
    "entry": ("optima.cli", "optima.__main__"),
}
_BELOW_AGENTS = {"tasks", "base", "config", "clients"}
ALLOWED = {
    "tasks": set(),
    "base": set(),
    "config": {"tasks", "base"},
    "clients": {"base", "config"},
    "agents": _BELOW_AGENTS,
    "selection": _BELOW_AGENTS | {"agents"},
    "process": _BELOW_AGENTS,
    "reports": _BELOW_AGENTS | {"agents", "selection", "process"},
    "stages": _BELOW_AGENTS | {"agents", "selection", "process", "reports"},
    "entry": set(LAYERS),
}
# Known exceptions (importer, imported module), each with its reason in docs/layers.md.
EXCEPTIONS = {("optima.config.groups", "optima.tracking")}


def layer_of(module: str) -> str:
    best = max(
        (p for members in LAYERS.values() for p in members if module == p or module.startswith(p + ".")), key=len
    )
    return next(name for name, members in LAYERS.items() if best in members)


def is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


def optima_imports(path: Path) -> set[str]:
    """Every ``optima`` module the file imports, at the top or inside a function (relative imports resolved)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            base = ".".join([*parts, *filter(None, [node.module])])
            # `from optima import store` imports the module optima.store; `from optima.store import x` imports store.
            found |= {f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names}
    return {m for m in found if m == "optima" or m.startswith("optima.")}


def layer_violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        source = layer_of(importer)
        for imported in sorted(optima_imports(path)):
            target = layer_of(imported)
            if target != source and target not in ALLOWED[source] and (importer, imported) not in EXCEPTIONS:
                bad.append(f"{importer} ({source}) imports {imported} ({target})")
    return bad


def test_imports_follow_the_layer_map():
    assert layer_violations() == []


def test_the_layer_map_covers_every_module_and_names_only_real_exceptions():
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    assert {layer_of(m) for m in modules} == set(LAYERS)  # every layer holds a module
    assert all(any(m == p or m.startswith(p + ".") for m in modules) for ps in LAYERS.values() for p in ps)
    for importer, imported in EXCEPTIONS:  # an exception that no longer happens is removed from the map
        assert imported in optima_imports(PACKAGE.parent.joinpath(*importer.split(".")).with_suffix(".py"))
