"""A scripted OpenAI-compatible server (stdlib ``http.server``, 127.0.0.1, a thread) for deterministic tests.

It answers ``GET /health``, ``GET /v1/models`` and ``POST /v1/chat/completions``. Each chat request is recorded
(body and headers) and answered by ``respond(body) -> FakeReply``; the default responder makes Alice state the
answer ``<A>B</A>`` and Bob agree, so conversations stop after three utterances.

Like vLLM, it reports the model it was started with as ``root`` in ``/v1/models``, and with ``dev_mode`` (the
default, vLLM's ``VLLM_SERVER_DEV_MODE=1``) it has the development routes that reload weights in place: ``/pause``,
``/resume``, ``/collective_rpc`` (``reload_weights``), ``/reset_prefix_cache``, ``/update_weight_version`` and
``GET /weight_info``. Those requests go to ``dev_requests`` (reloads also to ``reloads``), not to ``requests``.

With a ``scorer`` it also answers ``POST /v1/completions`` with ``echo`` (the prompt scored, nothing generated) as
vLLM does: ``scorer(token_ids) -> (log-probability of each token, highest log-probability at each position)``,
the first of each None. The weights probe and the LM-loss scorer send that request.

    with FakeOpenAIServer() as server:            # server.base_url == "http://127.0.0.1:<port>/v1"
        ...
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SPEAKER = re.compile(r"^(Alice|Bob): ", re.MULTILINE)


@dataclass
class FakeReply:
    """What the fake server answers: a completion, or an HTTP error status."""

    content: str = ""
    finish_reason: str = "stop"
    completion_tokens: int | None = None  # None: one token per whitespace-separated word
    status: int = 200
    delay_s: float = 0.0
    usage: bool = True
    raw: bytes | None = None  # sent as the body (status 200) instead of a completion: broken replies


def speaker_of(body: dict) -> str:
    """Whose turn it is: the name in the system prompt's first line ("You are Alice...")."""
    return "Alice" if "Alice" in body["messages"][0]["content"].split(".")[0] else "Bob"


def turn_of(body: dict) -> int:
    """How many utterances the conversation already has (each is rendered as a line "Name: text")."""
    return sum(len(SPEAKER.findall(m["content"])) for m in body["messages"][1:])


def question_of(body: dict) -> str:
    """The task turn (first user message)."""
    return body["messages"][1]["content"]


def agreeing_reply(body: dict) -> FakeReply:
    """Alice answers B, Bob checks, Alice repeats B: stops after 3 utterances by the same-answer rule."""
    if speaker_of(body) == "Alice":
        return FakeReply("Alice: 2 + 2 = 4 so <A>B</A>")
    return FakeReply("Bob: looks right")


