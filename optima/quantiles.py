"""The two quantile rules of the project, side by side, because each decides a different number.

* ``interpolated_quantile``: linear interpolation between the two nearest ranks (numpy's default). The tree search's
  ``T_max`` (``optima.reward.token_quantile``) is built on it; it decides which rollouts are rewarded, so the
  training data, and must not change.
* ``nearest_rank_quantile``: the smallest value with at least ``q`` of the values at or below it, always one of the
  values. The KV-cache estimate of a conversation's prompt (``optima.agents.footprint``) uses it: a prompt that
  exists, in whole tokens, sets how many conversations a server holds at once.

Pure: no process, no file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def interpolated_quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by linear interpolation (numpy's default ``method="linear"``).

    Args:
        values: At least one number (any order).
        q: The quantile in [0, 1].
    """
    if not values:
        raise ValueError("interpolated_quantile needs at least one value")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q!r}")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def nearest_rank_quantile(values: Iterable[int], q: float) -> int:
    """The ``q`` quantile of ``values`` by nearest rank: the value at rank ``ceil(q * n)`` (0 for no values)."""
    ordered = sorted(values)
    if not ordered:
        return 0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
