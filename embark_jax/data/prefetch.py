"""`Prefetcher`: computes batch `step + 1` (and further, `depth` ahead) in a background thread
while the caller trains on batch `step`.

The batch function must be a pure function of the step (every dataset here is), so
prefetching never changes what a step sees: a step asked for out of order (a resume, an
evaluation batch) is computed on the spot and the read-ahead restarts from there. An error
raised while a batch is built in the background is raised by the `get` that asks for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["Prefetcher"]

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """`get(step)` returns `fn(step)` and starts building `fn(step + 1) ... fn(step + depth)`
    in one background thread."""

    def __init__(self, fn: Callable[[int], T], depth: int = 1):
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self._fn = fn
        self.depth = int(depth)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def get(self, step: int) -> T:
        step = int(step)
        with self._lock:
            fut = self._pending.pop(step, None)
            for k in [k for k in self._pending if not step < k <= step + self.depth]:
                self._pending.pop(k).cancel()
        result = fut.result() if fut is not None else self._fn(step)
        if self.depth:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="embark-prefetch")
                for k in range(step + 1, step + 1 + self.depth):
                    if k not in self._pending:
                        self._pending[k] = self._pool.submit(self._fn, k)
        return result

    def close(self) -> None:
        """Cancels the read-ahead and stops the thread (a later `get` starts a new one)."""
        with self._lock:
            for fut in self._pending.values():
                fut.cancel()
            self._pending.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
