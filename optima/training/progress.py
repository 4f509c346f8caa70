"""Training progress on the console: a tqdm bar with step, loss and ETA, fed from the trainer's own state.

The trainer scripts (``optima.training.sft_train`` / ``dpo_train``, under accelerate) write the ``TrainerState`` of
the Hugging Face ``Trainer`` (the ``trainer_state.json`` format: ``global_step``, ``max_steps``, ``epoch``,
``log_history``) to the file named by ``OPTIMA_TRAINER_STATE`` after every step and every log, atomically; the
run gives each train stage ``<iteration>/logs/trainer_state.json``. While the trainer runs, the driver reads that
file on a poll interval and moves a bar: steps done of ``max_steps``, the last logged loss, the epoch, tqdm's
rate and ETA. The trainer's own output still goes only to ``logs/train.log``. ``--quiet`` (or a console that is
not a terminal) shows no bar.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

STATE_ENV = "OPTIMA_TRAINER_STATE"
POLL_S = 1.0


def state_callback() -> Any:
    """A ``TrainerCallback`` writing the trainer state to ``$OPTIMA_TRAINER_STATE`` (None when it is unset).

    Only the main process writes; each write replaces the file atomically, so a reader never sees half of it.
    """
    path = os.environ.get(STATE_ENV)
    if not path:
        return None
    from transformers import TrainerCallback

    class StateFileCallback(TrainerCallback):
        def _write(self, state) -> None:
            if state.is_world_process_zero:
                tmp = f"{path}.tmp"
                state.save_to_json(tmp)
                os.replace(tmp, path)

        def on_train_begin(self, args, state, control, **kwargs):
            self._write(state)

        def on_step_end(self, args, state, control, **kwargs):
            self._write(state)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self._write(state)

    return StateFileCallback()


def console_stream(enabled: bool) -> IO[str] | None:
    """The console for a progress bar: stderr when enabled and a terminal, else None (no bar)."""
    return sys.stderr if enabled and sys.stderr.isatty() else None


def read_state(path: Path) -> dict | None:
    """The trainer state in ``path``, or None while there is none (not written yet, or being replaced)."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def last_loss(state: dict) -> float | None:
    """The newest training loss in the state's ``log_history`` (None before the first log)."""
    for entry in reversed(state.get("log_history") or []):
        if "loss" in entry:
            return entry["loss"]
    return None


class TrainingProgress:
    """A tqdm bar that follows a trainer state file from a background thread (a context manager).

    Args:
        state_file: The file the trainer writes (``OPTIMA_TRAINER_STATE``).
        stream: Where the bar is drawn (``sys.stderr`` on a terminal).
        desc: The bar's label, e.g. ``train iteration 1``.
        poll_s: Seconds between reads.
    """

    def __init__(self, state_file: Path, stream: IO[str], desc: str = "train", poll_s: float = POLL_S):
        self.state_file, self.stream, self.desc, self.poll_s = Path(state_file), stream, desc, poll_s
        self.bar = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="training-progress", daemon=True)

    def __enter__(self) -> TrainingProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.refresh()  # the final state (the trainer wrote it before exiting)
        if self.bar is not None:
            self.bar.close()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):  # wakes at once when training ends
            self.refresh()

    def refresh(self) -> None:
        """Move the bar to the state in the file (created on the first state seen, at its step: a resume)."""
        state = read_state(self.state_file)
        if not state or not state.get("max_steps"):
            return
        step, total = int(state.get("global_step") or 0), int(state["max_steps"])
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=step, desc=self.desc, unit="step", file=self.stream, dynamic_ncols=True
            )
        if total != self.bar.total:
            self.bar.total = total
        loss = last_loss(state)
        postfix = {"loss": f"{loss:.4g}"} if loss is not None else {}
        if state.get("epoch") is not None:
            postfix["epoch"] = f"{float(state['epoch']):.2f}"
        self.bar.set_postfix(postfix, refresh=False)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        else:
            self.bar.refresh()  # a new loss at the same step
