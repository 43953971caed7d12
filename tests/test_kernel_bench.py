"""The kernel benchmark times what production runs: the sorted forward path, and a two-op
backward whose capacity is sized like a planned one (not B*L mostly-empty rows)."""

import jax
import jax.numpy as jnp
import pytest

from experiments.kernels import bench

pytestmark = pytest.mark.smoke


def test_forward_takes_the_sorted_path():
    hlo = (
        jax.jit(lambda t, i, s: bench.ffi_forward(t, i, s, 4))
        .lower(jnp.ones((10, 4)), jnp.zeros((8,), jnp.int32), jnp.zeros((8,), jnp.int32))
        .as_text()
    )
    assert "embark_lookup_pool" in hlo and "indices_are_sorted = 1" in hlo


def test_two_op_capacity_is_the_distinct_rows_rounded_up():
    assert bench.two_op_capacity(1) == 256
    assert bench.two_op_capacity(256) == 256
    assert bench.two_op_capacity(257) == 512
    # the Zipf point B=4096, L=32: far fewer distinct rows than B*L
    p = bench.Point(4096, 32, 128, 1_000_000, "zipf")
    ids = bench.make_ids(p)
    distinct = len(set(ids.reshape(-1).tolist()))
    assert bench.two_op_capacity(distinct) < p.batch * p.hotness // 2


def test_bench_point_reports_every_kernel(tmp_path):
    r = bench.bench_point(bench.Point(64, 4, 8, 500, "zipf"), repeats=1)
    assert r["point"]["two_op_capacity"] == 256
    for kernel in ("forward", "backward_update", "backward_two_op"):
        assert r[kernel]["ffi_GBps"] > 0 and r[kernel]["bytes"] > 0, kernel
