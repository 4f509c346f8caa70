"""Per-iteration stage manifest: resume at the first unfinished stage (docs/method.md D4, #resume).

A stage counts as done only when it succeeded, never because its files exist: each stage appends an entry
to ``manifest.json`` only after it succeeded: its name, its key (a hash of the recipe fields it depends on, those
fields' values, and the identities of what it reads: the models, the files, the stage before it), its counts and
metrics, and its wall time. A rerun skips finished stages (and reuses their results); a finished run is a no-op;
a stage whose key changed is redone with every stage after it, with a warning that names what changed. The outputs
of a redone sampling stage are moved aside, not deleted. The file is replaced atomically, so a kill never leaves
it half written.

Entries written before stages recorded their inputs (no ``inputs`` key) are judged by their fields alone, then
upgraded with the current inputs, so an existing run keeps resuming.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from optima.identity import digest
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


class Manifest:
    """The finished stages of one iteration folder.

    Args:
        path: ``<iteration folder>/manifest.json``.
        keys: Per stage, its ``StageKey`` (or just its fields hash: no inputs).
    """

    def __init__(self, path: Path, keys: dict[str, StageKey | str]):
        self.path = path
        self.keys = {name: key if isinstance(key, StageKey) else StageKey(key) for name, key in keys.items()}
        self.entries: dict[str, dict] = json.loads(path.read_text())["stages"] if path.exists() else {}

    def done(self, stage: str) -> bool:
        return stage in self.entries

    def result(self, stage: str) -> dict:
        return self.entries[stage]["result"]

    def _save(self) -> None:
        write_json(self.path, {"stages": self.entries})

    def invalidate_changed(
        self, order: list[str], outputs: dict[str, list[Path]], keep: tuple[str, ...] = ()
    ) -> list[str]:
        """Forget the first finished stage whose key changed, and every later one; return the stages forgotten.

        Args:
            order: Stage names in execution order.
            outputs: Files and folders each stage writes (deleted, or moved aside for ``keep``).
            keep: Stages whose outputs are costly samples: moved aside (``<name>.replaced-<n>``), not deleted.
        """
        upgraded = False
        for index, stage in enumerate(order):
            entry = self.entries.get(stage)
            if entry is None:
                continue
            reasons = self.keys[stage].changes(entry)
            if not reasons:
                if "inputs" not in entry and self.keys[stage].inputs is not None:
                    # Written before inputs were recorded: take them as they are now.
                    entry |= self._key_fields(stage)
                    upgraded = True
                continue
            later = order[index:]
            logger.warning(
                "%s: stage %s must be redone (%s); redoing %s", self.path, stage, "; ".join(reasons), ", ".join(later)
            )
            for name in later:
                self.entries.pop(name, None)
                for path in outputs.get(name, []):
                    if name in keep:
                        set_aside(path)
                    else:
                        remove_outputs([path])
            self._save()
            return later
        if upgraded:
            self._save()
        return []

    def _key_fields(self, stage: str) -> dict:
        key = self.keys[stage]
        known = {"inputs": key.inputs, "identity": key.identity} if key.inputs is not None else {}
        return {"config_hash": key.config_hash, "fields": key.fields} | known

    def record(self, stage: str, result: dict, elapsed_s: float) -> None:
        self.entries[stage] = self._key_fields(stage) | {
            "result": result,
            "elapsed_s": round(elapsed_s, 2),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        self._save()

    def timings(self) -> dict[str, float]:
        return {name: entry["elapsed_s"] for name, entry in self.entries.items()}

    def run(self, stage: str, body: Callable[[], dict], label: str = "") -> dict:
        """Run ``body`` unless ``stage`` is finished; record its result after it returns."""
        if self.done(stage):
            logger.info("%s%s | done before, skipped", label, stage)
            return self.result(stage)
        logger.info("%s%s", label, stage)
        started = time.monotonic()
        result = body()
        self.record(stage, result, time.monotonic() - started)
        return result


def remove_outputs(paths: list[Path]) -> None:
    """Delete stage outputs that a change made stale."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def set_aside(path: Path) -> Path | None:
    """Move a stale output to ``<name>.replaced-<n>`` (the first free n) and return where; None if absent."""
    if not path.exists():
        return None
    number = 1
    while (target := path.with_name(f"{path.name}.replaced-{number}")).exists():
        number += 1
    path.rename(target)
    logger.warning("%s: kept as %s", path, target.name)
    return target
