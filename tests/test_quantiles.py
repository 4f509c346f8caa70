"""The two quantile rules: interpolation (the tree search's T_max) and nearest rank (the KV-cache prompt estimate)."""

from __future__ import annotations

import numpy
import pytest

from optima.agents.footprint import nearest_rank_quantile
from optima.reward import interpolated_quantile


@pytest.mark.parametrize(("values", "q", "expected"), [([], 0.9, 0), ([5], 0.9, 5), (list(range(1, 11)), 0.9, 9)])
def test_nearest_rank_quantile(values, q, expected):
    assert nearest_rank_quantile(values, q) == expected


@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.8, 0.85, 0.9, 1.0])
def test_interpolated_quantile_matches_numpy(q):
    values = [120, 7, 33, 33, 58, 240, 91, 15]
    assert interpolated_quantile(values, q) == pytest.approx(float(numpy.quantile(values, q)))


def test_the_two_rules_differ_where_they_should():
    """Nearest rank answers with one of the values; interpolation lands between two of them."""
    values = list(range(1, 11))
    assert nearest_rank_quantile(values, 0.85) == 9
    assert interpolated_quantile(values, 0.85) == pytest.approx(8.65)


@pytest.mark.parametrize(("values", "q", "message"), [([], 0.5, "at least one"), ([1], 1.5, "must be in")])
def test_interpolated_quantile_rejects_bad_input(values, q, message):
    with pytest.raises(ValueError, match=message):
        interpolated_quantile(values, q)
