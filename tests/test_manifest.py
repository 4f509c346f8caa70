"""Stage manifests: finished stages are skipped, a changed key (fields or inputs) redoes a stage and the later ones,
finished or not, and their outputs are set aside, never deleted."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from optima.lineage import Manifest, StageKey, fields_hash

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


def aside(folder, stage: str) -> list:
    """The ``set_aside/<stage>-<key>-<time>/`` folders of ``folder``."""
    return sorted((folder / "set_aside").glob(f"{stage}-*"))


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
    (select,), (train,) = aside(tmp_path, "select"), aside(tmp_path, "train")
    assert (select / "select.out").read_text() == "x" and (train / "train.out").read_text() == "x"  # never deleted
    why = json.loads((select / "why.json").read_text())
    assert why["entry"]["config_hash"] == "h" and why["reasons"] == ["recipe fields"]


def test_redone_samples_are_moved_aside_not_deleted(tmp_path):
    out = tmp_path / "generations.jsonl"
    out.write_text("old\n")
    Manifest(tmp_path / "manifest.json", hashes()).run("generate", lambda: {})
    changed = Manifest(tmp_path / "manifest.json", hashes(generate="other"))
    assert changed.invalidate_changed(ORDER, {"generate": [out]}) == ORDER
    (folder,) = aside(tmp_path, "generate")
    assert not out.exists() and (folder / "generations.jsonl").read_text() == "old\n"
    assert folder.name.startswith("generate-h-")  # the old key is in the name


def killed(manifest: Manifest, stage: str, out, rows: str) -> None:
    """Run ``stage`` until it has written ``rows`` to ``out``, then die as a kill would."""

    def body():
        out.write_text(rows)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        manifest.run(stage, body)


def test_a_stage_records_its_key_when_it_starts(tmp_path):
    manifest = Manifest(tmp_path / "manifest.json", hashes())
    killed(manifest, "generate", tmp_path / "g.jsonl", "row at 0.3\n")
    entry = json.loads((tmp_path / "manifest.json").read_text())["stages"]["generate"]
    assert entry["config_hash"] == "h" and "started_at" in entry and "result" not in entry
    again = Manifest(tmp_path / "manifest.json", hashes())
    assert not again.done("generate") and again.finished() == [] and again.timings() == {}


def test_a_stage_killed_half_way_resumes_only_under_the_same_key(tmp_path):
    out = tmp_path / "generations.jsonl"
    killed(Manifest(tmp_path / "manifest.json", hashes(generate="t0.3")), "generate", out, "row at 0.3\n")
    same = Manifest(tmp_path / "manifest.json", hashes(generate="t0.3"))
    assert same.invalidate_changed(ORDER, {"generate": [out]}) == [] and out.exists()  # continues its rows
    changed = Manifest(tmp_path / "manifest.json", hashes(generate="t1.0"))
    assert changed.invalidate_changed(ORDER, {"generate": [out]}) == ORDER
    assert not out.exists()  # the rerun starts from an empty file: no row of the old temperature is continued
    (folder,) = aside(tmp_path, "generate")
    assert folder.name.startswith("generate-t0.3-") and (folder / "generations.jsonl").read_text() == "row at 0.3\n"


def test_outputs_without_a_recorded_key_are_set_aside(tmp_path):
    """Rows of a stage that never recorded a key (a manifest of an older version) cannot be told apart: redone."""
    out = tmp_path / "rewarded.jsonl"
    out.write_text("row\n")
    Manifest(tmp_path / "manifest.json", hashes()).run("generate", lambda: {})
    manifest = Manifest(tmp_path / "manifest.json", hashes())
    assert manifest.invalidate_changed(ORDER, {"score": [out]}, [tmp_path / "metrics.json"]) == ORDER[1:]
    assert manifest.done("generate") and not out.exists() and aside(tmp_path, "score-nokey")


def test_the_part_summary_goes_aside_with_the_first_redone_stage(tmp_path):
    metrics = tmp_path / "metrics.json"
    metrics.write_text('{"stages": {"select": {"kept": 3}}}')
    Manifest(tmp_path / "manifest.json", hashes()).run("select", lambda: {})
    changed = Manifest(tmp_path / "manifest.json", hashes(select="other"))
    changed.invalidate_changed(ORDER, {}, [metrics])
    assert not metrics.exists() and (aside(tmp_path, "select")[0] / "metrics.json").is_file()


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
