"""Where dataset rows come from: a local folder of JSONL files, or the Hugging Face hub.

The original read every dataset from the hub (or a hard-coded local path). Here the data root is resolved as:
the `data_dir` argument, else the environment variable `OPTIMA_DATA_DIR`, else the hub. A local root holds one
folder per dataset (`gsm8k/`, `math/`, `mmlu/`, `arc_challenge/`, `hotpotqa/`, `2wikimultihopqa/`, `triviaqa/`,
`cbt/CN/`, ...) with one `<split>.jsonl` per split (or `<split>.<anything>.jsonl` files, read in name order), rows
in the dataset's own schema. `datasets` is imported only on the hub path, so the task layer imports without it.
Every failure to find a split raises one `DataError` that names the path and the files that were expected.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

DATA_DIR_ENV = "OPTIMA_DATA_DIR"


class DataError(Exception):
    """A dataset split could not be found or read; the message names the path and the expected files."""


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    """Return the local data root: `data_dir`, else `$OPTIMA_DATA_DIR`, else None (load from the hub).

    Args:
        data_dir: an explicit root folder, or None.
    """
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir)
    env_value = os.environ.get(DATA_DIR_ENV, "")
    return Path(env_value) if env_value else None


def split_patterns(split: str) -> tuple[str, str]:
    """The file names that hold `split` in a local dataset folder, in order of preference.

    Args:
        split: the split name, e.g. "train", "validation", "auxiliary_train".
    """
    return f"{split}.jsonl", f"{split}.*.jsonl"


def find_split_files(folder: Path, split: str) -> list[Path]:
    """Return the JSONL files of `split` in `folder`: `<split>.jsonl`, else all `<split>.*.jsonl` in name order.

    Args:
        folder: the dataset's local folder.
        split: the split name.

    Raises:
        DataError: when the folder or the split is missing.
    """
    exact, pattern = split_patterns(split)
    if not folder.is_dir():
        raise DataError(f"dataset folder {folder} does not exist; expected it to contain {exact} (or {pattern})")
    if (folder / exact).is_file():
        return [folder / exact]
    matches = sorted(path for path in folder.glob(pattern) if path.is_file())
    if matches:
        return matches
    present = sorted(path.name for path in folder.iterdir())
    raise DataError(
        f"split {split!r} not found in {folder}: expected {exact} or files matching {pattern}; "
        f"the folder holds: {', '.join(present) or 'nothing'}"
    )


def read_jsonl(path: Path) -> Iterator[dict]:
    """Yield the JSON objects of a JSONL file, one per non-blank line.

    Args:
        path: the file.

    Raises:
        DataError: on a line that is not a JSON object.
    """
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{line_number}: not valid JSON ({error})") from error
            if not isinstance(row, dict):
                raise DataError(f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}")
            yield row


def read_local_rows(folder: Path, split: str) -> list[dict]:
    """Read every row of `split` from a local dataset folder.

    Args:
        folder: the dataset's local folder (data root / the task's local folder).
        split: the split name.
    """
    rows: list[dict] = []
    for path in find_split_files(folder, split):
        rows.extend(read_jsonl(path))
    logger.debug("read %d rows of split %s from %s", len(rows), split, folder)
    return rows


def read_hub_rows(hub_name: str | None, hub_configs: Sequence[str | None], split: str) -> list[dict]:
    """Load `split` of a hub dataset (all listed configs, concatenated) with `datasets.load_dataset`.

    Args:
        hub_name: the hub repository, e.g. "openai/gsm8k"; None when the dataset is only available locally.
        hub_configs: config names to load and concatenate (one entry of None for the default config).
        split: the split name.

    Raises:
        DataError: when there is no hub copy, `datasets` is missing, or the hub load fails.
    """
    if hub_name is None:
        raise DataError(
            f"this dataset has no hub copy; set {DATA_DIR_ENV} (or pass data_dir) to a folder of JSONL files"
        )
    try:
        import datasets  # lazy: the hub path is the only one that needs it
    except ImportError as error:
        raise DataError(
            f"loading {hub_name} from the hub needs the `datasets` package, or set {DATA_DIR_ENV}"
        ) from error
    rows: list[dict] = []
    for config in hub_configs:
        try:
            dataset = datasets.load_dataset(hub_name, config, split=split)
        except (OSError, ValueError, ConnectionError) as error:
            raise DataError(
                f"could not load split {split!r} of {hub_name} (config {config}) from the hub: {error}; "
                f"set {DATA_DIR_ENV} to use local JSONL files instead"
            ) from error
        rows.extend(dict(row) for row in dataset)
    logger.info("loaded %d rows of %s split %s from the hub", len(rows), hub_name, split)
    return rows
