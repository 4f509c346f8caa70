"""Chat clients for the served replicas: capped retries with backoff, and failover when a replica dies.

A failed call never silently loses its question (docs/method.md D5). Each endpoint gets one ``openai.OpenAI``
client (SDK retries off, our own policy on top), shared by all threads:

* transient failures (connection errors, timeouts, HTTP 429 and 5xx) are retried ``max_retries`` times with
  exponential backoff;
* a replica that still refuses connections after that is marked dead and the request moves to the next live
  replica (``NoReplicaLeft`` when none is left: the run stops, nothing is recorded as a failed sample);
* other failures (HTTP 4xx: prompt too long for the context, bad request) raise ``RequestFailed`` at once.
* a reply that is not a readable chat completion (not UTF-8, not JSON, no choice) raises ``RequestFailed`` too;
  lone surrogates in the text are replaced (they could not be written to the UTF-8 JSONL).

Backoff waits on ``ReplicaPool.stop_event``, so a shutdown interrupts them instead of sleeping through.

``prompt_logprobs`` is the other request a server answers: the log-probabilities of given token ids, nothing
generated (the LM loss, ``optima.lm_loss``, and the reload check, ``optima.serving.reload_check``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from optima.config import Recipe

logger = logging.getLogger(__name__)

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 8.0


class RequestFailed(Exception):
    """A chat request that failed for good (non-transient error, or retries exhausted)."""


class NoReplicaLeft(RuntimeError):
    """Every replica is dead (or the pool was stopped): generation cannot continue."""


class ConstraintRejected(RuntimeError):
    """A server rejected or ignored a structured-output constraint (``check_structured_outputs``)."""


@dataclass(frozen=True)
class ChatReply:
    """One completion.

    Args:
        text: The generated content ("" when the server returned none).
        finish_reason: ``stop``, ``length``, ... as the server says.
        completion_tokens: Generated tokens counted by the server (None if it sent no usage).
        replica: Index of the replica that answered.
        prompt_tokens: Prompt tokens counted by the server (None without usage).
        cached_tokens: Of those, tokens read from its prefix cache (vLLM sends them with
            ``--enable-prompt-tokens-details``; None otherwise).
    """

    text: str
    finish_reason: str | None
    completion_tokens: int | None
    replica: int
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling parameters.

    Args:
        temperature: Sampling temperature.
        max_tokens: Generated tokens at most.
        seed: Per-request seed (reproducible sampling whatever the batching), or None.
        extra_body: vLLM extensions (``continue_final_message``, ``chat_template_kwargs``, ...).
    """

    temperature: float
    max_tokens: int
    seed: int | None = None
    extra_body: dict | None = None


def _is_transient(exc: Exception) -> bool:
    import openai

    if isinstance(exc, openai.APIConnectionError):  # includes APITimeoutError
        return True
    return isinstance(exc, openai.APIStatusError) and (exc.status_code == 429 or exc.status_code >= 500)


def _is_connection_refused(exc: Exception) -> bool:
    import openai

    return isinstance(exc, openai.APIConnectionError) and not isinstance(exc, openai.APITimeoutError)


