"""External endpoints (recipe ``endpoints``): which model each one holds, checked before every stage that uses it.

A run that samples from servers it did not start must still sample from the model each stage needs (the current
checkpoint for generation and search, the loss model for scoring, each checkpoint of an evaluation sweep);
otherwise training silently stops being on-policy from iteration 1 on. Before each such stage, every endpoint is
asked what it holds and compared with what the stage needs:

* ``GET /v1/models``: the entry whose ``id`` is ``served_model_name``; vLLM reports in ``root`` the model the
  server was started with.
* ``GET /weight_info`` (vLLM's development routes, present when the server runs with ``VLLM_SERVER_DEV_MODE=1``):
  the weight version. vLLM never changes ``root`` when weights are reloaded in place, so every reload made here
  leaves its own record in the server: the weight version ``optima:<path>#<weights id>``. The record lives as long
  as the server's engine: a restarted server reports ``default`` again and is judged by its ``root``. While a reload
  runs the version is ``optima-reloading:<path>``, so a reload that failed half-way leaves weights that match nothing.

A path says where weights lie, not which: a stage redone in place writes new weights under the same path. So an
endpoint holds the needed model only when the weights id it was loaded with is the one the checkpoint has now
(``optima.identity.model_identity``: the completion marker's ``weights_id``). A server started with the path
itself (version ``default``) carries no id: when the checkpoint has a recorded weights probe, the server must
answer it (``optima.serving.reload_check``), else it is reloaded. Every reload made here is probed the same way.

On a mismatch, with ``endpoint_sync: reload`` (the default) and a server that has the development routes, the
needed weights are loaded into the running server: ``POST /pause?mode=wait`` (in-flight requests finish),
``POST /collective_rpc`` with ``reload_weights(weights_path=<path>)`` (every worker loads the checkpoint in
place), ``POST /reset_prefix_cache`` (cached KV blocks were computed by the old weights), the new weight version,
``POST /resume``; then the endpoint is read again and must report the needed model. Anything else (no development
routes, ``endpoint_sync: check``, a failed reload) stops the run with one error that names the endpoint, what it
holds and what the stage needs. ``endpoint_sync: off`` checks only ``served_model_name``.

Limits, by construction: an in-place reload needs the same architecture and tensor shapes (an Optima checkpoint
of the served base model, merged, not a LoRA adapter) and a path the server's machine can read; the check trusts
the server's ``root``, the version record and the probe (a base model without a completion marker has no probe:
its path and folder hash are trusted); two runs that share endpoints while needing different models would reload
them back and forth.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optima.identity import model_identity, read_probe
from optima.serving.reload_check import check_served_weights, probe_mismatch
from optima.serving.sleep_mode import reload_rpc
from optima.serving.vllm_server import ServerStartupError, auth_headers, server_root

if TYPE_CHECKING:
    from optima.config import Recipe

logger = logging.getLogger(__name__)

MARK = "optima:"  # weight version after a reload made here: optima:<path>#<weights id>
ID_SEPARATOR = "#"
RELOADING = "optima-reloading:"  # weight version while a reload runs: matches no model
VLLM_DEFAULT_VERSION = "default"  # vLLM's weight version until someone sets one
PROBE_TIMEOUT_S = 10.0


class EndpointMismatch(ServerStartupError):
    """An endpoint holds another model than the stage needs and was not (or could not be) reloaded."""


def normalize_base_url(url: str) -> str:
    """``http://h:8000`` and ``http://h:8000/v1/`` -> ``http://h:8000/v1``; other paths are kept."""
    url = url.rstrip("/")
    scheme, _, rest = url.partition("://")
    return url if "/" in rest else f"{url}/v1"


