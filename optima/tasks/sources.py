"""Where dataset rows come from: a local folder (`data_dir`, else `$OPTIMA_DATA_DIR`), else the Hugging Face hub.

A local root holds one folder per dataset (`gsm8k/`, `hotpotqa/`, `cbt/CN/`, ...). A split is the first of:
`<split>.jsonl` (or every `<split>.*.jsonl`, in name order); `<split>.json`, one JSON array; a folder
`<split>/<group>/<name>.json` of one problem per file (the MATH release); a downloaded copy of the hub repository
(a `README.md` listing `configs:`, here or in a parent folder), read with `datasets.load_dataset` offline. A
missing split raises one `DataError` naming the path and the layouts expected.
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
    """The local data root: `data_dir`, else `$OPTIMA_DATA_DIR`, else None (the hub)."""
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir)
    env_value = os.environ.get(DATA_DIR_ENV, "")
    return Path(env_value) if env_value else None


def split_patterns(split: str) -> tuple[str, str]:
    """The file names that hold `split` in a dataset folder, in order of preference."""
    return f"{split}.jsonl", f"{split}.*.jsonl"


CONVERT_HINT = (
    'convert other files to JSON Lines, e.g. python -c "import json,sys; '
    '[print(json.dumps(r)) for r in json.load(open(sys.argv[1]))]" train.json > train.jsonl'
)


def find_split_files(folder: Path, split: str) -> list[Path]:
    """The files of `split` in `folder`: `<split>.jsonl`, else all `<split>.*.jsonl`, else `<split>.json`.

    Raises:
        DataError: the folder or the split is missing.
    """
    exact, pattern = split_patterns(split)
    if not folder.is_dir():
        raise DataError(f"dataset folder {folder} does not exist; expected it to contain {exact} (or {pattern})")
    if (folder / exact).is_file():
        return [folder / exact]
    matches = sorted(path for path in folder.glob(pattern) if path.is_file())
    if matches:
        return matches
    if (folder / f"{split}.json").is_file():
        return [folder / f"{split}.json"]
    present = sorted(path.name for path in folder.iterdir())
    raise DataError(
        f"split {split!r} not found in {folder}: expected {exact}, files matching {pattern}, {split}.json (a JSON "
        f"array), a folder {split}/<group>/*.json, or a downloaded hub copy (README.md with configs); "
        f"the folder holds: {', '.join(present) or 'nothing'}; {CONVERT_HINT}"
    )


def read_jsonl(path: Path) -> Iterator[dict]:
    """The JSON object of each non-blank line (`DataError` for a line that is not one)."""
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


def read_json_array(path: Path) -> list[dict]:
    """The rows of a file holding one JSON array of objects (or one object: a per-problem file)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: not valid JSON ({error}); {CONVERT_HINT}") from error
    rows = [data] if isinstance(data, dict) else data
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise DataError(f"{path}: expected a JSON array of objects; {CONVERT_HINT}")
    return rows


def read_problem_folder(folder: Path, split: str) -> list[dict]:
    """Rows of a `<split>/<group>/<name>.json` folder (one problem per file), in group then numeric name order."""

    def order(path: Path) -> tuple:
        return (path.parent.name, int(path.stem) if path.stem.isdigit() else 0, path.stem)

    files = sorted(folder.glob("*/*.json"), key=order)
    if not files:
        raise DataError(f"{folder}: expected one JSON file per problem under {folder}/<group>/, found none")
    return [read_json_array(path)[0] | {"id": f"{split}/{path.parent.name}/{path.stem}"} for path in files]


def read_local_rows(folder: Path, split: str) -> list[dict]:
    """Every row of `split` in a dataset folder (JSONL, a JSON array, or per-problem files)."""
    if (folder / split).is_dir():
        rows = read_problem_folder(folder / split, split)
    else:
        rows = []
        for path in find_split_files(folder, split):
            rows.extend(read_json_array(path) if path.suffix == ".json" else read_jsonl(path))
    logger.debug("read %d rows of split %s from %s", len(rows), split, folder)
    return rows


def find_hub_copy(root: Path, local_folder: str) -> Path | None:
    """The downloaded hub repository for `local_folder` (it or a parent under `root`, whose `README.md` header
    lists `configs:`), or None."""
    candidate = root / local_folder
    while candidate != root and root in candidate.parents:
        card = candidate / "README.md"
        if card.is_file() and _card_lists_configs(card):
            return candidate
        candidate = candidate.parent
    return None


def _card_lists_configs(card: Path) -> bool:
    text = card.read_text(encoding="utf-8", errors="replace")
    header = text.split("---", 2)[1] if text.startswith("---") and text.count("---") >= 2 else ""
    return any(line.startswith("configs:") for line in header.splitlines())


def read_split(root: Path, local_folder: str, hub_configs: Sequence[str | None], split: str) -> list[dict]:
    """The rows of `split` under `root`: the task folder's own files, else a downloaded hub copy's `hub_configs`."""
    folder = root / local_folder
    try:
        return read_local_rows(folder, split)
    except DataError:
        hub_copy = find_hub_copy(root, local_folder)
        if hub_copy is None:
            raise
    return read_hub_rows(str(hub_copy), hub_configs, split)


def split_sources(root: Path, local_folder: str, split: str) -> list[Path]:
    """The files `read_split` reads `split` from (the task folder's own, else every file of a hub copy).

    Raises:
        DataError: the split is not there.
    """
    folder = root / local_folder
    if (folder / split).is_dir():
        return sorted((folder / split).glob("*/*.json"))
    try:
        return find_split_files(folder, split)
    except DataError:
        hub_copy = find_hub_copy(root, local_folder)
        if hub_copy is None:
            raise
    files = (path for path in sorted(hub_copy.rglob("*")) if path.is_file())
    return [path for path in files if not any(part.startswith(".") for part in path.relative_to(hub_copy).parts)]


def read_hub_rows(hub_name: str | None, hub_configs: Sequence[str | None], split: str) -> list[dict]:
    """`split` of every config of a hub dataset, concatenated (`datasets.load_dataset`).

    Raises:
        DataError: no hub copy (`hub_name` None), no `datasets`, or the load failed.
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
