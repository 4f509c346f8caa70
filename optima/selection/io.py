"""Saving selected training data: a ``datasets`` folder (``save_to_disk``) plus a JSONL record of decisions."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path


def save_splits(splits: dict[str, list[dict]], path: Path) -> dict[str, int]:
    """Save ``{"train": rows, "test": rows}`` as a ``DatasetDict`` at ``path`` (atomically); return row counts.

    Empty splits are left out (``datasets`` cannot load an empty split back).
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


def write_jsonl(records: Iterable[dict], path: Path) -> None:
    """Write ``records`` to ``path`` in one go (atomic rename; a rerun replaces, never appends)."""
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("w") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(path)
