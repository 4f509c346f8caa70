"""No stage waits on a timer: every ``time.sleep`` is the poll interval of a loop that has a deadline.

A fixed sleep ("give the server 5 s") is either too short on a busy machine or wasted time on an idle one; waits
go on an event (a process exit, ``/health``, a future, ``Event.wait``). The scan covers the package, the
benchmarks and the top-level scripts; the tests' fakes simulate slow servers on purpose and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCANNED = [*sorted((REPO / "optima").rglob("*.py")), *sorted((REPO / "bench").glob("*.py")), *REPO.glob("*.py")]


def _is_sleep(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr == "sleep" and isinstance(func.value, ast.Name) and func.value.id == "time"
    return isinstance(func, ast.Name) and func.id == "sleep"


def _calls_monotonic(function: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) == "monotonic"
        for n in ast.walk(function)
    )


def fixed_sleeps(source: str, name: str) -> list[str]:
    """``file:line`` of every sleep that is not inside a ``while`` loop of a function that keeps a deadline."""
    tree = ast.parse(source)
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    found = []
    for node in ast.walk(tree):
        if not _is_sleep(node):
            continue
        in_loop, function, parent = False, None, parents.get(node)
        while parent is not None and function is None:
            in_loop = in_loop or isinstance(parent, ast.While)
            if isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef):
                function = parent
            parent = parents.get(parent)
        if not (in_loop and function is not None and _calls_monotonic(function)):
            found.append(f"{name}:{node.lineno}")
    return found


def test_the_check_catches_a_fixed_sleep():
    bad = "import time\ndef start():\n    launch()\n    time.sleep(5)\n"
    loop_without_deadline = "import time\ndef wait():\n    while not ready():\n        time.sleep(1)\n"
    poll = (
        "import time\ndef wait(t):\n    deadline = time.monotonic() + t\n"
        "    while not ready() and time.monotonic() < deadline:\n        time.sleep(0.1)\n"
    )
    assert fixed_sleeps(bad, "bad") == ["bad:4"]
    assert fixed_sleeps(loop_without_deadline, "loop") == ["loop:4"]
    assert fixed_sleeps(poll, "poll") == []


def test_no_stage_waits_on_a_timer():
    assert len(SCANNED) > 50
    found = [hit for path in SCANNED for hit in fixed_sleeps(path.read_text(), str(path.relative_to(REPO)))]
    assert found == [], f"fixed sleeps (wait on an event or poll to a deadline instead): {found}"
