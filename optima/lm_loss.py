"""Per-utterance LM loss under the fixed loss model (the readability term), streamed while generation runs, and
where the assistant turns of a rendered chat lie (docs/method.md#readability).

`L(u)` is the mean NLL of utterance `u`'s tokens and its end-of-turn token, `u` rendered alone as an assistant
message (the template's tokens are never scored): from a vLLM server's prompt log-probabilities, or a forward pass
in this process, on the same token ids. The turn spans (`trained_char_spans`) are also the trainer's loss masks
(docs/method.md#loss-masks). `StreamingLosses` scores each conversation as it is written into `losses.jsonl`
(keyed by conversation, loss model and a hash of its texts; the last valid line wins; a failed request is left
for the score stage).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optima.agents.prompts import Utterance, render_utterance
from optima.config.rules import vllm_loss_batch_size, workers
from optima.reward import reads_losses
from optima.serving.client import prompt_logprobs
from optima.store import JsonlWriter, load_records, record_key, write_jsonl

if TYPE_CHECKING:
    from optima.config import LoopRecipe

logger = logging.getLogger(__name__)

ScoreTexts = Callable[[Sequence[str]], list[float]]
STREAM_WORKERS = 4  # requests in flight at once: enough for vLLM to batch, few enough to leave it to generation


class MaskError(ValueError):
    """The chat template does not render conversation prefixes as text prefixes."""


SENTINEL = "\u2063optima-turn-start\u2063"  # text no real message contains


def _render(tokenizer: Any, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False)


def trained_char_spans(tokenizer: Any, messages: list[dict], end_of_turn: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (content and `end_of_turn`): turn
    k starts where a sentinel put in its place appears (no token pattern of one template is matched).

    Raises:
        MaskError: the template does not render a prefix of the messages as a prefix of the text.
    """
    full = _render(tokenizer, messages)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        probe = _render(tokenizer, [*messages[:k], {"role": "assistant", "content": SENTINEL}])
        head = probe[: probe.find(SENTINEL)]
        upto = _render(tokenizer, messages[: k + 1])
        if SENTINEL not in probe or not (full.startswith(upto) and upto.startswith(head)):
            raise MaskError(f"the chat template does not render message {k} as a continuation of the ones before")
        end = upto.find(end_of_turn, len(head))
        spans.append((len(head), end + len(end_of_turn) if end >= 0 else len(upto)))
    return full, spans


@dataclass(frozen=True)
class LossInput:
    """The token ids of one rendered utterance and the positions whose NLL is averaged."""

    input_ids: list[int]
    scored: list[int]


def build_loss_input(tokenizer: Any, text: str) -> LossInput:
    """`text` rendered as a lone assistant message, and the positions of its content and end-of-turn token."""
    rendered, spans = trained_char_spans(tokenizer, [{"role": "assistant", "content": text}], tokenizer.eos_token)
    (start, end) = spans[0]
    encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    scored = [i for i, (s, e) in enumerate(offsets) if e > s and s >= start and e <= end and i > 0]
    return LossInput(ids, scored)


def mean_nll(logprobs: Sequence[float | None], scored: Sequence[int]) -> float:
    """The mean negative log-probability at `scored` positions (position i's given those before); NaN for none."""
    values = [-logprobs[i] for i in scored if logprobs[i] is not None]
    if not values:
        return math.nan
    return sum(values) / len(values)


class VLLMLossScorer:
    """LM losses from the prompt log-probabilities of vLLM servers of the loss model (`base_urls`: batches
    alternate), `batch_size` texts per request (default `vllm_loss_batch_size`)."""

    def __init__(
        self, base_urls: Sequence[str], model: str, tokenizer: Any, recipe: LoopRecipe, batch_size: int | None = None
    ):
        from openai import OpenAI

        self.clients = [
            OpenAI(
                base_url=url,
                api_key=recipe.api_key or "EMPTY",
                timeout=recipe.request_timeout_s,
                max_retries=recipe.max_retries,
            )
            for url in base_urls
        ]
        self.model, self.tokenizer = model, tokenizer
        # Conversations are scored from several threads at once; one tokenizer object is not safe to share.
        self.tokenizer_lock = threading.Lock()
        # A request carries several texts; a few requests run at once so vLLM batches across them.
        self.batch_size = batch_size or vllm_loss_batch_size(recipe)
        self.recipe = recipe

    def _score_batch(self, numbered: tuple[int, Sequence[LossInput]]) -> list[float]:
        number, inputs = numbered
        client = self.clients[number % len(self.clients)]
        choices = prompt_logprobs(client, self.model, [x.input_ids for x in inputs])
        return [mean_nll(c.logprobs.token_logprobs, x.scored) for c, x in zip(choices, inputs, strict=True)]

    def score(self, texts: Sequence[str]) -> list[float]:
        """The mean NLL of each text."""
        with self.tokenizer_lock:
            inputs = [build_loss_input(self.tokenizer, t) for t in texts]
        batches = [inputs[i : i + self.batch_size] for i in range(0, len(inputs), self.batch_size)]
        with ThreadPoolExecutor(workers(self.recipe, len(batches))) as pool:
            results = list(pool.map(self._score_batch, enumerate(batches)))
        return [loss for batch in results for loss in batch]


