"""GPU-only checks (run by experiments/gpu_check.sh with EMBARK_TEST_GPU=1); the CPU and GPU
kernels share tests/xla_ffi/test_kernels.py, which the script runs on the GPU as well."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import embark_jax
from embark_jax import ops
from embark_jax.ops import reference

pytestmark = pytest.mark.gpu


def test_cuda_targets_registered_and_used():
    assert jax.default_backend() == "gpu"
    cuda = embark_jax.registered_targets().get("CUDA", ())
    assert {"embark_lookup_pool", "embark_unique", "embark_sparse_grad_update"} <= set(cuda)
    hlo = (
        jax.jit(lambda t, i, s: ops.lookup_pool(t, i, s, 4))
        .lower(jnp.ones((10, 4)), jnp.zeros((8,), jnp.int32), jnp.zeros((8,), jnp.int32))
        .as_text()
    )
    assert "embark_lookup_pool" in hlo


@pytest.mark.parametrize("dim", [128, 13])  # vectorised (D % 4 == 0) and scalar paths
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_sorted_and_atomic_pooling_paths_agree(dim, combiner):
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(5000, dim)), jnp.float32)
    ids = jnp.asarray(rng.integers(-1, 5000, size=(512 * 16)), jnp.int32)
    seg = jnp.repeat(jnp.arange(512, dtype=jnp.int32), 16)
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=ids.shape), jnp.float32)
    want = reference.lookup_pool(table, ids, seg, 512, w, combiner)
    for srt in (True, False):
        got = ops.lookup_pool(table, ids, seg, 512, w, combiner, indices_are_sorted=srt)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
