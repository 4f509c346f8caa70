"""What a model is, independent of where it lies: a unique weights id for every checkpoint Optima writes.

A checkpoint's path says where its files are, not which weights they hold: a training stage redone in place
writes other weights under the same path. Every checkpoint that a trainer script finishes therefore gets a
random ``weights_id`` in its completion marker (``optima_complete.json``), and everything that must know *which*
weights produced something (a served endpoint, a result file's fingerprint, a stage's identity) asks
``model_identity`` instead of comparing paths.

For a folder without a marker (a base model, a converted GGUF) the identity is a hash of what decides its
weights without reading them whole: every file's name and size, ``config.json``, and each weight file's first
MiB (a safetensors file starts with its header: names, dtypes, shapes, offsets). A hub name that is not a local
folder is its own identity. Standard library only: the orchestrator and the trainer scripts both use it.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

COMPLETE_MARKER = "optima_complete.json"
WEIGHTS_ID_KEY = "weights_id"
HEAD_BYTES = 1 << 20  # how much of each weight file enters a marker-less folder's hash
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def digest(payload) -> str:
    """A short stable hash of a JSON-able value (stage keys, result fingerprints)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def new_weights_id() -> str:
    """A fresh unique id for weights that were just written."""
    return uuid.uuid4().hex


def folder_hash(folder: Path) -> str:
    """Identity of a model folder that has no completion marker (see the module docstring)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue  # caches and lock files of the hub client
        digest.update(f"{rel}\0{path.stat().st_size}\0".encode())
        if rel == "config.json" or path.suffix in WEIGHT_SUFFIXES:
            with path.open("rb") as handle:
                digest.update(handle.read(HEAD_BYTES))
    return "sha256:" + digest.hexdigest()[:32]


def read_marker(folder: str | Path) -> dict | None:
    """The completion marker a trainer script wrote into ``folder`` (metrics, weights id, probe); None if absent."""
    marker = Path(folder) / COMPLETE_MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def model_identity(model: str | Path) -> str:
    """The unique id of the weights behind ``model`` (a checkpoint or model folder, or a hub name).

    Args:
        model: A local folder, or a hub name that is not a local folder.

    Returns:
        The ``weights_id`` from the folder's completion marker; else a hash of the folder; else the name itself.
    """
    folder = Path(model)
    if not folder.is_dir():
        return str(model)
    weights_id = (read_marker(folder) or {}).get(WEIGHTS_ID_KEY)
    return str(weights_id) if weights_id else folder_hash(folder)
