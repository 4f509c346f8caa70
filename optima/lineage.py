"""A run folder holds one lineage (docs/method.md#resume, #one-lineage-per-run-folder).

Each part's ``manifest.json`` records a stage under its key (``StageKey``) when it starts and its result when it
succeeded: a rerun skips finished stages, continues an unfinished one under the same key, and moves the first stage
whose key changed and every later one to ``set_aside/<why>-<time>/``, never deleting or continuing them. The readers
(report, browser, trackers, hub, sweep) read only the current lineage (``lineage_folders``, ``lineage_checkpoints``);
``run_lock`` keeps a second run out of a folder that one is writing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from optima.identity import WEIGHTS_ID_KEY, digest, read_marker
from optima.methods import SFT
from optima.paths import RunPaths, StagePaths, find_checkpoints, stage_folders
from optima.store import write_json

logger = logging.getLogger(__name__)

SET_ASIDE = "set_aside"
LOCK_FILE = ".optima.lock"
NOT_TRAINED, UNKNOWN = "not trained", "unknown"


class FolderLocked(RuntimeError):
    """Another live run holds the folder's lock."""


def field_values(recipe: object, names: tuple[str, ...]) -> dict:
    """The JSON form of the values of ``names`` in ``recipe``."""
    return json.loads(json.dumps({name: getattr(recipe, name, None) for name in names}, default=str))


def fields_hash(recipe: object, names: tuple[str, ...]) -> str:
    """Hash of the values of ``names`` in ``recipe`` (what one stage's output depends on)."""
    return digest({name: getattr(recipe, name, None) for name in names})


@dataclass(frozen=True)
class StageKey:
    """What one stage's output depends on: ``fields_hash`` of its recipe fields, their values (to name a change) and
    the identity of each thing it reads (models, files, ``previous stage``; None: only the fields)."""

    config_hash: str
    fields: dict = field(default_factory=dict)
    inputs: dict | None = None

    @property
    def identity(self) -> str:
        """One hash of the whole key (what the next stage records as its ``previous stage``)."""
        return digest({"config_hash": self.config_hash, "inputs": self.inputs})

    def changes(self, entry: dict) -> list[str]:
        """What differs between this key and a recorded manifest entry, one phrase per change (empty: none)."""
        reasons = []
        if entry.get("config_hash") != self.config_hash:
            old = entry.get("fields")
            if old is None:
                reasons.append("recipe fields changed")
            else:
                names = sorted(n for n in set(old) | set(self.fields) if old.get(n) != self.fields.get(n))
                reasons += [f"{n}: {old.get(n)!r} -> {self.fields.get(n)!r}" for n in names] or ["recipe fields"]
        if "inputs" in entry and self.inputs is not None:
            old = entry["inputs"]
            for name in sorted(set(old) | set(self.inputs)):
                if old.get(name) != self.inputs.get(name):
                    reasons.append(f"{name}: {old.get(name)} -> {self.inputs.get(name)}")
        return reasons


STAMP = "%Y-%m-%dT%H:%M:%S"  # when a stage started and finished, in its manifest entry


