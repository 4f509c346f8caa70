"""Where dataset rows come from: a local folder, or the Hugging Face hub.

The data root is resolved as:
the `data_dir` argument, else the environment variable `OPTIMA_DATA_DIR`, else the hub. A local root holds one
folder per dataset (`gsm8k/`, `math/`, `mmlu/`, `arc_challenge/`, `hotpotqa/`, `2wikimultihopqa/`, `triviaqa/`,
`cbt/CN/`, ...). A split is read from the first of these layouts that the folder has:

1. `<split>.jsonl` (or `<split>.<anything>.jsonl` files, read in name order), rows in the dataset's own schema;
2. `<split>.json`, one JSON array of rows (the 2WikiMultiHopQA release's `train.json` / `dev.json`);
3. a folder `<split>/<group>/<name>.json` of one JSON object per file (the MATH release: `train/algebra/1.json`);
   each row gets the id `<split>/<group>/<name>`;
4. a downloaded copy of the hub repository (`huggingface-cli download <repo> --repo-type dataset --local-dir
   <folder>`): a `README.md` whose YAML header lists `configs:` and their parquet/JSON files, found in the
   dataset's folder or a parent inside the root (`cbt/` for `cbt/CN/`). It is read through
   `datasets.load_dataset(<folder>, <config>, split=...)`, the same call as the hub path, so no network is used.

`datasets` is imported only for the hub and hub-copy layouts, so the task layer imports without it. Every failure
to find a split raises one `DataError` that names the path, the layouts that were expected and how to convert.
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


CONVERT_HINT = (
    'convert other files to JSON Lines, e.g. python -c "import json,sys; '
    '[print(json.dumps(r)) for r in json.load(open(sys.argv[1]))]" train.json > train.jsonl'
)


def find_split_files(folder: Path, split: str) -> list[Path]:
    """Return the files of `split` in `folder`: `<split>.jsonl`, else all `<split>.*.jsonl`, else `<split>.json`.

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
    if (folder / f"{split}.json").is_file():
        return [folder / f"{split}.json"]
    present = sorted(path.name for path in folder.iterdir())
    raise DataError(
        f"split {split!r} not found in {folder}: expected {exact}, files matching {pattern}, {split}.json (a JSON "
        f"array), a folder {split}/<group>/*.json, or a downloaded hub copy (README.md with configs); "
        f"the folder holds: {', '.join(present) or 'nothing'}; {CONVERT_HINT}"
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


def read_json_array(path: Path) -> list[dict]:
    """Rows of a file holding one JSON array of objects (or one object, for a per-problem file).

    Raises:
        DataError: the file is not JSON, or holds something other than objects.
    """
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
    """Read every row of `split` from a local dataset folder (JSONL, JSON array, or per-problem files).

    Args:
        folder: the dataset's local folder (data root / the task's local folder).
        split: the split name.
    """
    if (folder / split).is_dir():
        rows = read_problem_folder(folder / split, split)
    else:
        rows = []
        for path in find_split_files(folder, split):
            rows.extend(read_json_array(path) if path.suffix == ".json" else read_jsonl(path))
    logger.debug("read %d rows of split %s from %s", len(rows), split, folder)
    return rows


def find_hub_copy(root: Path, local_folder: str) -> Path | None:
    """The folder of a downloaded hub repository for `local_folder` under `root` (itself or a parent), if any.

    A hub copy is recognised by its dataset card: a `README.md` whose YAML header has a `configs:` list.
    """
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
    """Rows of `split` from the local root: the task folder's own files, else a downloaded hub copy.

    Args:
        root: the local data root.
        local_folder: the task's folder under the root (e.g. `gsm8k`, `cbt/CN`).
        hub_configs: the hub configs to read from a hub copy.
        split: the split name.
    """
    folder = root / local_folder
    try:
        return read_local_rows(folder, split)
    except DataError:
        hub_copy = find_hub_copy(root, local_folder)
        if hub_copy is None:
            raise
    return read_hub_rows(str(hub_copy), hub_configs, split)


def split_sources(root: Path, local_folder: str, split: str) -> list[Path]:
    """The files that ``read_split`` reads `split` from (the task folder's own, else every file of a hub copy).

    Args:
        root: the local data root.
        local_folder: the task's folder under the root.
        split: the split name.

    Raises:
        DataError: when the split is not there (the message of ``find_split_files``).
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
