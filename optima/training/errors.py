"""How a fine-tuning stage fails: ``TrainingError``, its message, and the grace period of a stopped trainer."""

from __future__ import annotations

from pathlib import Path

STOP_TIMEOUT_S = 30.0  # grace period between SIGTERM and SIGKILL of a trainer's process group


class TrainingError(RuntimeError):
    """A fine-tuning stage failed; the message names the stage and its log file and ends with the log's tail."""


def failure_message(what: str, log_path: Path) -> str:
    """``what; log: PATH`` and the log's last 30 lines."""
    tail = log_path.read_text(errors="replace").splitlines()[-30:] if log_path.is_file() else []
    return f"{what}; log: {log_path}\n" + "\n".join(tail)
