"""bench/ sits on top of Optima: a package run as ``python -m bench.<name>``, without ``sys.path`` edits, using only
public names of Optima's modules; what it writes (bench/RESULTS.md) names repository paths and is rewritten whole."""

from __future__ import annotations

import ast
import importlib
import importlib.util
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


def bad_import(module: str, names: list[str]) -> str | None:
    """Why an import of optima's is not a public name of a module (None when it is one): the module imports, has
    each name, and no name is private (a leading ``_``); ``from optima import x`` names a module."""
    try:
        target = importlib.import_module(module)
    except ImportError as error:
        return f"{module} does not import ({error})"
    hidden = [name for name in names if name.startswith("_")]
    if hidden:
        return f"{hidden} are private to {module}"
    missing = [name for name in names if not hasattr(target, name) and not is_submodule(target, name)]
    return f"{module} has no {missing}" if missing else None


def is_submodule(package, name: str) -> bool:
    """Whether ``name`` is a module of ``package`` (``from optima import paths``)."""
    return hasattr(package, "__path__") and importlib.util.find_spec(f"{package.__name__}.{name}") is not None


def test_the_import_rule_sees_a_private_a_missing_and_an_unknown_name():
    assert bad_import("optima.paths", ["_private"]) == "['_private'] are private to optima.paths"
    assert bad_import("optima.serving.client", ["NoSuchClient"]) == "optima.serving.client has no ['NoSuchClient']"
    assert bad_import("optima.no_such_module", []).startswith("optima.no_such_module does not import")
    assert bad_import("optima.paths", ["RunPaths"]) is None and bad_import("optima", ["paths", "serving"]) is None
    assert bad_import("optima", ["no_such_module"]) == "optima has no ['no_such_module']"


@pytest.mark.parametrize("folder", ["bench", "dev"])
def test_bench_and_dev_import_only_public_names_of_optima(folder):
    """They sit above every layer (docs/layers.md) and may use any module, through its public names only."""
    offenders = []
    for path in sorted((REPO / folder).glob("*.py")):
        for line, module, names in optima_imports(path):
            if reason := bad_import(module, names):
                offenders.append(f"{folder}/{path.name}:{line}: {reason}")
    assert not offenders, "\n".join(offenders)


def test_every_exported_name_resolves():
    """A package that still lists its names (``__all__``, lazy or not) points at modules and names that exist."""
    for init in sorted(OPTIMA.rglob("__init__.py")):
        package = ".".join(init.parent.relative_to(REPO).parts)
        module = importlib.import_module(package)
        missing = [name for name in getattr(module, "__all__", []) if not hasattr(module, name)]
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
