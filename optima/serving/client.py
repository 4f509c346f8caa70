"""The chat client of the served replicas: the ``openai`` client retries, we only fail over between replicas.

One ``openai.OpenAI`` client per replica (``request_timeout_s``, ``max_retries``: the SDK retries connection errors,
timeouts, 408/409/429 and 5xx with its own back-off), shared by all threads. Ours: a replica that still refuses
connections is marked dead and its requests go to the next live one (``NoReplicaLeft`` when none is left); any other
failure, or a reply that is not a chat completion, fails that request only (``RequestFailed``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from optima.config import Recipe

logger = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A chat request that failed for good (not retried, or retries exhausted)."""


class NoReplicaLeft(RuntimeError):
    """Every replica is dead (or the pool was stopped): generation cannot continue."""


class ServerStartupError(RuntimeError):
    """A server that died, did not answer ``/health`` in time, or holds the wrong weights (the message says which)."""


class ConstraintRejected(RuntimeError):
    """A server rejected or ignored a structured-output constraint (``check_structured_outputs``)."""


@dataclass(frozen=True)
class ChatReply:
    """One completion: text, ``finish_reason``, the server's token counts (None without usage; cached tokens need
    ``--enable-prompt-tokens-details``) and the replica that answered."""

    text: str
    finish_reason: str | None
    completion_tokens: int | None
    replica: int
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling: temperature, token limit, seed (None: none sent), vLLM's ``extra_body`` fields."""

    temperature: float
    max_tokens: int
    seed: int | None = None
    extra_body: dict | None = None


def server_root(api_url: str) -> str:
    """``http://h:p/v1`` -> ``http://h:p``: ``/health`` and vLLM's development routes live beside ``/v1``."""
    return api_url.rstrip("/").removesuffix("/v1")


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The headers of a request to a server started with an API key (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class ReplicaPool:
    """Clients of all replicas (``urls``; the recipe's ``served_model_name``, ``api_key``, ``request_timeout_s``,
    ``max_retries``), round-robin routing and fail-over."""

    def __init__(self, urls: Sequence[str], recipe: Recipe):
        import openai

        if not urls:
            raise ValueError("ReplicaPool needs at least one endpoint")
        self.urls, self.model, self.max_retries = list(urls), recipe.served_model_name, recipe.max_retries
        key, timeout = recipe.api_key or "EMPTY", recipe.request_timeout_s
        self.clients = [
            openai.OpenAI(base_url=u, api_key=key, timeout=timeout, max_retries=self.max_retries) for u in urls
        ]
        self.stop_event = threading.Event()
        self._dead: set[int] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.clients)

    @property
    def dead(self) -> set[int]:
        with self._lock:
            return set(self._dead)

    def route(self, key: int) -> int:
        """Replica for item ``key`` (round-robin), skipping dead replicas."""
        return self.next_alive(key % len(self.clients))

    def next_alive(self, start: int) -> int:
        """The first live replica from ``start`` on (cyclically)."""
        with self._lock:
            for step in range(len(self.clients)):
                replica = (start + step) % len(self.clients)
                if replica not in self._dead:
                    return replica
        raise NoReplicaLeft(f"all {len(self.clients)} replicas are dead: {self.urls}")

    def mark_dead(self, replica: int, reason: Exception) -> None:
        with self._lock:
            if replica in self._dead:
                return
            self._dead.add(replica)
        logger.warning("replica %d (%s) is unreachable, failing over: %s", replica, self.urls[replica], reason)

    def chat(self, replica: int, messages: Sequence[dict], sampling: Sampling) -> ChatReply:
        """One chat completion from ``replica``, or from the next live one if it refuses connections.

        Raises:
            RequestFailed: any other error (after the SDK's retries where it retries), or an unreadable reply.
            NoReplicaLeft: no live replica (or the pool is stopping).
        """
        import openai

        optional = {"seed": sampling.seed} if sampling.seed is not None else {}
        while True:
            replica = self.next_alive(replica)
            if self.stop_event.is_set():
                raise NoReplicaLeft("generation is stopping")
            try:
                response = self.clients[replica].chat.completions.create(
                    model=self.model,
                    messages=list(messages),
                    temperature=sampling.temperature,
                    max_tokens=sampling.max_tokens,
                    extra_body=sampling.extra_body,
                    **optional,
                )
                return _reply(response, replica, self.urls[replica])
            except ValueError as exc:  # a body that is not UTF-8 or not JSON: a broken reply, not a broken replica
                raise RequestFailed(f"replica {replica}: unreadable reply: {exc}") from exc
            except openai.APIConnectionError as exc:
                if isinstance(exc, openai.APITimeoutError):
                    raise RequestFailed(f"replica {replica}: {exc} (after {self.max_retries + 1} attempts)") from exc
                self.mark_dead(replica, exc)  # refused through every retry: the replica is gone
                replica += 1
            except openai.OpenAIError as exc:
                status = getattr(exc, "status_code", 0)
                retried = status in (408, 409, 429) or status >= 500  # what the SDK retries
                raise RequestFailed(
                    f"replica {replica}: {exc}" + (f" (after {self.max_retries + 1} attempts)" if retried else "")
                ) from exc

    def close(self) -> None:
        self.stop_event.set()
        for client in self.clients:
            client.close()


