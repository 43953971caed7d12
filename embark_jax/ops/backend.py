"""Which implementation an op runs: the FFI kernel or the pure-JAX reference.

The default is `ffi` wherever a kernel exists for the op; `reference` forces the jnp code.
Choose per call (`backend=`) or for a block of code (`with use_backend("reference"): ...`).
The choice is made at trace time.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from embark_jax.core.choice import Choice

__all__ = ["Backend", "current_backend", "use_backend"]


class Backend(Choice):
    FFI = "ffi"
    REFERENCE = "reference"

    @classmethod
    def parse(cls, value: Backend | str | None) -> Backend | None:
        return None if value is None else super().parse(value)


_BACKEND: contextvars.ContextVar[Backend] = contextvars.ContextVar(
    "embark_backend", default=Backend.FFI
)


def current_backend() -> Backend:
    return _BACKEND.get()


@contextlib.contextmanager
def use_backend(backend: Backend | str) -> Iterator[None]:
    token = _BACKEND.set(Backend.parse(backend))
    try:
        yield
    finally:
        _BACKEND.reset(token)


def resolve(backend: Backend | str | None) -> Backend:
    return Backend.parse(backend) or current_backend()
