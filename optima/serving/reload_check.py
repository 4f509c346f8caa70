"""Check that a server holds a checkpoint's weights after a wake or an in-place reload (``optima.identity``).

Called after every wake with new weights (GPU sleep mode, a CPU server kept through training,
``optima.serving.sleep_mode``) and after every reload of an external endpoint (``optima.serving.endpoints``),
which also uses it to tell whether an endpoint started with a checkpoint's path still holds what that path holds
now. The served model scores the recorded probe's token ids with the LM-loss scorer's request
(``optima.serving.client.prompt_logprobs``); a mismatch stops the run, naming the server and the checkpoint.

A folder without a recorded probe (a base model, or a checkpoint written before probes existed) is not checked:
its reload is logged as unchecked.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from optima.config.rules import vllm_dtype_arg
from optima.identity import Probe, compare_probe, read_probe, tolerance_for
from optima.serving.client import prompt_logprobs
from optima.serving.vllm_server import ServerStartupError

if TYPE_CHECKING:
    from optima.config import Recipe

logger = logging.getLogger(__name__)


class WeightsMismatch(ServerStartupError):
    """A server answers the probe unlike the checkpoint it should hold."""


def served_dtype(recipe: Recipe, on_cpu: bool) -> str | None:
    """``float32`` for Optima's own CPU servers (``build_serve_command`` passes ``--dtype float32``), else None.

    None stands for "half precision or unknown" (a GPU server's ``auto`` is the checkpoint's bf16; an external
    endpoint does not say); a ``--dtype`` in ``vllm_extra_args`` overrides ours, so it makes the dtype unknown too.
    """
    overridden = vllm_dtype_arg(recipe.vllm_extra_args) is not None
    return "float32" if on_cpu and not overridden else None


def probe_server(url: str, probe: Probe, recipe: Recipe) -> tuple[list, list]:
    """(log-probability of each probe token, highest log-probability at each position) as ``url`` serves them.

    Args:
        url: OpenAI base URL of the server.
        probe: The recorded probe.
        recipe: ``served_model_name``, ``api_key``, ``request_timeout_s``, ``max_retries``.
    """
    from openai import OpenAI

    key, timeout_s = recipe.api_key or "EMPTY", recipe.request_timeout_s
    client = OpenAI(base_url=url, api_key=key, timeout=timeout_s, max_retries=recipe.max_retries)
    with client:
        (choice,) = prompt_logprobs(client, recipe.served_model_name, [probe.input_ids], top=1)
    served = list(choice.logprobs.token_logprobs)
    # top_logprobs maps token text -> log-probability (the scored token and the best one): the best is the highest.
    top = [max(alternatives.values()) if alternatives else None for alternatives in choice.logprobs.top_logprobs]
    return served, top


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
):
    """Every server in ``urls`` answers the probe recorded with ``checkpoint``, or the run stops.

    Args:
        urls: OpenAI base URLs that should serve ``checkpoint`` now.
        checkpoint: The checkpoint folder (its completion marker holds the probe).
        recipe: Serving fields (see ``probe_server``).
        served_dtype: ``float32`` when the servers are known to compute in fp32 (CPU), else None.
        when: What just happened, for the message (``wake``, ``reload``).

    Raises:
        WeightsMismatch: naming the server, the checkpoint and the difference.
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
