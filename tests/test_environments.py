"""--vllm_env / --alignment_env resolution: conda name, virtualenv folder, python executable."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from optima.environments import DEFAULT_ENVS, EnvError, check_env, resolve_env


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A real virtualenv without pip (fast to create) and without vllm/trl."""
    path = tmp_path_factory.mktemp("envs") / "bare"
    venv.EnvBuilder(with_pip=False).create(path)
    return path


def test_virtualenv_directory(bare_venv):
    env = resolve_env(str(bare_venv), "train")
    assert env.kind == "venv"
    assert env.python_argv == (str(bare_venv / "bin" / "python"),)
    out = subprocess.run(env.module_argv("platform"), capture_output=True, text=True, check=True)
    assert out.returncode == 0


def test_python_executable():
    env = resolve_env(sys.executable, "vllm")
    assert env.kind == "python" and env.python_argv == (sys.executable,)
    assert env.script_argv("x.py", "--a") == [sys.executable, "x.py", "--a"]


def test_conda_name_runs_through_conda_run(tmp_path, monkeypatch):
    fake = tmp_path / "conda"
    fake.write_text('#!/bin/sh\necho conda "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env = resolve_env("optima-vllm", "vllm")
    assert env.kind == "conda"
    assert env.module_argv("vllm", "serve") == [
        str(fake),
        "run",
        "--no-capture-output",
        "-n",
        "optima-vllm",
        "python",
        "-m",
        "vllm",
        "serve",
    ]


def test_conda_name_without_conda(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EnvError, match="conda is not on PATH"):
        resolve_env("optima-train", "train")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [("./no/such/env", "no such file or directory"), ("/nonexistent/python3", "no such file or directory")],
)
def test_missing_paths(spec, fragment):
    with pytest.raises(EnvError, match=fragment) as info:
        resolve_env(spec, "train")
    assert "--alignment_env" in str(info.value)


def test_directory_that_is_not_a_venv(tmp_path):
    with pytest.raises(EnvError, match="without bin/python"):
        resolve_env(str(tmp_path), "vllm")


def test_non_executable_file(tmp_path):
    path = tmp_path / "python"
    path.write_text("")
    with pytest.raises(EnvError, match="not executable"):
        resolve_env(str(path), "vllm")


def test_defaults_are_the_project_venvs():
    if not (DEFAULT_ENVS["train"] / "bin" / "python").exists():
        pytest.skip("make setup has not built .venvs/train")
    env = resolve_env(None, "train")
    assert env.spec == str(DEFAULT_ENVS["train"]) and env.kind == "venv"


def test_missing_modules_are_named(bare_venv):
    env = resolve_env(str(bare_venv), "train")
    assert env.missing_modules(("json", "trl", "vllm")) == ["trl", "vllm"]
    with pytest.raises(EnvError, match="cannot import torch, transformers, trl, accelerate, datasets"):
        check_env(env, "train")


def test_child_processes_can_import_optima(bare_venv):
    env = resolve_env(str(bare_venv), "train")
    argv = env.module_argv("optima", "--help")
    out = subprocess.run(argv, capture_output=True, text=True, env=env.process_env(), cwd="/", check=False)
    assert out.returncode == 0 and "prepare-model" in out.stdout
