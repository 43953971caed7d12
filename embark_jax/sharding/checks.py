"""Host-side checks of what a lookup or an update reports (`docs/design.md` §6): ids lost
to a routing or dedup capacity (`CapacityOverflowError`), ids outside their table's
vocabulary (`InvalidIdError`) and an update refused for non-finite values
(`NonFiniteUpdateError`). All look only at concrete values (outside `jax.jit`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

__all__ = [
    "CapacityOverflowError",
    "InvalidIdError",
    "NonFiniteUpdateError",
    "check_applied",
    "check_invalid",
    "check_overflow",
]


class CapacityOverflowError(RuntimeError):
    """Ids did not fit a routing or dedup capacity (strict mode)."""


class InvalidIdError(ValueError):
    """Ids outside their table's vocabulary reached the run time (strict mode)."""


class NonFiniteUpdateError(FloatingPointError):
    """A sparse update would have written NaN or inf; nothing was applied."""


def check_applied(applied: Any, what: str) -> None:
    """Raises `NonFiniteUpdateError` if a transactional update was refused (a concrete
    `applied` flag only; inside `jax.jit` the caller reads it)."""
    if isinstance(applied, jax.core.Tracer) or bool(applied):
        return
    raise NonFiniteUpdateError(
        f"{what}: the update would write NaN or inf (non-finite gradients or a diverging "
        "learning rate); nothing was applied, the tables and optimizer slots are unchanged"
    )


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