class ChatClient:
    """One OpenAI-compatible endpoint.

    Args:
        base_url: ``http://host:port/v1``.
        model: Served model name.
        api_key: Key for the server (None: ``"EMPTY"``).
        timeout_s: Timeout of one request.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None, timeout_s: float):
        import openai

        self.base_url = base_url
        self.model = model
        self._client = openai.OpenAI(base_url=base_url, api_key=api_key or "EMPTY", timeout=timeout_s, max_retries=0)

    def chat(self, messages: Sequence[dict], sampling: Sampling) -> ChatReply:
        """One chat completion (no retry here); ``replica`` is left at -1 for the pool to fill."""
        optional = {"seed": sampling.seed} if sampling.seed is not None else {}
        response = self._client.chat.completions.create(
            model=self.model,
            messages=list(messages),
            temperature=sampling.temperature,
            max_tokens=sampling.max_tokens,
            extra_body=sampling.extra_body,
            **optional,
        )
        if isinstance(response, str) or not response.choices:  # not JSON, or a completion without a choice
            raise RequestFailed(f"{self.base_url}: not a chat completion: {str(response)[:200]!r}")
        choice = response.choices[0]
        usage = response.usage
        details = usage.prompt_tokens_details if usage is not None else None
        # Lone surrogates (a "\udc80" escape in the JSON) cannot be written as UTF-8: replace them with "?".
        text = (choice.message.content or "").encode("utf-8", "replace").decode("utf-8")
        return ChatReply(
            text,
            choice.finish_reason,
            usage.completion_tokens if usage is not None else None,
            replica=-1,
            prompt_tokens=usage.prompt_tokens if usage is not None else None,
            cached_tokens=details.cached_tokens if details is not None else None,
        )

    def close(self) -> None:
        self._client.close()


class ReplicaPool:
    """Clients of all replicas, with routing, retries and failover.

    Args:
        urls: Base URLs of the replicas.
        recipe: Its ``served_model_name``, ``api_key``, ``request_timeout_s`` and ``max_retries``.
        backoff_s: First backoff delay; it doubles per retry up to ``BACKOFF_MAX_S``.
    """

    def __init__(self, urls: Sequence[str], recipe: Recipe, backoff_s: float = BACKOFF_FIRST_S):
        if not urls:
            raise ValueError("ReplicaPool needs at least one endpoint")
        self.clients = [
            ChatClient(u, recipe.served_model_name, recipe.api_key, recipe.request_timeout_s) for u in urls
        ]
        self.max_retries = recipe.max_retries
        self.backoff_s = backoff_s
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
        raise NoReplicaLeft(f"all {len(self.clients)} replicas are dead: {[c.base_url for c in self.clients]}")

    def mark_dead(self, replica: int, reason: Exception) -> None:
        with self._lock:
            if replica in self._dead:
                return
            self._dead.add(replica)
        logger.warning(
            "replica %d (%s) is unreachable, failing over: %s", replica, self.clients[replica].base_url, reason
        )

    def chat(self, replica: int, messages: Sequence[dict], sampling: Sampling) -> ChatReply:
        """Send one request to ``replica`` (or, if it dies, to the next live one).

        Raises:
            RequestFailed: a non-transient error, or transient errors beyond ``max_retries``.
            NoReplicaLeft: no live replica (or the pool is stopping).
        """
        replica = self.next_alive(replica)
        while True:
            try:
                return dataclasses.replace(self._chat_with_retries(replica, messages, sampling), replica=replica)
            except _ReplicaDown as down:
                self.mark_dead(replica, down.__cause__)
                replica = self.next_alive(replica + 1)

    def _chat_with_retries(self, replica: int, messages: Sequence[dict], sampling: Sampling):
        import openai

        delay = self.backoff_s
        for attempt in range(self.max_retries + 1):
            if self.stop_event.is_set():
                raise NoReplicaLeft("generation is stopping")
            if replica in self.dead:
                raise _ReplicaDown()  # another request found it dead meanwhile: no need to retry it
            try:
                return self.clients[replica].chat(messages, sampling)
            except ValueError as exc:  # a body that is not UTF-8 or not JSON: a broken reply, not a broken replica
                raise RequestFailed(f"replica {replica}: unreadable reply: {exc}") from exc
            except openai.OpenAIError as exc:
                if not _is_transient(exc):
                    raise RequestFailed(f"replica {replica}: {exc}") from exc
                if attempt == self.max_retries:
                    if _is_connection_refused(exc):
                        raise _ReplicaDown() from exc
                    raise RequestFailed(f"replica {replica}: {exc} (after {attempt + 1} attempts)") from exc
                logger.debug("replica %d: %s; retry %d in %.1f s", replica, exc, attempt + 1, delay)
            # Backoff between retries; a shutdown (stop_event) ends it early.
            self.stop_event.wait(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.stop_event.set()
        for client in self.clients:
            client.close()


class _ReplicaDown(Exception):
    """Internal: the replica refused connections through every retry."""


def prompt_logprobs(client: Any, model: str, prompts: Sequence[Sequence[int]], top: int = 0) -> list[Any]:
    """The served log-probabilities of each prompt's tokens, nothing generated (one choice per prompt, in order).

    ``/v1/completions`` with the token ids as prompts, ``echo`` and ``max_tokens: 0``: each choice's
    ``logprobs.token_logprobs`` holds the log-probability of every prompt token given the ones before it (the first
    is None), and with ``top`` > 0 ``logprobs.top_logprobs`` the ``top`` most likely tokens at each position.

    Args:
        client: An ``openai.OpenAI`` client of the server.
        model: Its served model name.
        prompts: Token ids of each prompt.
        top: Alternatives per position.
    """
    response = client.completions.create(
        model=model, prompt=[list(p) for p in prompts], max_tokens=0, echo=True, logprobs=top, temperature=0.0
    )
    return sorted(response.choices, key=lambda c: c.index)


# The probe of ``check_structured_outputs``: a constraint that admits one reply only.
PROBE_REPLY = "<A>ok</A>"


def regex_constraint(pattern: str) -> dict:
    """The request's extra body that constrains the reply to ``pattern`` (vLLM's structured outputs, vLLM >= 0.12)."""
    return {"structured_outputs": {"regex": pattern}}


def check_structured_outputs(pool: ReplicaPool) -> None:
    """Ask every replica for a reply constrained to ``PROBE_REPLY``; raise unless each returns exactly that.

    A server without structured outputs rejects the request (an error) or ignores the field (a free reply): either
    way every constrained turn would be wrong, so the run stops before the first conversation.

    Raises:
        ConstraintRejected: naming the endpoint, what it answered and what to do.
    """
    messages = [{"role": "user", "content": f"Reply with {PROBE_REPLY}"}]
    sampling = Sampling(0.0, 16, 0, regex_constraint(PROBE_REPLY))
    advice = "use a server with structured outputs (vLLM >= 0.12), or set answer_bootstrap: prefill or off"
    for replica, client in enumerate(pool.clients):
        try:
            text = pool.chat(replica, messages, sampling).text
        except RequestFailed as exc:
            raise ConstraintRejected(
                f"{client.base_url} rejected the answer constraint (structured_outputs.regex, answer_bootstrap: "
                f"grammar): {exc}; {advice}"
            ) from exc
        if text != PROBE_REPLY:
            raise ConstraintRejected(
                f"{client.base_url} ignored the answer constraint (structured_outputs.regex, answer_bootstrap: "
                f"grammar): asked for exactly {PROBE_REPLY!r}, got {text[:80]!r}; {advice}"
            )
