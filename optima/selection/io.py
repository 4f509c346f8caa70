"""Saving selected training data: a ``datasets`` folder (``save_to_disk``) plus a JSONL record of decisions."""

from __future__ import annotations

import shutil
from pathlib import Path

from optima.store import write_jsonl

__all__ = ["save_splits", "write_jsonl"]


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
