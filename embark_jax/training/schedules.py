"""Learning-rate schedules for training, as optax schedules (step -> rate).

`WarmupDecay` is MLPerf DLRM's schedule: a linear warm-up from 0 to the base rate over
`warmup` steps, the base rate until `decay_start`, then a polynomial decay (power 2) to 0
over `decay_steps` steps. The sparse optimizers and optax evaluate a schedule at the step
counter inside the compiled step, so the rate changes every step without recompiling.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import optax

__all__ = ["WarmupDecay"]

_KEYS = ("warmup", "decay_start", "decay_steps")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupDecay:
    """Steps of warm-up, the step the decay starts at and its length (0: none)."""

    warmup: int = 0
    decay_start: int = 0
    decay_steps: int = 0
    power: float = 2.0

    def __post_init__(self):
        for key in _KEYS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"lr schedule: {key} must be an int >= 0, got {value!r}")
        if self.decay_steps and self.decay_start < self.warmup:
            raise ValueError(
                f"lr schedule: decay_start {self.decay_start} comes before the end of the "
                f"warm-up ({self.warmup} steps)"
            )

    @classmethod
    def parse(cls, text: str) -> WarmupDecay:
        """From `"warmup=100,decay_start=500,decay_steps=300"` (any subset, any order);
        a one-line `ValueError` naming the key or value otherwise."""
        values: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in _KEYS:
                raise ValueError(
                    f"lr schedule: {part!r} is not key=value with a key of {', '.join(_KEYS)}"
                )
            if key in values:
                raise ValueError(f"lr schedule: {key} given twice")
            try:
                values[key] = int(raw)
            except ValueError:
                raise ValueError(
                    f"lr schedule: {key} must be an int, got {raw.strip()!r}"
                ) from None
        if not values:
            raise ValueError(f"lr schedule: nothing given in {text!r}; e.g. warmup=100")
        return cls(**values)

    def __call__(self, base: float) -> optax.Schedule:
        """The schedule of base rate `base`."""
        import optax  # here: parsing a schedule (the CLI's flags) loads no JAX

        parts, bounds = [], []
        if self.warmup:
            parts.append(optax.linear_schedule(0.0, base, self.warmup))
            bounds.append(self.warmup)
        if self.decay_steps:
            parts.append(optax.constant_schedule(base))
            bounds.append(self.decay_start)
            parts.append(optax.polynomial_schedule(base, 0.0, self.power, self.decay_steps))
        else:
            parts.append(optax.constant_schedule(base))
        return optax.join_schedules(parts, bounds) if bounds else parts[0]
