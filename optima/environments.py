"""`--vllm_env` / `--alignment_env` as a Python command line: no shell, no conda activation (docs/method.md D2).

An environment is a python executable, a virtualenv directory (its `bin/python`) or a conda env name (`conda run
--no-capture-output -n NAME python`); unset flags mean the project's `.venvs/vllm` and `.venvs/train`. Children
get this repository on `PYTHONPATH`, so `python -m optima...` runs in envs that never installed it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ENVS = {"vllm": REPO_ROOT / ".venvs" / "vllm", "train": REPO_ROOT / ".venvs" / "train"}
# What each role must be able to import (checked before any work starts).
REQUIRED_MODULES = {"vllm": ("vllm",), "train": ("torch", "transformers", "trl", "accelerate", "datasets")}


class EnvError(RuntimeError):
    """An environment flag that does not name a usable Python environment."""


@dataclass(frozen=True)
class PythonEnv:
    """A Python environment (`spec`: what the user passed) as the argv that starts its interpreter."""

    spec: str
    kind: Literal["python", "venv", "conda"]
    python_argv: tuple[str, ...]

    def module_argv(self, module: str, *args: str) -> list[str]:
        """`python -m module args...` inside this env."""
        return [*self.python_argv, "-m", module, *args]

    def script_argv(self, script: Path | str, *args: str) -> list[str]:
        """`python script args...` inside this env."""
        return [*self.python_argv, str(script), *args]

    def process_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """A child process's environment variables: ours, this repository on PYTHONPATH, and `extra`."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        return env | (extra or {})

    def missing_modules(self, modules: tuple[str, ...]) -> list[str]:
        """The `modules` this env cannot import (found by spec, nothing is imported)."""
        code = (
            "import importlib.util, json, sys\n"
            "print(json.dumps([m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]))"
        )
        result = subprocess.run(
            [*self.python_argv, "-c", code, *modules], capture_output=True, text=True, check=False, timeout=120
        )
        if result.returncode != 0:
            raise EnvError(f"{self.describe()} does not run: {result.stderr.strip()[-500:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    def describe(self) -> str:
        return f"{self.kind} env {self.spec!r} ({' '.join(self.python_argv)})"


def resolve_env(spec: str | None, role: Literal["vllm", "train"]) -> PythonEnv:
    """A flag value (None: the default `.venvs/<role>`) as a `PythonEnv`; no process is started.

    Raises:
        EnvError: the path does not exist, holds no Python, or a conda name is given without conda.
    """
    if spec is None or spec == "":
        default = DEFAULT_ENVS[role]
        if not (default / "bin" / "python").exists():
            raise EnvError(f"default {role} env {default} does not exist; run `make setup` (or pass --{_flag(role)})")
        return PythonEnv(str(default), "venv", (str(default / "bin" / "python"),))
    path = Path(spec).expanduser()
    if path.is_dir():
        python = path / "bin" / "python"
        if not python.exists():
            raise EnvError(f"--{_flag(role)} {spec!r} is a directory without bin/python (not a virtualenv)")
        return PythonEnv(spec, "venv", (str(python.absolute()),))
    if path.is_file():
        if not os.access(path, os.X_OK):
            raise EnvError(f"--{_flag(role)} {spec!r} is a file but not executable")
        return PythonEnv(spec, "python", (str(path.absolute()),))
    if "/" in spec or spec.startswith("."):
        raise EnvError(f"--{_flag(role)} {spec!r}: no such file or directory")
    conda = shutil.which("conda")
    if conda is None:
        raise EnvError(
            f"--{_flag(role)} {spec!r} looks like a conda env name, but conda is not on PATH; "
            "pass a virtualenv directory or a python executable instead"
        )
    return PythonEnv(spec, "conda", (conda, "run", "--no-capture-output", "-n", spec, "python"))


def check_env(env: PythonEnv, role: Literal["vllm", "train"]) -> None:
    """Fail with one clear message when `env` lacks what its role needs."""
    missing = env.missing_modules(REQUIRED_MODULES[role])
    if missing:
        raise EnvError(f"{env.describe()} cannot import {', '.join(missing)}, needed as the --{_flag(role)}")


def _flag(role: str) -> str:
    return "vllm_env" if role == "vllm" else "alignment_env"
