"""Model identity: a checkpoint's weights id, a marker-less folder's hash, a hub name (optima/identity.py)."""

from __future__ import annotations

import json

from optima.identity import COMPLETE_MARKER, model_identity, new_weights_id


def write_model(folder, weights: bytes = b"\x00" * 64):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 16}))
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def test_marker_weights_id_wins_and_changes_when_redone(tmp_path):
    folder = write_model(tmp_path / "ckpt")
    first, second = new_weights_id(), new_weights_id()
    assert first != second
    (folder / COMPLETE_MARKER).write_text(json.dumps({"weights_id": first}))
    assert model_identity(folder) == first
    (folder / COMPLETE_MARKER).write_text(json.dumps({"weights_id": second}))  # the stage redone in place
    assert model_identity(folder) == second


def test_folder_without_marker_hashes_its_weights(tmp_path):
    a = model_identity(write_model(tmp_path / "a"))
    assert a.startswith("sha256:")
    assert model_identity(write_model(tmp_path / "b")) == a  # same files elsewhere: same identity
    assert model_identity(write_model(tmp_path / "c", b"\x01" * 64)) != a
    assert model_identity(tmp_path / "a") == a  # stable


def test_marker_without_id_falls_back_to_the_hash(tmp_path):
    folder = write_model(tmp_path / "old")
    (folder / COMPLETE_MARKER).write_text(json.dumps({"train_rows": 3}))
    assert model_identity(folder).startswith("sha256:")


def test_hub_name_is_its_own_identity(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert model_identity("meta-llama/Meta-Llama-3-8B-Instruct") == "meta-llama/Meta-Llama-3-8B-Instruct"


def test_the_completion_marker_has_one_reader(tmp_path):
    from optima.identity import read_marker

    assert read_marker(tmp_path) is None  # a base model: no marker
    (tmp_path / COMPLETE_MARKER).write_text('{"weights_id": "w1", "train_loss": 0.5}')
    assert read_marker(tmp_path) == {"weights_id": "w1", "train_loss": 0.5}
    assert model_identity(tmp_path) == "w1"


def test_folder_hash_covers_every_byte_of_every_file(tmp_path):
    """A change past the first MiB of a weight file, or in a same-size generation config, is another model."""
    big = bytearray(3 << 20)
    folder = write_model(tmp_path / "merged", bytes(big))
    (folder / "generation_config.json").write_text('{"temperature": 0.6}')
    before = model_identity(folder)
    big[-1] = 1  # a LoRA merge re-saved in place: same size, same header, other weights
    (folder / "model.safetensors").write_bytes(bytes(big))
    after_weights = model_identity(folder)
    (folder / "generation_config.json").write_text('{"temperature": 0.9}')
    assert len({before, after_weights, model_identity(folder)}) == 3


def test_file_hashes_are_cached_by_path_size_and_times(tmp_path, monkeypatch):
    from optima import identity

    folder = write_model(tmp_path / "m")
    first = model_identity(folder)
    reads = []
    original_open = identity.Path.open

    def recording_open(self, *args, **kwargs):
        reads.append(self)
        return original_open(self, *args, **kwargs)

    monkeypatch.setattr(identity.Path, "open", recording_open)
    assert model_identity(folder) == first and reads == []  # unchanged files are not read again
