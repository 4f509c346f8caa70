"""Per-iteration stage manifest: resume at the first unfinished stage (docs/method.md D4, #resume).

A stage counts as done only when it succeeded, never because its files exist. Each stage writes its entry to
``manifest.json`` when it starts: its name and its key (a hash of the recipe fields it depends on, those fields'
values, and the identities of what it reads: the models, the files, the stage before it), so that the rows a killed
stage left carry the key they were made under; it adds its counts, metrics and wall time when it succeeded. A rerun
skips finished stages (and reuses their results) and continues an unfinished one under the same key; a finished run
is a no-op. A stage whose key changed, finished or not, is redone with every stage after it, with a warning that
names what changed, and their outputs (partial ones too) are moved aside (``optima.lineage.set_aside``), never
deleted or continued. The file is replaced atomically, so a kill never leaves it half written.

Entries written before stages recorded their inputs (no ``inputs`` key) are judged by their fields alone, then
upgraded with the current inputs, so an existing run keeps resuming.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from optima.identity import digest
from optima.lineage import set_aside
from optima.store import write_json

logger = logging.getLogger(__name__)


def field_values(recipe: object, names: tuple[str, ...]) -> dict:
    """The JSON form of the values of ``names`` in ``recipe``."""
    return json.loads(json.dumps({name: getattr(recipe, name, None) for name in names}, default=str))


def fields_hash(recipe: object, names: tuple[str, ...]) -> str:
    """Hash of the values of ``names`` in ``recipe`` (what one stage's output depends on)."""
    return digest({name: getattr(recipe, name, None) for name in names})


@dataclass(frozen=True)
class StageKey:
    """What one stage's output depends on.

    Args:
        config_hash: ``fields_hash`` of the stage's recipe fields.
        fields: Those fields' values (to name the ones that changed).
        inputs: Identity of each thing the stage reads: models, files, and ``previous stage`` (the key of the
            stage before it, across parts and iterations), so that a change upstream reaches every later stage.
            None: not known (only the fields are recorded and compared).
    """

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


def stage_link(where: str, stage: str, identity: str) -> str:
    """What the stage after ``stage`` records as its ``previous stage``: ``<folder in the run>/<stage>@<identity>``."""
    return f"{where}/{stage}@{identity}"


def short_key(entry: dict | None) -> str:
    """A manifest entry's key for a folder name (``nokey``: none recorded)."""
    return ((entry or {}).get("identity") or (entry or {}).get("config_hash") or "nokey")[:12]


class Manifest:
    """The started and finished stages of one iteration folder.

    Args:
        path: ``<iteration folder>/manifest.json``.
        keys: Per stage, its ``StageKey`` (or just its fields hash: no inputs).
    """

    def __init__(self, path: Path, keys: dict[str, StageKey | str]):
        self.path = path
        self.keys = {name: key if isinstance(key, StageKey) else StageKey(key) for name, key in keys.items()}
        self.entries: dict[str, dict] = json.loads(path.read_text())["stages"] if path.exists() else {}

    def done(self, stage: str) -> bool:
        return "result" in self.entries.get(stage, {})

    def finished(self) -> list[str]:
        """The finished stages, in the order they ran."""
        return [name for name in self.entries if self.done(name)]

    def result(self, stage: str) -> dict:
        return self.entries[stage]["result"]

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
        """Set aside the first stage whose key changed (finished or not) and every later one; return their names.

        Args:
            order: Stage names in execution order.
            outputs: Files and folders each stage writes: moved to ``set_aside/<stage>-<old key>-<time>/`` beside
                them (``optima.lineage.set_aside``) with the old entry and the reasons, never deleted.
            part_files: Files that sum up the whole part (``metrics.json``): set aside with the first stage redone.
        """
        upgraded = False
        for index, stage in enumerate(order):
            reasons = self._stale(stage, outputs.get(stage, []))
            if not reasons:
                entry = self.entries.get(stage)
                if entry is not None and "inputs" not in entry and self.keys[stage].inputs is not None:
                    # Written before inputs were recorded: take them as they are now.
                    entry |= self._key_fields(stage)
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
                set_aside(paths, f"{name}-{short_key(old)}", {"stage": name, "reasons": why, "entry": old})
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
        self.entries[stage] = self._key_fields(stage) | {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self._save()

    def record(self, stage: str, result: dict, elapsed_s: float) -> None:
        started = self.entries.get(stage, {}).get("started_at")
        self.entries[stage] = self._key_fields(stage) | {
            "result": result,
            "elapsed_s": round(elapsed_s, 2),
            "started_at": started or time.strftime("%Y-%m-%dT%H:%M:%S"),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        self._save()

    def timings(self) -> dict[str, float]:
        return {name: self.entries[name]["elapsed_s"] for name in self.finished()}

    def run(self, stage: str, body: Callable[[], dict], label: str = "") -> dict:
        """Run ``body`` unless ``stage`` is finished; record its key before and its result after it returns."""
        if self.done(stage):
            logger.info("%s%s | done before, skipped", label, stage)
            return self.result(stage)
        logger.info("%s%s", label, stage)
        started = time.monotonic()
        self.start(stage)
        result = body()
        self.record(stage, result, time.monotonic() - started)
        return result
