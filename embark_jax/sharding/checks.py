"""Host-side checks of the per-table counts a lookup reports (`docs/design.md` §6): ids lost
to a routing or dedup capacity (`CapacityOverflowError`) and ids outside their table's
vocabulary (`InvalidIdError`). Both look only at concrete counts (outside `jax.jit`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

__all__ = ["CapacityOverflowError", "InvalidIdError", "check_invalid", "check_overflow"]


class CapacityOverflowError(RuntimeError):
    """Ids did not fit a routing or dedup capacity (strict mode)."""


class InvalidIdError(ValueError):
    """Ids outside their table's vocabulary reached the run time (strict mode)."""


def _nonzero(counts: Mapping[str, Any]) -> dict[str, int] | None:
    if any(isinstance(v, jax.core.Tracer) for v in counts.values()):
        return None
    return {k: int(v) for k, v in counts.items() if int(v) > 0}


def check_overflow(counts: Mapping[str, Any]) -> None:
    """Raises `CapacityOverflowError` if any table dropped ids (concrete counts only)."""
    bad = _nonzero(counts)
    if bad:
        raise CapacityOverflowError(
            f"ids overflowed routing/dedup capacities (ids dropped per table): {bad}; raise "
            "the tables' capacity_factor / unique_capacity (see embark_jax.sharding.capacity)"
        )


def check_invalid(counts: Mapping[str, Any]) -> None:
    """Raises `InvalidIdError` if any table got ids `< -1` or `>= vocab_size` (concrete
    counts only)."""
    bad = _nonzero(counts)
    if bad:
        raise InvalidIdError(
            f"ids outside their table's vocabulary (< -1 or >= vocab_size; dropped, count per "
            f"table): {bad}; build batches with SparseFeatures.from_dense(..., config=config) "
            "or call batch.validate(config) to find them"
        )