class Manifest:
    """The started and finished stages of one part folder (``path``: its ``manifest.json``), under ``keys`` (a
    ``StageKey``, or a fields hash alone); ``label`` starts each stage's log line (``iteration 1/2 | ``)."""

    def __init__(self, path: Path, keys: dict[str, StageKey | str], label: str = ""):
        self.path, self.label = path, label
        self.keys = {name: key if isinstance(key, StageKey) else StageKey(key) for name, key in keys.items()}
        self.entries: dict[str, dict] = read_entries(path)

    def done(self, stage: str) -> bool:
        return "result" in self.entries.get(stage, {})

    def finished(self) -> list[str]:
        """The finished stages, in the order they ran."""
        return [name for name in self.entries if self.done(name)]

    def result(self, stage: str) -> dict:
        return self.entries[stage]["result"]

    def timings(self) -> dict[str, float]:
        return {name: self.entries[name]["elapsed_s"] for name in self.finished()}

    def _save(self) -> None:
        write_json(self.path, {"stages": self.entries})

    def _stale(self, stage: str, outputs: list[Path]) -> list[str]:
        """Why ``stage``'s recorded work (finished or not) cannot be kept; empty: it can."""
        entry = self.entries.get(stage)
        if entry is None:
            return ["its output has no recorded key"] if any(path.exists() for path in outputs) else []
        return self.keys[stage].changes(entry)

    def invalidate_changed(
        self, order: list[str], outputs: dict[str, list[Path]], part_files: list[Path] = ()
    ) -> list[str]:
        """Set aside the first stage of ``order`` whose key changed (finished or not) and every later one: their
        ``outputs`` go to ``set_aside/<stage>-<old key>-<time>/``, ``part_files`` (``metrics.json``) with the first;
        return their names."""
        upgraded = False
        for index, stage in enumerate(order):
            reasons = self._stale(stage, outputs.get(stage, []))
            if not reasons:
                entry = self.entries.get(stage)
                if entry is not None and "inputs" not in entry and self.keys[stage].inputs is not None:
                    entry |= self._key_fields(stage)  # written before inputs were recorded: take them as they are
                    upgraded = True
                continue
            later = order[index:]
            logger.warning(
                "%s: stage %s must be redone (%s); redoing %s", self.path, stage, "; ".join(reasons), ", ".join(later)
            )
            for name in later:
                old = self.entries.pop(name, None)
                why = reasons if name == stage else [f"stage {stage} before it is redone"]
                paths = [*outputs.get(name, []), *(part_files if name == stage else [])]
                old_key = ((old or {}).get("identity") or (old or {}).get("config_hash") or "nokey")[:12]
                set_aside(paths, f"{name}-{old_key}", {"stage": name, "reasons": why, "entry": old})
            self._save()
            return later
        if upgraded:
            self._save()
        return []

    def _key_fields(self, stage: str) -> dict:
        key = self.keys[stage]
        known = {"inputs": key.inputs, "identity": key.identity} if key.inputs is not None else {}
        return {"config_hash": key.config_hash, "fields": key.fields} | known

    def start(self, stage: str) -> None:
        """Record that ``stage`` starts, under its key: what it writes from now on is made under that key."""
        self.entries[stage] = self._key_fields(stage) | {"started_at": time.strftime(STAMP)}
        self._save()

    def record(self, stage: str, result: dict, elapsed_s: float) -> None:
        started = self.entries.get(stage, {}).get("started_at") or time.strftime(STAMP)
        self.entries[stage] = self._key_fields(stage) | {
            "result": result,
            "elapsed_s": round(elapsed_s, 2),
            "started_at": started,
            "finished_at": time.strftime(STAMP),
        }
        self._save()

    def run(self, stage: str, body: Callable[..., dict], *args) -> dict:
        """``body(*args)`` unless ``stage`` is finished (then its recorded result); its key is recorded before."""
        if self.done(stage):
            logger.info("%s%s | done before, skipped", self.label, stage)
            return self.result(stage)
        logger.info("%s%s", self.label, stage)
        started = time.monotonic()
        self.start(stage)
        result = body(*args)
        self.record(stage, result, time.monotonic() - started)
        return result


def set_aside(paths: Iterable[Path], label: str, note: dict | None = None) -> list[Path]:
    """Move each existing path to ``<its parent>/set_aside/<label>-<time>/<its name>`` (``label`` says why), with
    ``note`` as ``why.json`` beside it; return where they went."""
    moved = []
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for path in paths:
        if not path.exists():
            continue
        folder = path.parent / SET_ASIDE / f"{label}-{stamp}"
        target, number = folder / path.name, 1
        while target.exists():
            number += 1
            target = folder / f"{path.name}.{number}"
        folder.mkdir(parents=True, exist_ok=True)
        path.rename(target)
        if note is not None and not (folder / "why.json").exists():
            write_json(folder / "why.json", note)
        logger.warning("%s: set aside as %s", path, target.relative_to(path.parent))
        moved.append(target)
    return moved


def set_aside_beyond(paths: RunPaths, iterations: int) -> list[Path]:
    """Set aside the iteration folders, checkpoints and trainer logs of iterations ``>= iterations``."""
    stale = []
    for root in (paths.output_dir, paths.checkpoints, paths.tensorboard):
        for child in root.iterdir() if root.is_dir() else []:
            _, _, number = child.name.rpartition("iteration_")
            if child.name.endswith(f"iteration_{number}") and number.isdigit() and int(number) >= iterations:
                stale.append(child)
    note = {"why": f"iteration_times is {iterations}: these iterations are not part of this run"}
    return set_aside(sorted(stale), f"beyond-iteration_times-{iterations}", note)


def read_entries(manifest: Path) -> dict[str, dict]:
    """The stage entries of a manifest (started and finished), in the order the stages started."""
    return json.loads(manifest.read_text())["stages"] if manifest.is_file() else {}


def _continues(upstream: str | None, previous: tuple[str, dict] | None) -> bool:
    """Whether a folder whose first stage records ``upstream`` as its previous stage follows ``previous``."""
    if upstream is None:
        return True  # the first part, or one after a skipped iteration, or an entry written before inputs
    if previous is None:
        return False  # its chain starts in a folder that is not there
    where, entries = previous
    head, _, identity = upstream.rpartition("@")  # optima.loop.link: <folder>/<stage>@<identity>
    link_where, _, stage = head.rpartition("/")
    if link_where != where:
        return False
    entry = entries.get(stage)
    return entry is None or entry.get("identity") in (None, identity)  # a stage never started: nothing to compare


