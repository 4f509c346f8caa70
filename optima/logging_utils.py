"""Logging set-up, called once from each entry point's ``main()`` (never at import)."""

from __future__ import annotations

import logging
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int = logging.INFO, log_file: Path | None = None) -> None:
    """Log to stderr, and also to ``log_file`` when given (the run directory's driver log)."""
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(level=level, format=LOG_FORMAT, handlers=handlers, force=True)
    # One line per HTTP request drowns the stage lines; keep the clients' warnings only.
    for noisy in ("httpx", "httpx2", "httpcore", "openai", "urllib3"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def attach_driver_log(path: Path) -> None:
    """Also write the driver's log to ``path`` (a run's ``logs/driver.log``), appending across resumptions."""
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    if any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path for h in root.handlers):
        return
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
