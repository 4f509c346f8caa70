"""Stage manifests: finished stages are skipped, a changed key (fields or inputs) redoes a stage and the later ones."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from optima.manifest import Manifest, StageKey, fields_hash

ORDER = ["generate", "score", "select", "train"]


def hashes(**values):
    return {stage: values.get(stage, "h") for stage in ORDER}


def test_finished_stages_are_skipped_and_results_reused(tmp_path):
    calls = []
    manifest = Manifest(tmp_path / "manifest.json", hashes())
    assert manifest.run("generate", lambda: calls.append(1) or {"n": 3}) == {"n": 3}
    again = Manifest(tmp_path / "manifest.json", hashes())
    assert again.run("generate", lambda: calls.append(2) or {"n": 9}) == {"n": 3}
    assert calls == [1]
    saved = json.loads((tmp_path / "manifest.json").read_text())["stages"]["generate"]
    assert saved["result"] == {"n": 3} and saved["config_hash"] == "h" and saved["elapsed_s"] >= 0


def test_a_failed_stage_is_not_recorded(tmp_path):
    manifest = Manifest(tmp_path / "manifest.json", hashes())

    def boom():
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        manifest.run("score", boom)
    assert not Manifest(tmp_path / "manifest.json", hashes()).done("score")


def test_changed_fields_redo_the_stage_and_later_ones(tmp_path):
    outputs = {stage: [tmp_path / f"{stage}.out"] for stage in ORDER}
    manifest = Manifest(tmp_path / "manifest.json", hashes())
    for stage in ORDER:
        outputs[stage][0].write_text("x")
        manifest.run(stage, lambda: {})
    changed = Manifest(tmp_path / "manifest.json", hashes(select="new"))
    changed.invalidate_changed(ORDER, outputs)
    assert [s for s in ORDER if changed.done(s)] == ["generate", "score"]
    assert outputs["score"][0].exists() and not outputs["select"][0].exists() and not outputs["train"][0].exists()


def test_redone_samples_are_moved_aside_not_deleted(tmp_path):
    out = tmp_path / "generations.jsonl"
    out.write_text("old\n")
    Manifest(tmp_path / "manifest.json", hashes()).run("generate", lambda: {})
    changed = Manifest(tmp_path / "manifest.json", hashes(generate="other"))
    assert changed.invalidate_changed(ORDER, {"generate": [out]}, keep=("generate",)) == ORDER
    assert not out.exists() and (tmp_path / "generations.jsonl.replaced-1").read_text() == "old\n"


def key(model: str, epsilon: float = 0.5) -> StageKey:
    return StageKey(f"h{epsilon}", {"initial_epsilon": epsilon}, {"served model": model})


def test_the_warning_names_what_changed(tmp_path, caplog):
    Manifest(tmp_path / "manifest.json", {"select": key("w1")}).run("select", lambda: {})
    changed = Manifest(tmp_path / "manifest.json", {"select": key("w2", 0.7)})
    with caplog.at_level("WARNING"):
        assert changed.invalidate_changed(["select"], {}) == ["select"]
    assert "initial_epsilon: 0.5 -> 0.7" in caplog.text and "served model: w1 -> w2" in caplog.text


def test_entries_without_inputs_are_judged_by_their_fields_and_upgraded(tmp_path):
    Manifest(tmp_path / "manifest.json", {"select": "h0.5"}).run("select", lambda: {"n": 1})
    upgraded = Manifest(tmp_path / "manifest.json", {"select": key("w1")})
    assert upgraded.invalidate_changed(["select"], {}) == [] and upgraded.result("select") == {"n": 1}
    assert json.loads((tmp_path / "manifest.json").read_text())["stages"]["select"]["inputs"] == {"served model": "w1"}
    assert Manifest(tmp_path / "manifest.json", {"select": key("w2")}).invalidate_changed(["select"], {}) == ["select"]


def test_fields_hash_depends_only_on_named_fields():
    a = SimpleNamespace(lambda1=-0.5, seed=1)
    b = SimpleNamespace(lambda1=-0.5, seed=2)
    assert fields_hash(a, ("lambda1",)) == fields_hash(b, ("lambda1",))
    assert fields_hash(a, ("lambda1", "seed")) != fields_hash(b, ("lambda1", "seed"))
