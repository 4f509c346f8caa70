"""bench/ sits on top of Optima: a package run as ``python -m bench.<name>``, without ``sys.path`` edits, using only
Optima's public entry points; what it writes (bench/RESULTS.md) names repository paths and is rewritten whole."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

from bench import benchlib, report, run_all

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
OPTIMA = REPO / "optima"


def optima_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every ``optima`` import in a file, at the top or inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "optima":
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "optima"]
    return found


def private_reach(module: str, names: list[str]) -> str | None:
    """Why an import is not a public entry point (None when it is one).

    Public: a name a package exports (its ``__all__``), or a public name of a top-level module of ``optima``.
    """
    parts = module.split(".")
    if len(parts) == 1:
        return "import a package or a top-level module of optima, not optima itself" if names else None
    if len(parts) > 2:
        return f"{module} is inside a package: import what {'.'.join(parts[:2])} exports"
    target = importlib.import_module(module)
    if (OPTIMA / parts[1]).is_dir():
        hidden = [name for name in names if name not in getattr(target, "__all__", [])]
        return f"{module} does not export {hidden} (add them to its __init__)" if hidden else None
    hidden = [name for name in names if name.startswith("_")]
    return f"{hidden} are private to {module}" if hidden else None


def test_the_public_entry_point_rule_sees_an_internal_import():
    assert private_reach("optima.serving.holder", ["ServerHolder"]).startswith("optima.serving.holder is inside")
    assert "does not export ['KVMonitor']" in private_reach("optima.serving", ["KVMonitor"])
    assert private_reach("optima.paths", ["_private"]) and private_reach("optima.paths", ["RunPaths"]) is None
    assert private_reach("optima.serving", ["ServerHolder"]) is None


def test_bench_uses_only_public_entry_points_of_optima():
    offenders = []
    for path in sorted(BENCH.glob("*.py")):
        for line, module, names in optima_imports(path):
            if reason := private_reach(module, names):
                offenders.append(f"bench/{path.name}:{line}: {reason}")
    assert not offenders, "\n".join(offenders)


def test_every_exported_name_resolves():
    """The lazy exports bench relies on point at modules and names that exist."""
    for package in ("optima.agents", "optima.hardware", "optima.serving", "optima.training", "optima.cli"):
        module = importlib.import_module(package)
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{package} exports {missing}, which do not resolve"


def test_bench_is_a_package_without_path_edits():
    assert (BENCH / "__init__.py").is_file()
    edits = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                edits.append(f"bench/{path.name}:{node.lineno}")
    assert not edits, f"sys.path edits: {edits} (run as python -m bench.<name> from the repository)"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__"))
def test_every_benchmark_imports_as_a_module(name):
    importlib.import_module(f"bench.{name}")


def test_shown_paths_are_relative_to_the_repository_without_following_links(tmp_path, monkeypatch):
    assert benchlib.shown(REPO / "runs" / "demo_arc_sft") == "runs/demo_arc_sft"
    assert benchlib.shown(REPO / "models" / "SmolLM2-135M-Instruct") == "models/SmolLM2-135M-Instruct"
    assert benchlib.shown(tmp_path / "x") == str(tmp_path / "x")  # outside: as given
    monkeypatch.chdir(REPO)
    assert benchlib.shown("runs/x") == "runs/x"


def generation_result(date: str, ratio: float, hit: float) -> dict:
    data = {
        "generator": {"tokens": 100, "seconds": 2.0, "tokens_per_s": 50.0},
        "plain": {"tokens": 100, "seconds": 1.8, "tokens_per_s": 55.6},
        "ratio": ratio,
        "setting": "model models/SmolLM2-135M-Instruct | hotpot_qa",
        "hit_rate_turns_2_n": hit,
    }
    return {
        "data": data,
        "command": ".venvs/train/bin/python -m bench.generation --task hotpot_qa",
        "wall_s": 60.0,
        "tree_peak_rss_mib": 900,
        "date": date,
        "outputs": "runs/bench/x",
        "load_before": "1.00 1.00 1.00",
        "load_after": "2.00 2.00 2.00",
    }


def test_each_run_rewrites_the_headline_from_the_merged_results(tmp_path, monkeypatch):
    monkeypatch.setattr(run_all, "BENCHMARKS", {"generation": [], "generation_ie": []})
    stored, out = tmp_path / "results.json", tmp_path / "RESULTS.md"
    machine = {"cores (usable)": "2"}
    old = {"generation": generation_result("2026-11-30 09:14", 0.92, 0.5)}
    old["generation_ie"] = generation_result("2026-11-30 09:20", 0.797, 0.757)
    run_all.merge_results(stored, old, machine)
    out.write_text("old headline\n\n" + run_all.KEPT_MARKER + "\n\n## By hand\n")
    new = {"generation_ie": generation_result("2026-12-02 07:00", 0.97, 0.88)}
    merged = run_all.merge_results(stored, new, machine)
    run_all.write_results(out, report.render_results(merged["results"], merged["meta"]))
    text = out.read_text()
    headline = text.split("## Targets")[1].split("\n## ")[0]
    assert "(ratio 0.970, hit rate 0.88) (run 2026-12-02 07:00" in headline and "0.797" not in text
    assert "(0.920; one pass each side" in headline and "(run 2026-11-30 09:14" in headline  # kept, with its date
    assert "old headline" not in text and text.endswith(run_all.KEPT_MARKER + "\n\n## By hand\n")
    assert json.loads(stored.read_text())["results"]["generation_ie"]["data"]["ratio"] == 0.97


def test_a_partial_run_without_stored_results_of_the_others_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(run_all, "BENCHMARKS", {"generation": [], "sft": []})
    with pytest.raises(SystemExit, match=r"has no results of \['sft'\]"):
        run_all.merge_results(tmp_path / "results.json", {"generation": generation_result("d", 1, 1)}, {})


def test_results_md_names_no_absolute_path():
    text = (BENCH / "RESULTS.md").read_text()
    assert "/work/" not in text and "/tmp/" not in text and str(REPO) not in text
