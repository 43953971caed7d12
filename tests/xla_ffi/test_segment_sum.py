"""The FFI build chain end to end: the native segment_sum against the reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embark_jax import ops
from embark_jax.ops import reference

pytestmark = pytest.mark.smoke


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("sort", [False, True])
def test_segment_sum_ffi_matches_reference(rng, dtype, id_dtype, sort):
    v = jnp.asarray(rng.normal(size=(300, 16)), dtype)
    seg = rng.integers(-1, 40, size=300).astype(id_dtype)
    if sort:
        seg = np.sort(seg)
    got = ops.segment_sum(v, jnp.asarray(seg), 40)
    want = reference.segment_sum(v.astype(jnp.float32), jnp.asarray(seg), 40)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (0, 2, 3)])
def test_segment_sum_of_no_values_is_zeros(shape):
    """N = 0 gives zeros (a reshape(N, -1) in the wrapper would raise ZeroDivisionError)."""
    v = jnp.zeros(shape, jnp.float32)
    seg = jnp.zeros((0,), jnp.int32)
    for f in (ops.segment_sum, jax.jit(ops.segment_sum, static_argnums=2)):
        got = f(v, seg, 4)
        assert got.shape == (4, *shape[1:])
        np.testing.assert_array_equal(np.asarray(got), 0.0)


def test_segment_sum_ffi_is_really_used():
    hlo = (
        jax.jit(lambda v, s: ops.segment_sum(v, s, 4))
        .lower(jnp.ones((8, 2)), jnp.zeros((8,), jnp.int32))
        .as_text()
    )
    assert "embark_segment_sum" in hlo
    hlo_ref = (
        jax.jit(lambda v, s: ops.segment_sum(v, s, 4, backend="reference"))
        .lower(jnp.ones((8, 2)), jnp.zeros((8,), jnp.int32))
        .as_text()
    )
    assert "embark_segment_sum" not in hlo_ref
    with ops.use_backend("reference"):
        assert (
            "embark_segment_sum"
            not in jax.jit(lambda v, s: ops.segment_sum(v, s, 4))
            .lower(jnp.ones((8, 2)), jnp.zeros((8,), jnp.int32))
            .as_text()
        )


def test_segment_sum_ffi_jit_grad_vmap(rng):
    v = jnp.asarray(rng.normal(size=(50, 3)), jnp.float32)
    seg = jnp.asarray(rng.integers(-1, 10, size=50))
    f = lambda x, b: jnp.sum(jnp.sin(ops.segment_sum(x, seg, 10, backend=b)))  # noqa: E731
    g_ffi = jax.jit(jax.grad(functools.partial(f, b="ffi")))(v)
    g_ref = jax.grad(functools.partial(f, b="reference"))(v)
    np.testing.assert_allclose(g_ffi, g_ref, rtol=1e-5, atol=1e-6)
    vs = jnp.stack([v, 2 * v])
    got = jax.vmap(lambda x: ops.segment_sum(x, seg, 10))(vs)
    np.testing.assert_allclose(got[1], 2 * reference.segment_sum(v, seg, 10), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_segment_sum_ffi_inside_shard_map(rng):
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    v = jnp.asarray(rng.normal(size=(8 * 20, 4)), jnp.float32)
    seg = jnp.asarray(rng.integers(-1, 6, size=8 * 20))
    v = jax.device_put(v, NamedSharding(mesh, P("d")))
    seg = jax.device_put(seg, NamedSharding(mesh, P("d")))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d"))
    def per_device(x, s):
        return ops.segment_sum(x, s, 6)[None]

    out = per_device(v, seg)  # [8, 6, 4]: each device's partial sums
    vn, sn = np.asarray(v), np.asarray(seg)
    want = np.stack(
        [
            np.asarray(
                reference.segment_sum(vn[i * 20 : (i + 1) * 20], sn[i * 20 : (i + 1) * 20], 6)
            )
            for i in range(8)
        ]
    )
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)

    def loss(x, backend):
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P())
        def body(xx, s):
            part = ops.segment_sum(xx, s, 6, backend=backend)
            return jax.lax.psum(jnp.sum(part**2), "d")

        return body(x, seg)

    g_ffi = jax.jit(jax.grad(lambda x: loss(x, "ffi")))(v)
    g_ref = jax.jit(jax.grad(lambda x: loss(x, "reference")))(v)
    np.testing.assert_allclose(np.asarray(g_ffi), np.asarray(g_ref), rtol=1e-5, atol=1e-5)
    hlo = jax.jit(per_device).lower(v, seg).compile().as_text()
    assert "all-gather" not in hlo
