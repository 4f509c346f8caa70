"""Setup on a GPU machine: flash-attn is kept only where it works, and a missing wheel is not retried every time.

A fake python executable stands in for the training env: it answers the import check as told and records the
pip commands it gets.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from optima.install import FLASH_ATTN_MARKER, STAMP_NAME, ensure_flash_attn

FAKE_PYTHON = """#!/usr/bin/env python3
import json, os, sys
env_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(env_dir, "calls.jsonl"), "a") as log:
    skip_build = os.environ.get("FLASH_ATTENTION_SKIP_CUDA_BUILD")
    log.write(json.dumps({"argv": sys.argv[1:], "skip_build": skip_build}) + "\\n")
installed = os.path.join(env_dir, "installed")
if sys.argv[1] == "-c":
    raise SystemExit(0 if os.path.exists(installed) and os.path.exists(os.path.join(env_dir, "wheel_fits")) else 1)
if sys.argv[1:4] == ["-m", "pip", "install"]:
    open(installed, "w").close()
if sys.argv[1:4] == ["-m", "pip", "uninstall"]:
    os.remove(installed)
"""


def fake_env(tmp_path: Path, wheel_fits: bool) -> Path:
    env_dir = tmp_path / "train"
    (env_dir / "bin").mkdir(parents=True)
    python = env_dir / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    (env_dir / STAMP_NAME).write_text("stamp-1\n")
    if wheel_fits:
        (env_dir / "wheel_fits").touch()
    return python


def calls(python: Path) -> list[dict]:
    return [json.loads(line) for line in (python.parent.parent / "calls.jsonl").read_text().splitlines()]


def test_flash_attn_is_installed_where_a_wheel_fits(tmp_path):
    python = fake_env(tmp_path, wheel_fits=True)
    assert ensure_flash_attn(python) is True
    install = [c for c in calls(python) if c["argv"][:3] == ["-m", "pip", "install"]]
    assert install == [{"argv": ["-m", "pip", "install", "--no-build-isolation", "flash-attn"], "skip_build": "TRUE"}]
    assert ensure_flash_attn(python) is True and len(calls(python)) == 4  # the second call only checks the import


def test_without_a_wheel_it_is_removed_and_not_retried_until_the_env_changes(tmp_path):
    python = fake_env(tmp_path, wheel_fits=False)
    assert ensure_flash_attn(python) is False
    assert [c["argv"][:3] for c in calls(python)][1:] == [
        ["-m", "pip", "install"],
        ["-c", "import flash_attn, flash_attn_2_cuda"],
        ["-m", "pip", "uninstall"],
    ]
    assert not (python.parent.parent / "installed").exists()
    assert (python.parent.parent / FLASH_ATTN_MARKER).read_text().strip() == "stamp-1"
    before = len(calls(python))
    assert ensure_flash_attn(python) is False and len(calls(python)) == before + 1  # import check only
    (python.parent.parent / STAMP_NAME).write_text("stamp-2\n")  # requirements changed: try again
    ensure_flash_attn(python)
    assert ["-m", "pip", "install"] in [c["argv"][:3] for c in calls(python)[before + 1 :]]
