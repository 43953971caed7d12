"""The bucket-sizing rule: the exact binomial tail for counts up to `EXACT_MAX`, and above it
a skew-corrected normal quantile that stays within a slot or two above the exact one and
takes no memory (a huge batch must not allocate an array per request)."""

import math
import time

import pytest

from embark_jax.core.capacity_rule import EXACT_MAX, _normal_capacity, binomial_capacity


@pytest.mark.parametrize("n", [10_000, 100_000, EXACT_MAX])
@pytest.mark.parametrize("r", [2, 8, 64, 1024])
def test_the_approximation_covers_the_exact_tail(n, r):
    exact = binomial_capacity(n, r)
    approx = _normal_capacity(n, 1.0 / r, 1e-6)
    assert exact <= approx <= exact + 2, (exact, approx)


def test_a_huge_count_is_sized_at_once():
    n = 10**15
    t0 = time.perf_counter()
    cap = binomial_capacity(n, 8)
    assert time.perf_counter() - t0 < 1.0
    mean, sd = n / 8, math.sqrt(n / 8 * 7 / 8)
    assert mean + 4.5 * sd < cap < mean + 5.5 * sd
    assert binomial_capacity(EXACT_MAX + 1, 8) == _normal_capacity(EXACT_MAX + 1, 1 / 8, 1e-6)


def test_small_counts_get_their_worst_case():
    assert binomial_capacity(5, 4) == 5
    assert binomial_capacity(0, 4) == 0 and binomial_capacity(7, 1) == 7
