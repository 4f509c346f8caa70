"""Every Python file of the package, the benchmarks and the developer tools stays within the house limit of 400 lines.

A module that grows past it holds more than one thing: split it along a seam of what the code does (as
``optima.config.loop_recipes`` left ``recipes``, or ``optima.serving.reload`` left ``holder``), not at a line
count. The check reports every file over the limit with its count, so one failing run lists all of them.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 400
CHECKED = ("optima", "bench", "dev")


def oversized_modules(root: Path, folders: tuple[str, ...] = CHECKED, limit: int = MAX_LINES) -> list[str]:
    """``"path: N lines"`` for each ``.py`` file under ``root/<folder>`` with more than ``limit`` lines, sorted."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                found.append(f"{path.relative_to(root).as_posix()}: {lines} lines")
    return found


def test_no_module_of_the_package_or_the_benchmarks_exceeds_the_limit():
    offenders = oversized_modules(REPO)
    assert not offenders, f"over {MAX_LINES} lines (split each along a real seam): " + "; ".join(offenders)


def test_the_check_finds_scans_and_reports_a_long_file(tmp_path):
    """The same function on a planted tree: a long file is reported with its count, a file at the limit is not,
    and a file in a nested package is found."""
    (tmp_path / "optima" / "deep").mkdir(parents=True)
    (tmp_path / "bench").mkdir()
    (tmp_path / "optima" / "at_limit.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "optima" / "deep" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "bench" / "longer.py").write_text("y = 2\n" * (MAX_LINES + 30))
    (tmp_path / "optima" / "notes.txt").write_text("z\n" * (MAX_LINES + 5))  # not Python: not checked

    assert oversized_modules(tmp_path) == [
        f"optima/deep/long.py: {MAX_LINES + 1} lines",
        f"bench/longer.py: {MAX_LINES + 30} lines",
    ]
    assert oversized_modules(tmp_path, ("bench",)) == [f"bench/longer.py: {MAX_LINES + 30} lines"]
