"""A ``--dry-run`` of the demo recipe imports at most ``MAX_MODULES`` modules of ``optima`` (issue #36: 132 before).

Counted from ``sys.modules`` in a fresh interpreter running ``sft_script.py`` as the README does, so an import added
anywhere on the way (at the top of a module, in a function the dry run calls, a package's ``__init__``) is counted.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_MODULES = 74
DEMO = "train/sft_recipes/demo_arc.yaml"
COUNT = """
import contextlib, io, runpy, sys
{extra}
sys.argv = ["sft_script.py", "--train_config_path", {demo!r}, "--dry-run"]
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        runpy.run_path("sft_script.py", run_name="__main__")
    except SystemExit as exit:
        assert exit.code == 0 and "iteration 1/" in out.getvalue(), (exit.code, out.getvalue()[-2000:])
print("\\n".join(sorted(m for m in sys.modules if m == "optima" or m.startswith("optima."))))
"""


def dry_run_modules(extra: str = "") -> list[str]:
    """The ``optima`` modules loaded once the demo's dry run has printed its plan (``extra``: run before it)."""
    code = COUNT.format(extra=extra, demo=DEMO)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()


def over_bound(modules: list[str], bound: int = MAX_MODULES) -> str | None:
    """Why ``modules`` break the bound (None: they do not)."""
    return f"{len(modules)} optima modules > {bound}: {', '.join(modules)}" if len(modules) > bound else None


def test_the_demo_dry_run_imports_at_most_the_bound():
    modules = dry_run_modules()
    assert {"optima.loop", "optima.run", "optima.stages"} <= set(modules)  # it went through the loop
    assert over_bound(modules) is None


def test_a_planted_import_is_counted_and_breaks_a_bound_that_held():
    modules = dry_run_modules()
    planted = dry_run_modules(extra="import optima.__main__")  # not on the dry run's way
    assert "optima.__main__" in set(planted) - set(modules)
    assert over_bound(modules, len(modules)) is None and over_bound(planted, len(modules)) is not None
