"""The run's files: append-only JSONL that a killed run resumes, and atomic whole-file writes.

The open-r1 pattern (resume by skipping ids already written), hardened (docs/method.md D4, D5): one line per
conversation keyed by `(task_id, sample_index)`, flushed line by line under a lock. On reopening, a torn last line
is cut off, failed records (`status: error`) are dropped to be tried again, and any other damage raises naming the
file and line. Every whole-file write goes through a temporary file and an atomic rename.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)

Key = tuple[str, int]


def record_key(record: dict) -> Key:
    """`(task_id, sample_index)` of a conversation record."""
    return str(record["task_id"]), int(record["sample_index"])


def load_records(path: Path) -> tuple[list[dict], bool]:
    """A JSONL file's records, and whether its last line was torn (and left out); `ValueError` for another bad line."""
    if not path.exists():
        return [], False
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    # A complete file ends with "\n", so the last piece is empty; anything else there was cut mid-write.
    torn = lines[-1] != b""
    records = []
    for number, line in enumerate(lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not a JSON line ({exc}); fix or delete the file") from exc
    return records, torn


def group_by_question(records: Sequence[dict]) -> list[list[dict]]:
    """Conversations grouped by `task_id` (first-seen order), each group sorted by sample index."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(str(record["task_id"]), []).append(record)
    return [sorted(group, key=lambda r: r["sample_index"]) for group in groups.values()]


def prepare_resume(path: Path, retry_errors: bool = True, key: Callable[[dict], Hashable] = record_key) -> set:
    """Make `path` ready to append to; return the keys already done (`key`: per-question files pass their own;
    `retry_errors`: drop failed records so that they are generated again)."""
    records, torn = load_records(path)
    keep = [r for r in records if not (retry_errors and r.get("status") == "error")]
    dropped_errors = len(records) - len(keep)
    seen: set = set()
    unique = []
    for record in keep:
        record_id = key(record)
        if record_id not in seen:
            seen.add(record_id)
            unique.append(record)
    if torn or len(unique) != len(records):
        logger.warning(
            "%s: resuming; cut a torn last line: %s, dropped %d error and %d duplicate records",
            path,
            torn,
            dropped_errors,
            len(keep) - len(unique),
        )
        write_jsonl(unique, path)
    elif records:
        logger.info("%s: resuming; %d conversations already written", path, len(records))
    return seen


def atomic_write_text(path: Path, text: str) -> Path:
    """Replace `path` with `text` (UTF-8) through a temporary file and a rename; create its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def write_json(path: Path, payload: Any, indent: int | None = 2) -> Path:
    """Write `payload` as JSON (non-JSON values as `str`), atomically."""
    return atomic_write_text(path, json.dumps(payload, indent=indent, ensure_ascii=False, default=str) + "\n")


def write_jsonl(records: Iterable[dict], path: Path) -> Path:
    """Write `records` one per line, atomically (a rerun replaces the file, never appends)."""
    return atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def write_yaml(path: Path, data: Any) -> Path:
    """Write `data` as YAML (keys in their order), atomically."""
    return atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))


def save_splits(splits: dict[str, list[dict]], path: Path) -> dict[str, int]:
    """Save `{"train": rows, "test": rows}` as a `DatasetDict` at `path`, atomically; return the row counts.

    Empty splits are left out (`datasets` cannot load an empty split back).
    """
    from datasets import Dataset, DatasetDict

    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    DatasetDict({name: Dataset.from_list(rows) for name, rows in splits.items() if rows}).save_to_disk(str(tmp))
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return {name: len(rows) for name, rows in splits.items()}


class JsonlWriter:
    """Thread-safe appender to a JSONL file (created with its folder): one complete line per `write`, flushed."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
