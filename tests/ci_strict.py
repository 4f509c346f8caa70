"""Under CI, a test skipped because the set-up is incomplete fails the run instead of passing silently.

`make test` builds both virtualenvs and the model before the tests, and the dataset samples are in the
repository (data/), so on a CI machine a skip for a missing venv, model, package or data means that the set-up
is broken, not that the test does not apply. Such skips are recognised by their reason (they all point at
`make setup`, `.venvs`, the data folder or a package that cannot be imported); skips for what a machine may
lack by design (a GPU, flash-attn) stay skips. CI counts as set when the variable `CI` is non-empty
and not `0`, `false` or `no`. tests/conftest.py imports the two hooks.
"""

from __future__ import annotations

import os
import re

import pytest

MISSING = re.compile(
    r"make setup|optima setup|\.venvs|OPTIMA_DATA_DIR|data samples|data under|could not import|is not installed",
    re.IGNORECASE,
)
OPTIONAL = re.compile(r"GPU|CUDA|flash-attn", re.IGNORECASE)


def ci_is_strict() -> bool:
    """Whether the variable CI asks for a run without skips for missing pieces."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing_piece(report) -> str | None:
    """The skip reason of ``report`` when it names a missing venv, model, package or data; else None."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
    return reason if MISSING.search(reason) and not OPTIONAL.search(reason) else None


def fail_if_missing(report) -> None:
    """Turn ``report`` (a test phase or a module's collection) into a failure when CI is set and it skipped
    for a missing piece."""
    if ci_is_strict() and (reason := missing_piece(report)):
        report.outcome = "failed"
        report.longrepr = f"CI is set, so a skip for a missing part of the set-up fails the run: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    fail_if_missing(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    fail_if_missing(report)
    return report