def lineage_folders(run_dir: Path) -> list[tuple[int, str, StagePaths]]:
    """``(iteration, part, folder)`` of the run's current lineage, in run order: a folder belongs when its first
    stage's ``previous stage`` is the last folder's stage of the same key (one without a manifest is kept)."""
    run_dir = Path(run_dir)
    found, previous = [], None
    for iteration, part, sp in stage_folders(run_dir):
        if not sp.root.is_dir():
            continue
        entries = read_entries(sp.manifest)
        first = next(iter(entries.values()), {})
        if not _continues((first.get("inputs") or {}).get("previous stage"), previous):
            logger.info("lineage | %s and later: an earlier run's, not read", sp.root)
            break
        found.append((iteration, part, sp))
        if sp.manifest.is_file():
            previous = (sp.root.relative_to(run_dir).as_posix(), entries)
    return found


def lineage_checkpoints(root: Path) -> list[tuple[str, Path]]:
    """The finished checkpoints under ``root`` a sweep evaluates; in a run's ``checkpoints``, only those a train stage
    of the current lineage started under its key and, if it finished, recorded (their ``weights_id``)."""
    root = Path(root)
    found = find_checkpoints(root)
    run_dir = root.parent
    if root.name != "checkpoints" or not any(run_dir.glob("iteration_*/**/manifest.json")):
        return found
    expected = {}
    for iteration, part, sp in lineage_folders(run_dir):
        name = RunPaths(run_dir).checkpoint(iteration, SFT if part == SFT else None).name
        if sp.manifest.is_file():
            expected[name] = _trained(sp)
        else:  # an iSFT-DPO iteration's own folder, or one written by hand: cannot tell
            expected.setdefault(name, UNKNOWN)
    kept = []
    for name, path in found:
        wanted = expected.get(name, NOT_TRAINED)
        if wanted is NOT_TRAINED or wanted not in (UNKNOWN, (read_marker(path) or {}).get(WEIGHTS_ID_KEY)):
            logger.warning("checkpoints | %s: not written by the current lineage of %s, left out", path, run_dir)
        else:
            kept.append((name, path))
    return kept


def _trained(sp: StagePaths) -> str:
    """The ``weights_id`` a folder's train stage recorded; ``UNKNOWN`` when it cannot tell (started under the
    lineage's key but not finished, an entry without the id); ``NOT_TRAINED``: not started."""
    train = read_entries(sp.manifest).get("train")
    if train is None:
        return NOT_TRAINED
    return (train.get("result") or {}).get(WEIGHTS_ID_KEY) or UNKNOWN


def _holder(lock: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(lock.read_text())
    return {}


def _proc_stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first); empty where there is none."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return []


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks, to tell it from a later process given the same pid."""
    fields = _proc_stat(pid)
    return fields[19] if len(fields) > 19 else None


def _alive(holder: dict) -> bool:
    """Whether the lock's holder still runs (a zombie, or another process given its pid since, does not)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return holder.get("host") not in (None, socket.gethostname())  # another machine's: cannot tell, so held
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _proc_stat(pid)
    if fields and fields[0] == "Z":
        return False
    started = holder.get("started")
    return started is None or _start_time(pid) in (None, started)


@contextlib.contextmanager
def run_lock(folder: Path) -> Iterator[Path]:
    """Hold ``<folder>/.optima.lock`` while a run writes ``folder``; a second run stops with ``FolderLocked``, naming
    the holder. A lock whose process is gone (SIGKILL, a crash) is taken over with a warning."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_FILE
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _start_time(os.getpid())}
    while True:
        try:
            with os.fdopen(os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as handle:
                json.dump(me, handle)
            break
        except FileExistsError:
            holder = _holder(lock)
            if holder.get("pid") == me["pid"] and holder.get("host") == me["host"]:
                yield lock  # held by this process already (an outer run): the outer one releases it
                return
            if _alive(holder):
                raise FolderLocked(
                    f"{folder} is being written by another run (pid {holder.get('pid')} on {holder.get('host')}, "
                    f"lock file {lock}); wait for it to end or stop it, or choose another output_dir"
                ) from None
            logger.warning("%s: taking over the lock of pid %s, which is gone", folder, holder.get("pid"))
            lock.unlink(missing_ok=True)
    try:
        yield lock
    finally:
        if _holder(lock).get("pid") == me["pid"]:
            lock.unlink(missing_ok=True)
