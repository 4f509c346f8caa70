"""Per-iteration stage manifest: resume at the first unfinished stage (docs/method.md D4).

The original treated "the trainer YAML exists" as "trained", even after a crash. Here each stage appends an entry
to ``manifest.json`` only after it succeeded: its name, a hash of the recipe fields it depends on, its counts and
metrics, and its wall time. A rerun skips finished stages (and reuses their results); a finished run is a no-op;
a stage whose fields changed is redone with every stage after it. The file is replaced atomically, so a kill
never leaves it half written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from optima.store import write_json

logger = logging.getLogger(__name__)


def fields_hash(recipe, names: tuple[str, ...]) -> str:
    """Hash of the values of ``names`` in ``recipe`` (what one stage's output depends on)."""
    values = {name: getattr(recipe, name, None) for name in names}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]


class StaleStageError(RuntimeError):
    """A finished stage whose recipe fields changed and that cannot be redone in place."""


class Manifest:
    """The finished stages of one iteration folder.

    Args:
        path: ``<iteration folder>/manifest.json``.
        hashes: Per stage, the hash of the recipe fields its output depends on.
    """

    def __init__(self, path: Path, hashes: dict[str, str]):
        self.path, self.hashes = path, hashes
        self.entries: dict[str, dict] = json.loads(path.read_text())["stages"] if path.exists() else {}

    def done(self, stage: str) -> bool:
        return stage in self.entries

    def result(self, stage: str) -> dict:
        return self.entries[stage]["result"]

    def _save(self) -> None:
        write_json(self.path, {"stages": self.entries})

    def invalidate_changed(
        self, order: list[str], outputs: dict[str, list[Path]], refuse: tuple[str, ...] = ()
    ) -> None:
        """Forget (and delete the outputs of) the first finished stage whose fields changed, and every later one.

        Args:
            order: Stage names in execution order.
            outputs: Files and folders each stage writes.
            refuse: Stages that must not be redone in place (raise ``StaleStageError`` instead).
        """
        for index, stage in enumerate(order):
            entry = self.entries.get(stage)
            if entry is None or entry.get("config_hash") == self.hashes[stage]:
                continue
            if stage in refuse:
                raise StaleStageError(
                    f"{self.path.parent}: the {stage} stage finished with other recipe values; "
                    "use a new output_dir, or delete this iteration folder to redo it"
                )
            later = order[index:]
            logger.warning("%s: recipe fields of stage %s changed; redoing %s", self.path, stage, ", ".join(later))
            for name in later:
                self.entries.pop(name, None)
                remove_outputs(outputs.get(name, []))
            self._save()
            return

    def record(self, stage: str, result: dict, elapsed_s: float) -> None:
        self.entries[stage] = {
            "config_hash": self.hashes[stage],
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
    """Delete stage outputs that a recipe change made stale."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
