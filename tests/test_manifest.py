"""Stage manifests: finished stages are skipped, changed recipe fields redo a stage and the ones after it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from optima.manifest import Manifest, StaleStageError, fields_hash

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


def test_changed_generation_settings_are_refused(tmp_path):
    Manifest(tmp_path / "manifest.json", hashes()).run("generate", lambda: {})
    changed = Manifest(tmp_path / "manifest.json", hashes(generate="other"))
    with pytest.raises(StaleStageError, match="use a new output_dir"):
        changed.invalidate_changed(ORDER, {}, refuse=("generate",))


def test_fields_hash_depends_only_on_named_fields():
    a = SimpleNamespace(lambda1=-0.5, seed=1)
    b = SimpleNamespace(lambda1=-0.5, seed=2)
    assert fields_hash(a, ("lambda1",)) == fields_hash(b, ("lambda1",))
    assert fields_hash(a, ("lambda1", "seed")) != fields_hash(b, ("lambda1", "seed"))
