"""What a model is, independent of where it lies: a unique weights id for every checkpoint Optima writes.

A checkpoint's path says where its files are, not which weights they hold: a training stage redone in place
writes other weights under the same path. Every checkpoint that a trainer script finishes therefore gets a
random ``weights_id`` in its completion marker (``optima_complete.json``), and everything that must know *which*
weights produced something (a served endpoint, a result file's fingerprint, a stage's identity) asks
``model_identity`` instead of comparing paths.

For a folder without a marker (a base model, a converted GGUF) the identity is a hash of its whole content: every
file's name, size and bytes, streamed (``file_digest``), so a LoRA merge re-saved in place or an edited
``generation_config.json`` of the same size is another model. File hashes are cached in the process by (path, size,
mtime_ns, inode): a model hashed once is not read again while its files stay unchanged. A hub name that is not a local
folder is its own identity. Standard library only: the orchestrator and the trainer scripts both use it.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

COMPLETE_MARKER = "optima_complete.json"
WEIGHTS_ID_KEY = "weights_id"
CHUNK_BYTES = 1 << 22  # read size of the streamed file hash
# (resolved path, inode, size, mtime_ns, ctime_ns) -> sha256 hex of the file's bytes
_FILE_HASHES: dict[tuple[str, int, int, int, int], str] = {}


def digest(payload) -> str:
    """A short stable hash of a JSON-able value (stage keys, result fingerprints)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def new_weights_id() -> str:
    """A fresh unique id for weights that were just written."""
    return uuid.uuid4().hex


def file_digest(path: Path) -> str:
    """The sha256 hex digest of a file's bytes, streamed; cached while its inode, size and times stay the same."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if key not in _FILE_HASHES:
        hasher = hashlib.sha256()
        with path.open("rb") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                hasher.update(chunk)
        _FILE_HASHES[key] = hasher.hexdigest()
    return _FILE_HASHES[key]


def folder_hash(folder: Path) -> str:
    """Identity of a model folder that has no completion marker (see the module docstring)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue  # caches and lock files of the hub client
        digest.update(f"{rel}\0{path.stat().st_size}\0{file_digest(path)}\0".encode())
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
