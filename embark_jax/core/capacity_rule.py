"""The bucket-sizing rule of routed (RB / UB) tables as pure arithmetic, shared by the runtime
(`embark_jax.sharding.capacity`, which sizes the padded all-to-all buffers) and the planner
(`embark_jax.planner.cost`, which prices exactly those buffers). numpy only, no JAX.
"""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = ["TAIL_PROBABILITY", "binomial_capacity", "bucket_slots"]

# Default sizing: P(requests from one source to one shard > its slots) below this.
TAIL_PROBABILITY = 1e-6
# Above this many requests the binomial tail is taken from its normal approximation (the
# exact sum needs O(n) memory; at these counts the two differ by a slot or so).
EXACT_MAX = 1 << 22


@functools.lru_cache(maxsize=1024)
def binomial_capacity(n: int, row_shards: int, tail: float = TAIL_PROBABILITY) -> int:
    """The least c with P(Binomial(n, 1/row_shards) > c) < tail (at most n).

    `n` requests, each to one of `row_shards` shards uniformly at random: the slots one
    shard needs so that it overflows with probability below `tail`. Small `n` get their
    worst case (n), large `n` about n/r + 5 standard deviations at the default tail.
    """
    if n <= 0:
        return 0
    if row_shards <= 1:
        return n
    p = 1.0 / row_shards
    if n > EXACT_MAX:
        return _normal_capacity(n, p, tail)
    k = np.arange(n + 1, dtype=np.float64)
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(k[1:]))])  # log(k!)
    log_pmf = log_fact[n] - log_fact - log_fact[::-1] + k * math.log(p) + (n - k) * math.log1p(-p)
    pmf = np.exp(log_pmf)
    above = np.cumsum(pmf[::-1])[::-1]  # above[c] = P(X >= c), summed from the small end
    # P(X > c) = above[c + 1]; the least c where it drops below `tail`
    over = np.append(above[1:], 0.0) >= tail
    return int(np.argmin(over)) if not over.all() else n


def bucket_slots(
    slots: list[int] | tuple[int, ...],
    factor: float | None,
    row_shards: int,
    most: int | None = None,
) -> int:
    """Slots for one source's requests to one row shard of a table.

    `slots` are the table's request slots per feature (their sum is the worst case), `most`
    an optional hard cap (e.g. the rows of the largest shard, for unique ids). Without a
    factor: the binomial tail of the total (exact worst case for a table-wise table). With
    one: `ceil(factor * slots / r)` per feature, each at most its worst case (an explicit
    override, which may be below the default).
    """
    worst = sum(slots)
    if factor is None:
        cap = binomial_capacity(worst, row_shards)
    else:
        cap = sum(min(n, math.ceil(factor * n / row_shards)) for n in slots)
    if most is not None:
        cap = min(cap, most)
    return max(1, min(worst, cap))


def _normal_capacity(n: int, p: float, tail: float) -> int:
    """`binomial_capacity` for large n: the normal quantile z of `tail` (by bisection on
    erfc), corrected for the binomial's skew (Cornish-Fisher), in standard deviations above
    the mean, rounded up, at most n."""
    lo, hi = 0.0, 40.0
    for _ in range(100):
        z = (lo + hi) / 2
        if 0.5 * math.erfc(z / math.sqrt(2.0)) > tail:
            lo = z
        else:
            hi = z
    sd = math.sqrt(n * p * (1.0 - p))
    z = hi + (hi * hi - 1.0) * (1.0 - 2.0 * p) / (6.0 * sd)
    return min(n, math.ceil(n * p + z * sd))
