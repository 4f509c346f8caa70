"""SIGTERM as an exception, so that ``with`` blocks (and the vLLM servers they hold) unwind on ``kill``.

Python turns Ctrl-C (SIGINT) into ``KeyboardInterrupt`` but lets SIGTERM end the process at once, skipping
every ``__exit__``: servers started in their own process groups would survive the driver (SPEC 9.1 item 2).
Inside ``sigterm_as_exit()`` the first SIGTERM raises ``SystemExit(143)`` in the main thread instead;
further SIGTERMs are logged and ignored so that the clean-up they interrupt can finish.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Within the block, SIGTERM raises ``SystemExit(143)`` in the main thread (no-op in other threads)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def handle(signum: int, _frame) -> None:
        nonlocal fired
        if fired:
            logger.warning("signal %d again: still cleaning up", signum)
            return
        fired = True
        logger.warning("signal %d: stopping", signum)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