class _QuietServer(ThreadingHTTPServer):
    """No traceback when a client hangs up first (a timed-out request): that is what the tests provoke."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeOpenAIServer:
    """The scripted server; ``requests`` holds every chat request as ``(body, lower-cased headers)``.

    Args:
        respond: Maps a request body to a ``FakeReply``.
        model: The served model name.
        port: Port to bind (0: any free one).
        root: The model it reports as loaded (vLLM's ``root``); None: not reported.
        dev_mode: Whether it has vLLM's development routes (weights can be reloaded).
        metrics: Produces the Prometheus text of ``GET /metrics`` (None: 404, as a server that is not vLLM).
        scorer: Scores the token ids of an ``echo`` completion request (None: such requests go to ``respond``).
    """

    def __init__(
        self,
        respond: Callable[[dict], FakeReply] = agreeing_reply,
        model: str = "optima",
        port: int = 0,
        root: str | None = None,
        dev_mode: bool = True,
        metrics: Callable[[], str] | None = None,
        scorer: Callable[[list[int]], tuple[list, list]] | None = None,
    ):
        self.respond, self.model, self.root, self.dev_mode = respond, model, root, dev_mode
        self.scorer = scorer
        self.metrics = metrics
        self.weight_version = "default"
        self.reloads: list[str] = []
        self.fail_reload = False  # True: reload_weights answers HTTP 500, as vLLM does for an unreadable path
        self.requests: list[tuple[dict, dict]] = []
        self.dev_requests: list[tuple[dict, dict]] = []  # development-endpoint requests (not in ``requests``)
        self.posts: list[str] = []  # path and query of every POST, in order (sleep-mode and RPC requests)
        self._lock = threading.Lock()
        self._httpd = _QuietServer(("127.0.0.1", port), self._handler_class())
        self.port = self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    def bodies(self) -> list[dict]:
        with self._lock:
            return [body for body, _ in self.requests]

    def _record(self, body: dict, headers: dict) -> None:
        with self._lock:
            self.requests.append((body, headers))

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/v1/models":
                    card = {"id": server.model, "object": "model"} | ({"root": server.root} if server.root else {})
                    self._send(200, {"object": "list", "data": [card]})
                elif self.path == "/weight_info" and server.dev_mode:
                    self._send(200, {"weight_version": server.weight_version})
                elif self.path == "/metrics" and server.metrics is not None:
                    data = server.metrics().encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else {}
                with server._lock:
                    server.posts.append(self.path)
                if not self.path.startswith("/v1/"):  # a development endpoint (/sleep, /collective_rpc, ...)
                    with server._lock:
                        server.dev_requests.append((body, {k.lower(): v for k, v in self.headers.items()}))
                    status, payload = server.dev_route(self.path.split("?")[0], body)
                    self._send(status, payload)
                    return
                server._record(body, {k.lower(): v for k, v in self.headers.items()})
                if self.path == "/v1/completions" and body.get("echo") and server.scorer is not None:
                    self._send(200, scored_completion(body, server.scorer))
                    return
                reply = server.respond(body)
                if reply.delay_s:
                    time.sleep(reply.delay_s)  # a slow "model"
                if reply.raw is not None:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(reply.raw)))
                    self.end_headers()
                    self.wfile.write(reply.raw)
                    return
                if reply.status != 200:
                    self._send(reply.status, {"error": {"message": f"scripted {reply.status}"}})
                    return
                self._send(200, completion(body, reply))

        return Handler

    def dev_route(self, path: str, body: dict) -> tuple[int, dict]:
        """vLLM's development routes (reload, sleep mode, ...); 404 without ``dev_mode``."""
        if not self.dev_mode:
            return 404, {"detail": "Not Found"}
        if path == "/update_weight_version":
            self.weight_version = body["new_version"]
        elif path == "/collective_rpc" and body.get("method") == "reload_weights":
            if self.fail_reload:
                return 500, {"error": f"cannot load {body['kwargs']['weights_path']}"}
            with self._lock:
                self.reloads.append(body["kwargs"]["weights_path"])
        return 200, {"success": True} if path == "/reset_prefix_cache" else {"status": "ok"}

    def start(self) -> FakeOpenAIServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def completion(body: dict, reply: FakeReply) -> dict:
    """The chat.completion JSON of ``reply``."""
    tokens = reply.completion_tokens if reply.completion_tokens is not None else len(reply.content.split())
    usage = {"prompt_tokens": 10, "completion_tokens": tokens, "total_tokens": 10 + tokens} if reply.usage else None
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": body.get("model"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply.content},
                "finish_reason": reply.finish_reason,
            }
        ],
        "usage": usage,
    }


def scored_completion(body: dict, scorer: Callable[[list[int]], tuple[list, list]]) -> dict:
    """The text_completion JSON of an ``echo`` request with token-id prompts: each prompt scored, nothing generated.

    ``top_logprobs`` maps token text to log-probability, as vLLM's: here ``"<id>"`` of the scored token, plus
    ``"best"`` with the highest log-probability when another token is more likely.
    """
    choices = []
    for index, ids in enumerate(body["prompt"]):
        logprobs, best = scorer(list(ids))
        tops = [
            None if lp is None else {str(token): lp} | ({"best": top} if top > lp else {})
            for token, lp, top in zip(ids, logprobs, best, strict=True)
        ]
        choices.append(
            {
                "index": index,
                "text": "",
                "finish_reason": "length",
                "logprobs": {
                    "tokens": [str(token) for token in ids],
                    "token_logprobs": logprobs,
                    "top_logprobs": tops,
                    "text_offset": list(range(len(ids))),
                },
            }
        )
    usage = {"prompt_tokens": sum(len(p) for p in body["prompt"]), "completion_tokens": 0}
    return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": body.get("model"),
            "choices": choices, "usage": usage | {"total_tokens": usage["prompt_tokens"]}}  # fmt: skip
