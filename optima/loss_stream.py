"""LM losses computed while generation runs: each conversation is scored as soon as it is written.

The loss model is fixed for the whole run, so the LM loss of a conversation (one number per utterance) does not
depend on the rest of the iteration; only the cheap parts of the reward do (the token term needs ``T_max`` over
the question's conversations). ``StreamingLosses`` sends each finished conversation's utterances to the loss
server from a few worker threads and appends ``{"task_id", "sample_index", "texts_sha1", "losses"}`` to
``losses.jsonl``; the score stage then combines everything (``optima.stages.reward_stage``), scoring only what
is missing.

Resumable like the other JSONL files: a killed stage keeps what was written; a line is used only when the hash of
the conversation's rendered utterances matches, so a regenerated conversation is never given stale losses.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from optima.agents.prompts import Utterance, render_utterance
from optima.store import JsonlWriter, load_records, prepare_resume, record_key

logger = logging.getLogger(__name__)

ScoreTexts = Callable[[Sequence[str]], list[float]]
STREAM_WORKERS = 4  # requests in flight at once: enough for vLLM to batch, few enough to leave it to generation


def conversation_texts(record: dict) -> list[str]:
    """The rendered utterances of a conversation record, as the LM loss sees them."""
    return [render_utterance(Utterance(u["speaker"], u["text"])) for u in record["utterances"]]


def texts_sha1(texts: Sequence[str]) -> str:
    return hashlib.sha1("\x00".join(texts).encode()).hexdigest()


def load_known_losses(path: Path, loss_model: str) -> Callable[[dict], list[float] | None]:
    """``losses_of(record)``: the stored losses of a conversation record under ``loss_model``, else None."""
    lines = load_records(path)[0] if path.exists() else []
    stored = {record_key(line): line for line in lines if line["loss_model"] == loss_model}

    def losses_of(record: dict) -> list[float] | None:
        line = stored.get(record_key(record))
        if line is None or line["texts_sha1"] != texts_sha1(conversation_texts(record)):
            return None  # not scored yet, or the conversation was generated again since
        return line["losses"]

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
        prepare_resume(path, retry_errors=False)
        self.known = load_known_losses(path, loss_model)
        self.score_texts, self.loss_model = score_texts, loss_model
        self.writer = JsonlWriter(path)
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loss")
        self.futures: list[Future] = []
        self.lock = threading.Lock()
        self.submitted = self.reused = 0
        self.wait_s = 0.0

    def submit(self, record: dict) -> None:
        """Queue ``record`` for scoring (no-op when its losses are stored already)."""
        if self.known(record) is not None:
            self.reused += 1
            return
        with self.lock:
            self.submitted += 1
            self.futures.append(self.executor.submit(self._score, record))

    def _score(self, record: dict) -> None:
        texts = conversation_texts(record)
        losses = self.score_texts(texts) if texts else []
        task_id, sample_index = record_key(record)
        line = {"task_id": task_id, "sample_index": sample_index, "loss_model": self.loss_model}
        self.writer.write(line | {"texts_sha1": texts_sha1(texts), "losses": losses})

    def finish(self) -> dict:
        """Wait for every request (a failed one raises); return what it did and how long the wait took."""
        started = time.monotonic()
        try:
            for future in list(self.futures):
                future.result()
        finally:
            self.close(wait=False)
        self.wait_s = time.monotonic() - started
        logger.info(
            "loss | %d conversations scored while generating (%d stored before) | %.1f s waited after generation",
            self.submitted,
            self.reused,
            self.wait_s,
        )
        return {"scored": self.submitted, "reused": self.reused, "wait_s": round(self.wait_s, 2)}

    def close(self, wait: bool = False) -> None:
        """Stop: queued requests are dropped unless ``wait`` (those written stay for the next run)."""
        self.executor.shutdown(wait=wait, cancel_futures=not wait)
        self.writer.close()

    def __enter__(self) -> StreamingLosses:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        if exc_type is not None:
            self.close()
