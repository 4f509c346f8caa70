"""A run folder holds one lineage (docs/method.md#one-lineage-per-run-folder).

A lineage is the chain of stage keys of one run (``optima.stage_identity``): every stage's key holds the key of the
stage before it, across the parts and iterations of the run. What a rerun under other settings makes stale is never
deleted and never left where a reader looks: it is moved to a ``set_aside/<why>-<when>/`` folder beside it
(``set_aside``): a redone stage's outputs under ``set_aside/<stage>-<old key>-<time>/``, the later parts of a
redone part under ``set_aside/old-lineage-<time>/``, iterations past ``iteration_times`` under
``set_aside/beyond-iteration_times-<n>-<time>/``.

The readers (report, conversation browser, trackers, hub upload, checkpoint sweep) read only the current lineage,
from the files alone: ``lineage_folders`` follows the chain of ``previous stage`` links of the manifests and stops
at the first folder that does not continue it; ``lineage_checkpoints`` keeps the checkpoints with a completion
marker that the lineage's train stages wrote. ``run_lock`` keeps a second run out of a folder that one is writing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from optima.identity import WEIGHTS_ID_KEY, read_marker
from optima.methods import SFT
from optima.paths import RunPaths, StagePaths, find_checkpoints, stage_folders
from optima.store import write_json

logger = logging.getLogger(__name__)

SET_ASIDE = "set_aside"
LOCK_FILE = ".optima.lock"


class FolderLocked(RuntimeError):
    """Another live run holds the folder's lock."""


def set_aside(paths: Iterable[Path], label: str, note: dict | None = None) -> list[Path]:
    """Move each existing path to ``<its parent>/set_aside/<label>-<time>/<its name>``; return where they went.

    Args:
        paths: Files or folders made stale.
        label: Says why (``select-<old key>``, ``old-lineage``...).
        note: Written as ``why.json`` into each ``set_aside`` folder used (the old manifest entry, the reasons).
    """
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
    head, _, identity = upstream.rpartition("@")  # optima.manifest.stage_link: <folder>/<stage>@<identity>
    link_where, _, stage = head.rpartition("/")
    if link_where != where:
        return False
    entry = entries.get(stage)
    return entry is None or entry.get("identity") in (None, identity)  # a stage never started: nothing to compare


def lineage_folders(run_dir: Path) -> list[tuple[int, str, StagePaths]]:
    """``(iteration, part, folder)`` of the run's current lineage, in run order (``optima.paths.stage_folders``).

    A folder belongs when its first stage's ``previous stage`` is the last folder's stage of the same key; the
    first that does not (an earlier run's iteration) ends the lineage. A folder without a manifest (written by
    hand, or before manifests) cannot be judged and is kept.
    """
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
    """The checkpoints under ``root`` that a sweep evaluates (``optima.paths.find_checkpoints``: finished ones).

    When ``root`` is a run's ``checkpoints`` folder, a checkpoint is kept only when a train stage of the current
    lineage started under its key and, if it finished, recorded the checkpoint's ``weights_id``.
    """
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


NOT_TRAINED, UNKNOWN = "not trained", "unknown"


def _trained(sp: StagePaths) -> str:
    """The ``weights_id`` a folder's train stage recorded; ``UNKNOWN`` when it cannot tell (a train stage started
    under the lineage's key but not finished, an entry without the id); ``NOT_TRAINED``: not started."""
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
    """Hold ``<folder>/.optima.lock`` while a run writes ``folder``; a second run stops with the holder's pid.

    A lock left by a process that is gone (killed with SIGKILL, a crashed machine) is taken over with a warning.

    Raises:
        FolderLocked: another live process holds the folder.
    """
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