@dataclass(frozen=True)
class Holding:
    """What one endpoint serves now.

    Args:
        url: Its OpenAI base URL.
        names: Model ids it answers to (``/v1/models``).
        root: The model it was started with (vLLM's ``root``; None when the server does not say).
        version: Its weight version (None: the server has no development routes, so nobody reloaded it over HTTP).
    """

    url: str
    names: tuple[str, ...]
    root: str | None
    version: str | None

    @property
    def reloadable(self) -> bool:
        return self.version is not None

    @property
    def model(self) -> str | None:
        """The model whose weights it holds; None when that cannot be told."""
        if self.version is not None and self.version.startswith(MARK):
            return self._mark()[0]
        if self.version in (None, VLLM_DEFAULT_VERSION):
            return self.root
        return None  # a reload of ours that did not finish, or weights another client pushed

    @property
    def weights_id(self) -> str | None:
        """The weights id a reload made here loaded (None: the server does not say, e.g. it holds its root)."""
        if self.version is None or not self.version.startswith(MARK):
            return None
        return self._mark()[1]

    def _mark(self) -> tuple[str, str | None]:
        """(path, weights id) of our version record ``optima:<path>#<id>``; an id-less record has no id."""
        path, separator, weights_id = self.version.removeprefix(MARK).rpartition(ID_SEPARATOR)
        return (path, weights_id or None) if separator else (weights_id, None)

    def holds(self, needed: str, identity: str) -> bool:
        """True when it holds ``needed`` with the weights ``identity`` names (unknown ids: the path decides)."""
        return same_model(self.model, needed) and self.weights_id in (None, identity)

    def describe(self) -> str:
        """What it holds, in words (for errors and logs)."""
        version = self.version or ""
        if version.startswith(MARK):
            weights = f", weights {self.weights_id}" if self.weights_id else ""
            return f"{self.model} (reloaded in place{weights}; started with {self.root})"
        if version.startswith(RELOADING):
            return f"unknown weights (a reload of {version.removeprefix(RELOADING)} did not finish)"
        if self.model is None and self.root is not None:
            return f"weights of version {version!r} pushed by another client (started with {self.root})"
        if self.root is None:
            return "a model it does not name (no 'root' in its /v1/models answer)"
        return self.root


def same_model(held: str | None, needed: str) -> bool:
    """True when ``held`` (as the server names it) and ``needed`` are the same model.

    Equal names match; two existing local paths match when they are the same folder (relative or symlinked
    spellings). Hub ids match only by name.
    """
    if held is None:
        return False
    if held.rstrip("/") == needed.rstrip("/"):
        return True
    try:
        return os.path.samefile(held, needed)
    except OSError:
        return False


def read_holding(session, url: str, served_name: str) -> Holding | None:
    """Ask ``url`` what it serves; None when it does not answer ``/models`` (logged).

    Raises:
        ServerStartupError: it answers, but not to ``served_name``.
    """
    import requests

    try:
        response = session.get(f"{url}/models", timeout=PROBE_TIMEOUT_S)
        response.raise_for_status()
        cards = [card for card in response.json().get("data", []) if isinstance(card, dict)]
    except (requests.ConnectionError, requests.Timeout, requests.HTTPError, ValueError, AttributeError) as exc:
        logger.warning("endpoint %s does not answer /models (%s); not used", url, exc)
        return None
    names = tuple(str(card.get("id")) for card in cards)
    if served_name not in names:
        raise ServerStartupError(f"endpoint {url} serves {list(names)}, not served_model_name={served_name!r}")
    root = next(card.get("root") for card in cards if card.get("id") == served_name)
    return Holding(url, names, root, read_weight_version(session, server_root(url)))


def read_weight_version(session, root_url: str) -> str | None:
    """vLLM's weight version (``GET /weight_info``); None when the server has no development routes."""
    import requests

    try:
        response = session.get(f"{root_url}/weight_info", timeout=PROBE_TIMEOUT_S)
    except (requests.ConnectionError, requests.Timeout):
        return None
    if response.status_code != 200:
        return None
    version = response.json().get("weight_version")
    return None if version is None else str(version)


def mismatch(holding: Holding, needed: str, why: str) -> EndpointMismatch:
    return EndpointMismatch(f"endpoint {holding.url} holds {holding.describe()}, but this stage needs {needed}; {why}")


def _post(session, holding: Holding, path: str, timeout_s: float, **kwargs):
    """POST to a development route; any answer but 200 fails the reload."""
    response = session.post(f"{server_root(holding.url)}{path}", timeout=timeout_s, **kwargs)
    if response.status_code != 200:
        raise RuntimeError(f"{path} answered HTTP {response.status_code}: {response.text[:300]}")
    return response


