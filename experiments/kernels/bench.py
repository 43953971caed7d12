"""Kernel benchmark: the FFI kernels against XLA's own lowering on the same data, same run.

Forward:  `ops.lookup_pool` with `indices_are_sorted=True` (the layout `SparseFeatures.flat`
          gives, and the path production takes) vs `jnp.take` + `jax.ops.segment_sum` (XLA).
Backward: `ops.lookup_pool_backward_update` (fused backward + SGD, donated table), and the
          two-op path `lookup_pool_backward` + `sparse_update` with a capacity sized as a
          planner would (the batch's distinct rows rounded up to 256, not B*L), vs `jax.grad`
          of the XLA forward + dense SGD `table - lr * grad` (donated table).

Bytes follow FBGEMM's accounting: forward reads B*L rows of D elements and writes B*D;
backward reads B*D output grads, reads/writes B*L*D of per-id gradient, and reads and writes
each touched row once. Ratios are FFI speed / XLA speed measured in the same run (the machines
are shared and noisy: compare ratios, not absolute times).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax import ops
from embark_jax.data.synthetic import zipf_ranks
from embark_jax.ops import optimizers as O


@dataclasses.dataclass(frozen=True)
class Point:
    batch: int
    hotness: int
    dim: int
    vocab: int
    dist: str  # "uniform" or "zipf"

    @property
    def name(self) -> str:
        return f"B{self.batch}_L{self.hotness}_D{self.dim}_V{self.vocab}_{self.dist}"


DEFAULT_POINTS = [
    Point(1024, 8, 64, 100_000, "uniform"),
    Point(4096, 32, 128, 1_000_000, "uniform"),
    Point(4096, 32, 128, 1_000_000, "zipf"),
    Point(8192, 32, 128, 2_000_000, "zipf"),
]


def make_ids(p: Point, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if p.dist == "zipf":
        ranks = zipf_ranks(rng, 1.1, p.vocab, (p.batch, p.hotness))
        return ((ranks * 2654435761) % p.vocab).astype(np.int32)  # spread hot ids
    return rng.integers(0, p.vocab, size=(p.batch, p.hotness)).astype(np.int32)


def timeit(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ffi_forward(table, ids, seg, num_segments):
    """The FFI forward as production calls it: bags in order, so the sorted path."""
    return ops.lookup_pool(table, ids, seg, num_segments, indices_are_sorted=True)


def xla_forward(table, ids, seg, num_segments):
    return jax.ops.segment_sum(jnp.take(table, ids, axis=0), seg, num_segments=num_segments)


def bench_point(p: Point, repeats: int = 5, lr: float = 0.01) -> dict:
    ids_np = make_ids(p)
    ids = jnp.asarray(ids_np.reshape(-1))
    seg = jnp.repeat(jnp.arange(p.batch, dtype=jnp.int32), p.hotness)
    table = jax.random.normal(jax.random.key(0), (p.vocab, p.dim), jnp.float32)
    grads_out = jax.random.normal(jax.random.key(1), (p.batch, p.dim), jnp.float32)
    unique_rows = len(np.unique(ids_np))
    capacity = two_op_capacity(unique_rows)
    opt = O.SGD(learning_rate=lr)

    ffi_fwd = jax.jit(lambda t, i, s: ffi_forward(t, i, s, p.batch))
    xla_fwd = jax.jit(lambda t, i, s: xla_forward(t, i, s, p.batch))
    np.testing.assert_allclose(
        np.asarray(ffi_fwd(table, ids, seg)),
        np.asarray(xla_fwd(table, ids, seg)),
        rtol=1e-4,
        atol=1e-3,
    )
    t_ffi_fwd = timeit(lambda: ffi_fwd(table, ids, seg), repeats)
    t_xla_fwd = timeit(lambda: xla_fwd(table, ids, seg), repeats)

    @_jit_donating
    def ffi_train(t, g):  # fused backward + SGD, no gradient buffer
        t, _, _ = ops.lookup_pool_backward_update(t, opt.init(t), g, ids, seg, optimizer=opt)
        return t

    @_jit_donating
    def ffi_two_op(t, g):  # lookup_pool_backward (dedup + reduce) then sparse_update
        rows, rg, _ = ops.lookup_pool_backward(g, ids, seg, capacity=capacity, combiner="sum")
        t, _ = ops.sparse_update(t, opt.init(t), rows, rg, opt, assume_unique=True)
        return t

    @_jit_donating
    def xla_train(t, g):
        _, vjp = jax.vjp(lambda tt: xla_forward(tt, ids, seg, p.batch), t)
        return t - lr * vjp(g)[0]

    state = {"ffi": table + 0.0, "xla": table + 0.0, "two_op": table + 0.0}

    def run(kind, fn):
        def go():
            state[kind] = fn(state[kind], grads_out)
            return state[kind]

        return go

    t_ffi_bwd = timeit(run("ffi", ffi_train), repeats)
    t_two_op = timeit(run("two_op", ffi_two_op), repeats)
    t_xla_bwd = timeit(run("xla", xla_train), repeats)
    # all paths applied the same number of identical SGD steps
    for kind in ("ffi", "two_op"):
        np.testing.assert_allclose(
            np.asarray(state[kind][:1000]), np.asarray(state["xla"][:1000]), rtol=1e-4, atol=1e-4
        )

    e = 4
    fwd_bytes = p.batch * p.hotness * p.dim * e + p.batch * p.dim * e
    bwd_bytes = p.batch * p.dim * e + p.batch * p.hotness * p.dim * e + 2 * unique_rows * p.dim * e
    bwd = _rates(t_ffi_bwd, t_xla_bwd, bwd_bytes)
    bwd.update(two_op_s=t_two_op, two_op_speedup=t_xla_bwd / t_two_op)
    return {
        "point": dataclasses.asdict(p)
        | {"name": p.name, "unique_rows": unique_rows, "two_op_capacity": capacity},
        "forward": _rates(t_ffi_fwd, t_xla_fwd, fwd_bytes),
        "backward_update": bwd,
        "backward_two_op": _rates(t_two_op, t_xla_bwd, bwd_bytes),
    }


def two_op_capacity(unique_rows: int, multiple: int = 256) -> int:
    """The two-op backward's capacity: the distinct rows rounded up, as planned capacities
    are (sized from observed batches), rather than B*L mostly-empty rows."""
    return max(multiple, -(-unique_rows // multiple) * multiple)


def _rates(t_ffi: float, t_xla: float, nbytes: int) -> dict:
    """Times, GB/s of both paths for the same bytes, and the FFI speedup over XLA."""
    return {
        "ffi_s": t_ffi,
        "xla_s": t_xla,
        "bytes": nbytes,
        "ffi_GBps": nbytes / t_ffi / 1e9,
        "xla_GBps": nbytes / t_xla / 1e9,
        "speedup": t_xla / t_ffi,
    }


def _jit_donating(fn):
    return jax.jit(fn, donate_argnums=(0,))


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Copy bandwidth (read + write bytes per second), the ceiling for these kernels: a
    device-to-device copy on a GPU, a numpy copy into a preallocated buffer on the CPU."""
    if jax.default_backend() == "cpu":
        src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        t = timeit(lambda: np.copyto(dst, src), repeats)
    else:
        x = jnp.ones((nbytes // 4,), jnp.float32)
        f = jax.jit(lambda a: a + 1.0)
        t = timeit(lambda: f(x), repeats)
    return 2 * nbytes / t


def torch_embedding_bag(p: Point, repeats: int = 5) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.randn(p.vocab, p.dim, device=dev)
    ids = torch.as_tensor(make_ids(p).reshape(-1).astype(np.int64), device=dev)
    offsets = torch.arange(0, p.batch * p.hotness, p.hotness, device=dev)
    fn = lambda: torch.nn.functional.embedding_bag(ids, w, offsets, mode="sum")  # noqa: E731
    for _ in range(2):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(points=DEFAULT_POINTS, repeats: int = 5, out: str | None = None) -> dict:
    backend = jax.default_backend()
    result = {"backend": backend, "devices": str(jax.devices()[0]), "points": []}
    ceiling = copy_bandwidth(1 << 28 if backend == "cpu" else 1 << 30, repeats)
    result["copy_GBps"] = ceiling / 1e9
    print(f"backend {backend}: device copy {ceiling / 1e9:.1f} GB/s (read+write)", flush=True)
    for p in points:
        print(f"-- {p.name} ...", flush=True)
        r = bench_point(p, repeats)
        for k in ("forward", "backward_update", "backward_two_op"):
            r[k]["fraction_of_copy"] = r[k]["ffi_GBps"] * 1e9 / ceiling
        tb = torch_embedding_bag(p, repeats)
        if tb is not None:
            r["forward"]["torch_embedding_bag_s"] = tb
        f, b = r["forward"], r["backward_update"]
        print(
            f"   forward   ffi {f['ffi_s'] * 1e3:8.2f} ms {f['ffi_GBps']:6.2f} GB/s | xla "
            f"{f['xla_s'] * 1e3:8.2f} ms {f['xla_GBps']:6.2f} GB/s | {f['speedup']:.2f}x, "
            f"{100 * f['fraction_of_copy']:.0f}% of copy",
            flush=True,
        )
        print(
            f"   bwd+upd   ffi {b['ffi_s'] * 1e3:8.2f} ms {b['ffi_GBps']:6.2f} GB/s | xla "
            f"{b['xla_s'] * 1e3:8.2f} ms {b['xla_GBps']:6.2f} GB/s | {b['speedup']:.2f}x, "
            f"{100 * b['fraction_of_copy']:.0f}% of copy | two-op {b['two_op_s'] * 1e3:.2f} ms "
            f"({b['two_op_speedup']:.2f}x)",
            flush=True,
        )
        result["points"].append(r)
        if out:  # after every point: a run stopped by its time budget keeps what it measured
            with open(out, "w") as fh:
                json.dump(result, fh, indent=1)
    if out:
        with open(out, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {out}")
    return result