def _reply(response: Any, replica: int, url: str) -> ChatReply:
    if isinstance(response, str) or not response.choices:  # not JSON, or a completion without a choice
        raise RequestFailed(f"{url}: not a chat completion: {str(response)[:200]!r}")
    choice, usage = response.choices[0], response.usage
    details = usage.prompt_tokens_details if usage is not None else None
    # Lone surrogates (a "\udc80" escape in the JSON) cannot be written as UTF-8: replace them with "?".
    text = (choice.message.content or "").encode("utf-8", "replace").decode("utf-8")
    return ChatReply(
        text,
        choice.finish_reason,
        usage.completion_tokens if usage is not None else None,
        replica,
        prompt_tokens=usage.prompt_tokens if usage is not None else None,
        cached_tokens=details.cached_tokens if details is not None else None,
    )


def prompt_logprobs(client: Any, model: str, prompts: Sequence[Sequence[int]], top: int = 0) -> list[Any]:
    """The served log-probabilities of each prompt's tokens, nothing generated (one choice per prompt, in order):
    ``/v1/completions`` with token ids, ``echo`` and ``max_tokens: 0``. ``logprobs.token_logprobs`` holds each token's
    log-probability given the ones before (the first is None); ``top`` > 0 adds ``logprobs.top_logprobs``."""
    response = client.completions.create(
        model=model, prompt=[list(p) for p in prompts], max_tokens=0, echo=True, logprobs=top, temperature=0.0
    )
    return sorted(response.choices, key=lambda c: c.index)


PROBE_REPLY = "<A>ok</A>"  # the probe of check_structured_outputs: a constraint that admits one reply only


def regex_constraint(pattern: str) -> dict:
    """The request's extra body that constrains the reply to ``pattern`` (vLLM's structured outputs, vLLM >= 0.12)."""
    return {"structured_outputs": {"regex": pattern}}


def check_structured_outputs(pool: ReplicaPool) -> None:
    """Ask every replica for a reply constrained to ``PROBE_REPLY``; ``ConstraintRejected`` unless each returns
    exactly that (a server without structured outputs rejects or ignores the field: every constrained turn would be
    wrong, so the run stops before the first conversation)."""
    messages = [{"role": "user", "content": f"Reply with {PROBE_REPLY}"}]
    sampling = Sampling(0.0, 16, 0, regex_constraint(PROBE_REPLY))
    advice = "use a server with structured outputs (vLLM >= 0.12), or set answer_bootstrap: prefill or off"
    what = "the answer constraint (structured_outputs.regex, answer_bootstrap: grammar)"
    for replica, url in enumerate(pool.urls):
        try:
            text = pool.chat(replica, messages, sampling).text
        except RequestFailed as exc:
            raise ConstraintRejected(f"{url} rejected {what}: {exc}; {advice}") from exc
        if text != PROBE_REPLY:
            raise ConstraintRejected(
                f"{url} ignored {what}: asked for exactly {PROBE_REPLY!r}, got {text[:80]!r}; {advice}"
            )
