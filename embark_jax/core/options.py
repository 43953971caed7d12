"""Run-time options of the sharded runtime, as one frozen value built once by the caller.

`RuntimeOptions` holds what the plan does not: how RB returns partial vectors on a 2-D mesh,
the default routing capacity factor, the dtype embedding vectors travel in, how DP tables
exchange gradients, and what a capacity overflow does. It is hashable (it keys compiled
steps) and validated at construction; every field is an enum or a number, never a free
string.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from embark_jax.core.choice import Choice
from embark_jax.core.specs import as_dtype

__all__ = ["CommDtype", "DPGradients", "OverflowPolicy", "RuntimeOptions"]


class CommDtype(Choice):
    """The dtype embedding vectors and their gradients travel in between devices."""

    TABLE = "table"  # the table's own dtype (no conversion)
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class DPGradients(Choice):
    """How DP (replicated) tables exchange gradients."""

    AUTO = "auto"  # whichever moves fewer words over links and memory (core.dp_exchange)
    DENSE = "dense"  # all-reduce of the [V, d] gradient
    SPARSE = "sparse"  # all-gather of every device's id slots and pooled output gradients


class OverflowPolicy(Choice):
    """What an id that overflows a routing or dedup capacity does."""

    COUNT = "count"  # dropped from this step, counted per table and reported
    ERROR = "error"  # `CapacityOverflowError` before anything is updated
    GROW = "grow"  # counted, then the table's capacities double and the step recompiles


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    """Static settings of the sharded runtime (part of every compiled step's key).

    Attributes:
      hierarchical: on a `("node", "local")` mesh, RB sums partial vectors inside each node
        before the inter-node exchange (default True).
      capacity_factor: default routing capacity factor of row-sharded tables (a table's
        own `capacity_factor` in the plan wins); None: the runtime's default.
      comm_dtype: `CommDtype` (or its value) of embedding vectors on the wire.
      dp_gradients: `DPGradients` (or its value).
      overflow: `OverflowPolicy` (or its value).
    """

    hierarchical: bool = True
    capacity_factor: float | None = None
    comm_dtype: CommDtype | str = CommDtype.TABLE
    dp_gradients: DPGradients | str = DPGradients.AUTO
    overflow: OverflowPolicy | str = OverflowPolicy.COUNT

    def __post_init__(self) -> None:
        if not isinstance(self.hierarchical, bool):
            raise ValueError(f"hierarchical must be a bool, got {self.hierarchical!r}")
        cf = self.capacity_factor
        if cf is not None and (
            isinstance(cf, bool)
            or not isinstance(cf, int | float)
            or not math.isfinite(cf)
            or cf <= 0
        ):
            raise ValueError(f"capacity_factor must be a finite number > 0, got {cf!r}")
        comm = None if self.comm_dtype is None else self.comm_dtype
        object.__setattr__(self, "comm_dtype", CommDtype.parse(comm or CommDtype.TABLE))
        object.__setattr__(self, "dp_gradients", DPGradients.parse(self.dp_gradients))
        object.__setattr__(self, "overflow", OverflowPolicy.parse(self.overflow))

    @property
    def strict(self) -> bool:
        """Whether an overflow is an error."""
        return self.overflow is OverflowPolicy.ERROR

    def to_wire(self, x: Any) -> Any:
        """`x` in the communication dtype (unchanged for `CommDtype.TABLE`)."""
        if self.comm_dtype is CommDtype.TABLE:
            return x
        return x.astype(as_dtype(self.comm_dtype.value))
