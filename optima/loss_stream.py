"""LM losses computed while generation runs: each conversation is scored as soon as it is written.

The loss model is fixed for the whole run, so the LM loss of a conversation (one number per utterance) does not
depend on the rest of the iteration; only the cheap parts of the reward do (the token term needs ``T_max`` over
the question's conversations). ``StreamingLosses`` sends each finished conversation's utterances to the loss
server from a few worker threads and appends ``{"task_id", "sample_index", "texts_sha1", "losses"}`` to
``losses.jsonl``; the score stage then combines everything (``optima.stages.reward_stage``), scoring only what
is missing.

Resumable like the other JSONL files: a killed stage keeps what was written; a line is used only when the hash of
the conversation's rendered utterances matches, so a regenerated conversation is never given stale losses. The
rules of the file, the same when a stage resumes and when the score stage loads it:

* one line per (conversation, loss model): when several exist, **the last valid line wins** (a later line was
  written for a later version of the conversation); invalid lines (missing fields, losses not a list of numbers)
  and a torn last line are dropped, and resuming rewrites the file with the lines that win;
* only conversations whose reward reads their losses are streamed (``needs_losses``: status ``ok``); a failed
  conversation is generated again on the next run and a cut one gets the loss penalty whatever its losses;
* a NaN loss (an utterance with no scored token) is stored as JSON ``null`` and read back as NaN;
* a failed loss request is logged and not written: the conversation's losses are missing, and the score stage
  scores what is missing, so generation is never lost to the loss server.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from optima.agents.prompts import Utterance, render_utterance
from optima.reward import reads_losses
from optima.store import JsonlWriter, load_records, record_key, write_jsonl

logger = logging.getLogger(__name__)

ScoreTexts = Callable[[Sequence[str]], list[float]]
STREAM_WORKERS = 4  # requests in flight at once: enough for vLLM to batch, few enough to leave it to generation


def conversation_texts(record: dict) -> list[str]:
    """The rendered utterances of a conversation record, as the LM loss sees them."""
    return [render_utterance(Utterance(u["speaker"], u["text"])) for u in record["utterances"]]


def texts_sha1(texts: Sequence[str]) -> str:
    return hashlib.sha1("\x00".join(texts).encode()).hexdigest()


def needs_losses(record: dict) -> bool:
    """Whether the reward of a conversation record reads its LM losses (``reward.reads_losses``: finished ones)."""
    return reads_losses(record.get("status"))


def to_json_losses(losses: Sequence[float]) -> list[float | None]:
    """Losses as JSON can hold them: NaN (nothing scored in an utterance) becomes null."""
    return [None if isinstance(x, float) and not math.isfinite(x) else x for x in losses]


def from_json_losses(losses: Sequence[float | None]) -> list[float]:
    """Losses read back from JSON: null becomes NaN again."""
    return [math.nan if x is None else x for x in losses]


def _line_key(line: dict) -> tuple[str, int, str]:
    return (*record_key(line), line["loss_model"])


def _valid(line: dict) -> bool:
    try:
        _line_key(line)
    except (KeyError, TypeError, ValueError):
        return False
    losses = line.get("losses")
    return (
        isinstance(line.get("texts_sha1"), str)
        and isinstance(losses, list)
        and all(x is None or (isinstance(x, int | float) and not isinstance(x, bool)) for x in losses)
    )


def read_loss_lines(path: Path, rewrite: bool = False) -> dict[tuple[str, int, str], dict]:
    """The line that counts for each (task_id, sample_index, loss_model) of ``path``: the last valid one.

    Args:
        path: ``losses.jsonl``.
        rewrite: Rewrite the file with exactly those lines when it holds anything else (torn, invalid or
            superseded lines), so that appending resumes from a clean file.
    """
    lines, torn = load_records(path) if path.exists() else ([], False)
    kept: dict[tuple[str, int, str], dict] = {}
    for line in lines:
        if _valid(line):
            kept.pop(_line_key(line), None)  # re-insert: the file keeps the order in which lines last won
            kept[_line_key(line)] = line
    if rewrite and (torn or len(kept) != len(lines)):
        logger.warning(
            "%s: resuming; kept the last valid line of %d conversations, dropped %d lines (torn last line: %s)",
            path,
            len(kept),
            len(lines) - len(kept),
            torn,
        )
        write_jsonl(kept.values(), path)
    return kept


def load_known_losses(path: Path, loss_model: str) -> Callable[[dict], list[float] | None]:
    """``losses_of(record)``: the stored losses of a conversation record under ``loss_model``, else None."""
    return known_losses(read_loss_lines(path), loss_model)


def known_losses(stored: dict[tuple[str, int, str], dict], loss_model: str) -> Callable[[dict], list[float] | None]:
    """``losses_of(record)`` over lines already read (``read_loss_lines``)."""

    def losses_of(record: dict) -> list[float] | None:
        line = stored.get((*record_key(record), loss_model))
        if line is None or line["texts_sha1"] != texts_sha1(conversation_texts(record)):
            return None  # not scored yet, or the conversation was generated again since
        return from_json_losses(line["losses"])

    return losses_of


class StreamingLosses:
    """Scores each submitted conversation record in the background into ``path`` (see the module docstring).

    Args:
        score_texts: Mean LM loss of each text (the loss server's scorer).
        path: ``losses.jsonl`` of the stage.
        loss_model: The loss model (recorded on each line: losses of another model are never reused).
        workers: Requests in flight at once.
    """

    def __init__(self, score_texts: ScoreTexts, path: Path, loss_model: str, workers: int = STREAM_WORKERS):
        self.known = known_losses(read_loss_lines(path, rewrite=True), loss_model)  # one read of the file
        self.score_texts, self.loss_model = score_texts, loss_model
        self.writer = JsonlWriter(path)
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loss")
        self.futures: list[Future] = []
        self.lock = threading.Lock()
        self.submitted = self.reused = self.skipped = self.failed = 0
        self.wait_s = 0.0

    def submit(self, record: dict) -> None:
        """Queue ``record`` for scoring (no-op when its losses are stored already or its reward reads none)."""
        if not needs_losses(record):
            self.skipped += 1
            return
        if self.known(record) is not None:
            self.reused += 1
            return
        with self.lock:
            self.submitted += 1
            self.futures.append(self.executor.submit(self._score, record))

    def _score(self, record: dict) -> None:
        texts = conversation_texts(record)
        task_id, sample_index = record_key(record)
        try:
            losses = self.score_texts(texts) if texts else []
        except Exception as exc:  # noqa: BLE001 - any failure of the loss server leaves the gap to the score stage
            with self.lock:
                self.failed += 1
            logger.warning(
                "loss | %s #%s not scored while generating (the score stage will): %r", task_id, sample_index, exc
            )
            return
        line = {"task_id": task_id, "sample_index": sample_index, "loss_model": self.loss_model}
        self.writer.write(line | {"texts_sha1": texts_sha1(texts), "losses": to_json_losses(losses)})

    def finish(self) -> dict:
        """Wait for every request; return what it did and how long the wait took.

        A failed request does not raise (its conversation is scored by the score stage); it is counted in
        ``failed``.
        """
        started = time.monotonic()
        try:
            for future in list(self.futures):
                future.result()
        finally:
            self.close(wait=False)
        self.wait_s = time.monotonic() - started
        scored = self.submitted - self.failed
        logger.info(
            "loss | %d conversations scored while generating (%d stored before, %d need none, %d failed and left to "
            "the score stage) | %.1f s waited after generation",
            scored,
            self.reused,
            self.skipped,
            self.failed,
            self.wait_s,
        )
        return {
            "scored": scored,
            "failed": self.failed,
            "reused": self.reused,
            "skipped": self.skipped,
            "wait_s": round(self.wait_s, 2),
        }

    def close(self, wait: bool = False) -> None:
        """Stop: queued requests are dropped unless ``wait`` (those written stay for the next run)."""
        self.executor.shutdown(wait=wait, cancel_futures=not wait)
        self.writer.close()

    def __enter__(self) -> StreamingLosses:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        if exc_type is not None:
            self.close()