class HFLossScorer:
    """LM losses from a batched transformers forward pass (fp32, right padding; 8 texts a batch is the CPU's
    sweet spot, docs/cpu.md#training-speed)."""

    def __init__(self, model_path: str, tokenizer: Any, batch_size: int = 8):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.tokenizer, self.batch_size = tokenizer, batch_size
        # The tree search calls from many threads; forward passes one at a time use the cores best.
        self.lock = threading.Lock()

    def _score_batch(self, inputs: Sequence[LossInput]) -> list[float]:
        torch = self.torch
        width = max(len(x.input_ids) for x in inputs)
        ids = torch.zeros((len(inputs), width), dtype=torch.long)
        mask = torch.zeros((len(inputs), width), dtype=torch.long)
        for row, x in enumerate(inputs):
            ids[row, : len(x.input_ids)] = torch.tensor(x.input_ids)
            mask[row, : len(x.input_ids)] = 1
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        out = []
        for row, x in enumerate(inputs):
            # logprobs[:, i - 1] is the log-probability of token i given the ones before it.
            out.append(mean_nll([None] + logprobs[row].tolist(), x.scored))
        return out

    def score(self, texts: Sequence[str]) -> list[float]:
        """The mean NLL of each text."""
        with self.lock:
            return self._score(texts)

    def _score(self, texts: Sequence[str]) -> list[float]:
        inputs = [build_loss_input(self.tokenizer, t) for t in texts]
        # Similar lengths together: less padding per batch.
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i].input_ids))
        losses: list[float] = [math.nan] * len(inputs)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, loss in zip(chunk, self._score_batch([inputs[i] for i in chunk]), strict=True):
                losses[i] = loss
        return losses


def conversation_texts(record: dict) -> list[str]:
    """The rendered utterances of a conversation record, as the LM loss sees them."""
    return [render_utterance(Utterance(u["speaker"], u["text"])) for u in record["utterances"]]


def texts_sha1(texts: Sequence[str]) -> str:
    return hashlib.sha1("\x00".join(texts).encode()).hexdigest()


def needs_losses(record: dict) -> bool:
    """Whether the reward of a conversation record reads its LM losses (finished ones only)."""
    return reads_losses(record.get("status"))


def to_json_losses(losses: Sequence[float]) -> list[float | None]:
    """Losses as JSON holds them: NaN (nothing scored in an utterance) becomes null."""
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
    """The line that counts for each (task_id, sample_index, loss_model) of `path`: the last valid one.
    `rewrite`: rewrite the file with those lines when it holds others (torn, invalid, superseded), to append to."""
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
    """`losses_of(record)`: the stored losses of a conversation record under `loss_model`, else None."""
    return known_losses(read_loss_lines(path), loss_model)


def known_losses(stored: dict[tuple[str, int, str], dict], loss_model: str) -> Callable[[dict], list[float] | None]:
    """`losses_of(record)` over lines already read (`read_loss_lines`)."""

    def losses_of(record: dict) -> list[float] | None:
        line = stored.get((*record_key(record), loss_model))
        if line is None or line["texts_sha1"] != texts_sha1(conversation_texts(record)):
            return None  # not scored yet, or the conversation was generated again since
        return from_json_losses(line["losses"])

    return losses_of


class StreamingLosses:
    """Scores each submitted conversation record in the background into `path` (`losses.jsonl`), on lines that
    name `loss_model` (losses of another model are never reused)."""

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
        """Queue `record` for scoring (not when its losses are stored already or its reward reads none)."""
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
        """Wait for every request; return what it did and how long the wait took (a failed request is counted, and
        its conversation left to the score stage)."""
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
        """Stop: queued requests are dropped unless `wait` (those written stay for the next run)."""
        self.executor.shutdown(wait=wait, cancel_futures=not wait)
        self.writer.close()

    def __enter__(self) -> StreamingLosses:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        if exc_type is not None:
            self.close()
