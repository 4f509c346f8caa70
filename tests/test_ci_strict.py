"""With CI set, a skip for a missing venv, model, package or data fails the run; other skips stay skips
(tests/ci_strict.py). Each case runs pytest in a child process on a small test folder that loads the same hooks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLE = """
import pytest

def test_passes():
    pass

@pytest.mark.skipif(True, reason="no .venvs/vllm (run `make setup`)")
def test_needs_the_vllm_env():
    pass

def test_needs_data():
    pytest.skip("dataset samples not found at /nowhere (the repository's data/, or OPTIMA_DATA_DIR)")

@pytest.mark.skipif(True, reason="needs a visible NVIDIA GPU")
def test_needs_a_gpu():
    pass

@pytest.mark.skipif(True, reason="flash-attn is not installed")
def test_needs_flash_attn():
    pass

@pytest.mark.xfail(reason="run `make setup` first", strict=True)
def test_expected_failure():
    assert False
"""
MODULE_SKIP = 'import pytest\n\npytest.importorskip("optima_no_such_module")\n\ndef test_never_runs():\n    pass\n'


def run_sample(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    hooks = "from tests.ci_strict import pytest_make_collect_report, pytest_runtest_makereport\n"
    (tmp_path / "conftest.py").write_text(hooks)
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)} | ({"CI": ci} if ci is not None else {})
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "--continue-on-collection-errors"]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ci", ["true", "1"])
def test_with_ci_set_skips_for_missing_set_up_fail(tmp_path, ci):
    result = run_sample(tmp_path, ci)
    out = result.stdout
    assert result.returncode == 1, out
    # a skip mark acts in the test's setup, so it shows as an error there; pytest.skip in the body as a failure
    assert "ERROR test_sample.py::test_needs_the_vllm_env" in out and "FAILED test_sample.py::test_needs_data" in out
    assert "ERROR test_module_skip.py" in out and "optima_no_such_module" in out
    assert "a skip for a missing part of the set-up fails the run" in out
    assert "needs a visible NVIDIA GPU" in out and "flash-attn is not installed" in out  # still skipped
    assert "XFAIL test_sample.py::test_expected_failure" in out and "1 passed" in out
    assert "1 failed, 1 passed, 2 skipped, 1 xfailed, 2 errors" in out


@pytest.mark.parametrize("ci", [None, "", "0", "false"])
def test_without_ci_they_stay_skips(tmp_path, ci):
    result = run_sample(tmp_path, ci)
    assert result.returncode == 0, result.stdout
    assert "1 passed, 5 skipped, 1 xfailed" in result.stdout
