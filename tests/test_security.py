"""Security rules (issue 8): loopback by default, API keys only with a key, never in argv or logs or saved
recipes; no shell, no kill-by-name, only ``yaml.safe_load`` anywhere in the project's code."""

from __future__ import annotations

import ast
import logging
import os
import sys
from pathlib import Path

import pytest
import yaml

from optima.config import RecipeError, SFTRecipe, load_recipe, save_recipe
from optima.environments import PythonEnv
from optima.hardware.placement import Placement
from optima.paths import RunPaths
from optima.serving.processes import group_members
from optima.serving.vllm_server import build_serve_command, find_free_port, serve
from tests.helpers import child_groups

REPO = Path(__file__).resolve().parent.parent
FAKE_ENV = PythonEnv("fake", "python", (sys.executable, str(Path(__file__).with_name("fake_vllm.py"))))


def test_servers_bind_loopback_by_default(make_recipe):
    assert SFTRecipe.__dataclass_fields__["host"].default == "127.0.0.1"
    argv = build_serve_command(make_recipe(), "/models/m", 8000, FAKE_ENV, Placement())
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "0.0.0.0" not in argv


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gpu-node-7"])
def test_a_non_loopback_host_needs_an_api_key(make_recipe, host):
    with pytest.raises(RecipeError, match="set api_key too"):
        make_recipe(host=host)
    argv = build_serve_command(make_recipe(host=host, api_key="k"), "/m", 8000, FAKE_ENV, Placement())
    assert argv[argv.index("--host") + 1] == host


def test_the_api_key_never_reaches_a_command_line_or_a_log(make_recipe, caplog):
    key = "sk-optima-7f3a9c"
    recipe = make_recipe(api_key=key, port=find_free_port("127.0.0.1", 23500 + os.getpid() % 5000))
    stage = RunPaths.from_recipe(recipe).stage(0)
    with caplog.at_level(logging.DEBUG), serve(recipe, "model", FAKE_ENV, stage):
        (group,) = child_groups(os.getpid())
        cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in group_members(group)]
        environ = Path(f"/proc/{group}/environ").read_bytes()
    assert cmdlines and all(key.encode() not in cmdline for cmdline in cmdlines)
    assert all(b"--host\x00127.0.0.1" in cmdline for cmdline in cmdlines)
    assert key not in caplog.text and key not in stage.server_log(0).read_text()  # the log quotes the argv
    assert f"VLLM_API_KEY={key}".encode() in environ  # it travels in the environment instead


def project_sources() -> list[Path]:
    scripts = sorted(REPO.glob("*_script.py")) + sorted((REPO / "alignment-handbook" / "scripts").glob("*.py"))
    return sorted((REPO / "optima").rglob("*.py")) + scripts


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def test_no_shell_no_os_system_no_pkill():
    found = []
    for path in project_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Call):
                shell = [k for k in node.keywords if k.arg == "shell"]
                if any(not (isinstance(k.value, ast.Constant) and k.value.value is False) for k in shell):
                    found.append(f"{where} shell=")
                if dotted(node.func) in (
                    "os.system",
                    "os.popen",
                    "subprocess.getoutput",
                    "subprocess.getstatusoutput",
                ):
                    found.append(f"{where} {dotted(node.func)}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.split(" ")[0] in ("pkill", "killall"):
                    found.append(f"{where} {node.value!r}")
    assert not found


def test_yaml_is_only_read_with_safe_load():
    unsafe = {"load", "load_all", "full_load", "full_load_all", "unsafe_load", "unsafe_load_all"}
    unsafe |= {"Loader", "FullLoader", "UnsafeLoader"}
    found, safe_loads = [], 0
    for path in project_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and dotted(node.value) == "yaml":
                safe_loads += node.attr == "safe_load"
                if node.attr in unsafe:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} yaml.{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module == "yaml":
                found += [f"{path.relative_to(REPO)}:{node.lineno} from yaml import {a.name}" for a in node.names]
    assert not found and safe_loads >= 3  # the scan does see the loaders


def test_saved_recipes_do_not_hold_the_api_key(tmp_path):
    values = {
        "dataset_type": "arc",
        "initial_model_path": "org/model",
        "origin_yaml_path": "x.yaml",
        "api_key": "sk-secret-1",
    }
    recipe = load_recipe(SFTRecipe, None, values, check_paths=False)
    path = tmp_path / "recipe.yaml"
    save_recipe(recipe, path)
    saved = yaml.safe_load(path.read_text())
    assert "sk-secret-1" not in path.read_text() and saved["api_key"] == "<redacted>"
