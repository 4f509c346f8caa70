"""Per-utterance LM loss under the fixed initial model: the readability term of the reward.

See docs/method.md#readability.

``L(u)`` is the mean negative log-likelihood of utterance ``u``'s tokens plus its end-of-turn token, with ``u``
rendered alone as one assistant message of the model's chat template
(``apply_chat_template([{"role": "assistant", "content": u}])``); the template's own tokens are context, never
scored. Two backends compute the same number on the same token ids:

* ``vllm`` (default): ``/v1/completions`` of a vLLM server of the initial model with the token ids as the prompt,
  ``echo`` + ``logprobs`` and ``max_tokens: 0``: the server returns the prompt's log-probabilities. Requests
  carry many texts each and several run at once, so scoring rides on vLLM's batching. No Ray Serve, no ports
  of its own (docs/method.md D1, D6).
* ``hf``: a padding-aware batched forward pass with transformers in the calling process.

``bench/scoring.py`` compares both backends with a per-conversation HF forward pass.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optima.chat_spans import trained_char_spans
from optima.config.rules import vllm_loss_batch_size, workers
from optima.serving.client import prompt_logprobs

if TYPE_CHECKING:
    from optima.config import LoopRecipe

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossInput:
    """Token ids of one rendered utterance and the positions whose NLL is averaged."""

    input_ids: list[int]
    scored: list[int]


def build_loss_input(tokenizer: Any, text: str) -> LossInput:
    """Render ``text`` as a lone assistant message and find its content + end-of-turn token positions.

    Args:
        tokenizer: The initial model's (fast) tokenizer with its chat template.
        text: The utterance as stored (``Name: ...`` rendering is the caller's choice).
    """
    rendered, spans = trained_char_spans(tokenizer, [{"role": "assistant", "content": text}], tokenizer.eos_token)
    (start, end) = spans[0]
    encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    scored = [i for i, (s, e) in enumerate(offsets) if e > s and s >= start and e <= end and i > 0]
    return LossInput(ids, scored)


def mean_nll(logprobs: Sequence[float | None], scored: Sequence[int]) -> float:
    """Mean negative log-probability at ``scored`` positions (position i's log-probability given < i)."""
    values = [-logprobs[i] for i in scored if logprobs[i] is not None]
    if not values:
        return math.nan
    return sum(values) / len(values)


class VLLMLossScorer:
    """LM losses from a vLLM server's prompt log-probabilities.

    Args:
        base_urls: ``http://127.0.0.1:PORT/v1`` of each replica serving the initial model (batches alternate).
        model: Its served model name.
        tokenizer: The initial model's tokenizer.
        recipe: Supplies ``api_key``, ``request_timeout_s``, ``max_retries`` and ``thread_count``.
        batch_size: Texts per request (default ``optima.config.rules.vllm_loss_batch_size``).
    """

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
        """Mean NLL of each text."""
        with self.tokenizer_lock:
            inputs = [build_loss_input(self.tokenizer, t) for t in texts]
        batches = [inputs[i : i + self.batch_size] for i in range(0, len(inputs), self.batch_size)]
        with ThreadPoolExecutor(workers(self.recipe, len(batches))) as pool:
            results = list(pool.map(self._score_batch, enumerate(batches)))
        return [loss for batch in results for loss in batch]


class HFLossScorer:
    """LM losses from a batched transformers forward pass (fp32, right padding, pad positions ignored).

    Args:
        model_path: The initial model (hub id or folder).
        tokenizer: Its tokenizer.
        batch_size: Texts per forward pass (8 is the CPU sweet spot, docs/cpu.md#training-speed).
    """

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
        """Mean NLL of each text."""
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