def reload_weights(session, holding: Holding, needed: str, recipe: Recipe) -> Holding:
    """Load ``needed`` into the running server of ``holding`` (pause, reload in place, reset caches, resume).

    Args:
        session: ``requests.Session`` carrying the API key.
        holding: The endpoint as read just before.
        needed: The model to load (a path the server's machine can read).
        recipe: Its ``served_model_name`` and ``server_startup_timeout_s`` (deadline of each step).

    Raises:
        EndpointMismatch: a step failed, or the server does not report ``needed`` afterwards.
        WeightsMismatch: the reloaded server does not answer the checkpoint's weights probe.
    """
    import requests

    timeout_s, started = recipe.server_startup_timeout_s, time.monotonic()
    identity = model_identity(needed)
    logger.info("endpoint %s holds %s; loading %s into it", holding.url, holding.describe(), needed)
    try:
        _post(session, holding, "/pause", timeout_s, params={"mode": "wait"})
        try:
            _post(session, holding, "/update_weight_version", timeout_s, json={"new_version": RELOADING + needed})
            _post(session, holding, "/collective_rpc", timeout_s, json=reload_rpc(needed, timeout_s))
            # Prefix-cache hits would reuse keys and values that the old weights computed.
            reset = _post(session, holding, "/reset_prefix_cache", timeout_s, params={"reset_running_requests": 1})
            if reset.json().get("success") is False:
                raise RuntimeError("/reset_prefix_cache did not empty the prefix cache")
            version = MARK + needed + ID_SEPARATOR + identity
            _post(session, holding, "/update_weight_version", timeout_s, json={"new_version": version})
        finally:
            _post(session, holding, "/resume", timeout_s)
    except (RuntimeError, ValueError, requests.RequestException) as exc:
        why = f"loading it failed ({exc}); the path must be readable on the server's machine and hold weights of the "
        raise mismatch(holding, needed, why + "served architecture") from exc
    after = read_holding(session, holding.url, recipe.served_model_name)
    if after is None or not after.holds(needed, identity):
        raise mismatch(after or holding, needed, "it does not report the needed model after the reload")
    check_served_weights([holding.url], needed, recipe, served_dtype=None, when="an in-place reload")
    logger.info("endpoint %s now holds %s (reload took %.0f s)", holding.url, needed, time.monotonic() - started)
    return after


def stale_by_probe(holding: Holding, needed: str, recipe: Recipe) -> str | None:
    """Why an endpoint that names ``needed`` does not hold its weights now (None: it does, as far as can be told).

    A reload made here recorded the weights id (compared already). A server started with the path records none: the
    checkpoint may have been rewritten since, so it must answer the checkpoint's weights probe, when there is one.
    """
    probe = read_probe(needed) if holding.weights_id is None and os.path.isdir(needed) else None
    if probe is None:
        return None
    problem = probe_mismatch(holding.url, probe, recipe, served_dtype=None)
    return None if problem is None else f"it does not answer the weights probe of {needed} ({problem})"


def sync_endpoints(urls: Sequence[str], recipe: Recipe, needed: str) -> list[str]:
    """The endpoints that answer, each made to hold ``needed`` (or the run stops).

    Args:
        urls: OpenAI base URLs (normalised).
        recipe: ``served_model_name``, ``api_key``, ``endpoint_sync``, ``server_startup_timeout_s``.
        needed: The model the stage samples from or scores with (folder or hub id).

    Raises:
        EndpointMismatch: an endpoint holds another model and is not reloaded (see the module docstring).
        ServerStartupError: none answers, or one does not answer to ``served_model_name``.
    """
    import requests

    # The server resolves the path in its own working directory: send it absolute.
    needed = os.path.abspath(needed) if os.path.exists(needed) else str(needed)
    identity = model_identity(needed)
    session = requests.Session()
    session.headers.update(auth_headers(recipe.api_key))
    alive = []
    with session:
        for url in urls:
            holding = read_holding(session, url, recipe.served_model_name)
            if holding is None:
                continue
            if recipe.endpoint_sync == "off":
                alive.append(url)
                continue
            stale = stale_by_probe(holding, needed, recipe) if holding.holds(needed, identity) else "reload"
            if stale is None:
                alive.append(url)
                continue
            refuse_reload(holding, needed, recipe, "" if stale == "reload" else stale + "; ")
            reload_weights(session, holding, needed, recipe)
            alive.append(url)
    if not alive:
        raise ServerStartupError(f"none of the endpoints answers: {list(urls)}")
    if recipe.endpoint_sync == "off":
        logger.warning("endpoint_sync: off: the model the endpoints hold is not compared with %s", needed)
    return alive


def refuse_reload(holding: Holding, needed: str, recipe: Recipe, stale: str) -> None:
    """Stop the run when an endpoint that does not hold ``needed`` may not, or cannot, be reloaded with it.

    Args:
        holding: The endpoint as read.
        needed: The model the stage needs.
        recipe: Its ``endpoint_sync``.
        stale: Why an endpoint that names ``needed`` does not hold it (ends with "; "), or "".
    """
    if recipe.endpoint_sync == "check":
        raise mismatch(holding, needed, stale + "endpoint_sync: check does not reload (restart it with that model)")
    if not holding.reloadable and holding.root is None:
        why = "it does not say which model it serves (not vLLM?); endpoint_sync: off uses it unchecked"
        raise mismatch(holding, needed, why)
    if os.path.isabs(needed) and not os.path.isdir(needed):
        # vLLM puts the layers on the meta device before it reads the files: a failed read breaks the server.
        raise mismatch(holding, needed, "that folder does not exist here, so it is not sent to the server")
    if not holding.reloadable:
        why = stale + "it cannot load weights at run time (start it with VLLM_SERVER_DEV_MODE=1 to let Optima "
        raise mismatch(holding, needed, why + "reload them, or restart it with that model)")
