"""GPU checks of the dynamic tables' hash table kernels (experiments/gpu_check.sh runs them
with EMBARK_TEST_GPU=1; they skip on CPU machines). The CUDA find_or_insert sorts the ids by
bucket (CUB) and processes each bucket's ids in order on one thread; these tests hold it to
the Python model on random and adversarial streams, and to the CPU kernel, bit for bit, on
batches large enough for CUB's multi-tile sort."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax.core.dynamic import DynamicTableConfig, key_words
from embark_jax.ops import _ffi, abi
from embark_jax.ops import hash_table as H
from tests.ops.test_hash_table import (
    CONFIGS,
    _one_bucket_ids,
    assert_same_calls,
    random_stream,
    run_model,
    run_stream,
)

pytestmark = pytest.mark.gpu


def test_runs_on_the_gpu():
    assert jax.default_backend() == "gpu"


def test_streams_match_the_python_model_on_the_gpu():
    rng = np.random.default_rng(99)
    for s in range(10 * len(CONFIGS)):
        config = CONFIGS[s % len(CONFIGS)]
        calls = random_stream(rng, config)
        assert_same_calls(run_stream(config, calls), run_model(config, calls), f"stream {s}")


def _both_devices(fn, *args):
    """fn on the GPU and on the CPU (the CPU kernels), as numpy trees."""
    gpu = jax.tree.map(np.asarray, jax.jit(fn)(*args))
    cpu_dev = jax.devices("cpu")[0]
    cpu_args = jax.tree.map(lambda x: jax.device_put(x, cpu_dev), args)
    cpu = jax.tree.map(np.asarray, jax.jit(fn)(*cpu_args))
    return gpu, cpu


@pytest.mark.parametrize("kind", ["zipf", "one_bucket"])
def test_large_batches_equal_the_cpu_kernel(kind):
    config = DynamicTableConfig(
        name="t",
        dim=8,
        capacity=1 << 16,
        bucket_size=32,
        eviction="lfu",
        admission_threshold=2,
        ttl_steps=3,
    )
    rng = np.random.default_rng(0)
    if kind == "zipf":
        universe = rng.integers(0, 2**63, 1 << 18)
        batches = [universe[(rng.zipf(1.1, 300_000) - 1) % len(universe)] for _ in range(3)]
    else:  # every id in one bucket: one GPU thread processes them all, in order
        one = np.array(_one_bucket_ids(config.num_buckets, 512), np.uint64)
        batches = [one[rng.integers(0, len(one), 20_000)] for _ in range(3)]

    def run(state, words):
        outs = []
        for step, w in enumerate(words):
            state, res = H.find_or_insert(state, w, step, config=config)
            outs.append(res)
        return state, outs, H.find(state, words[0], config=config)

    words = [jnp.asarray(key_words(b)) for b in batches]
    gpu, cpu = _both_devices(run, H.init(config), words)
    for g, c in zip(jax.tree.leaves(gpu), jax.tree.leaves(cpu), strict=True):
        np.testing.assert_array_equal(g, c)
    counts = H.count_dict(gpu[1][-1].counts)
    assert counts["found"] > 0 and (kind == "zipf" or counts["dropped"] + counts["evicted"] > 0)


def test_workspace_too_small_is_an_error():
    config = DynamicTableConfig(name="t", dim=4, capacity=64, bucket_size=8)
    st = H.init(config)
    ids = jnp.asarray(key_words(np.arange(1000)))
    out_types = (
        _ffi.result_type(st.keys, st.keys.shape, jnp.uint32),
        _ffi.result_type(st.scores, st.scores.shape, jnp.int32),
        _ffi.result_type(st.cand_keys, st.cand_keys.shape, jnp.uint32),
        _ffi.result_type(st.cand_scores, st.cand_scores.shape, jnp.int32),
        _ffi.result_type(ids, (1000,), jnp.int32),
        _ffi.result_type(ids, (1000,), jnp.bool_),
        _ffi.result_type(ids, (len(abi.HashCount),), jnp.int32),
        _ffi.result_type(ids, (16,), jnp.uint8),
    )
    call = functools.partial(
        _ffi._call(abi.Target.HASH_FIND_OR_INSERT, out_types),
        bucket_size=np.int64(8),
        eviction=np.int64(1),
        threshold=np.int64(1),
        ttl=np.int64(0),
    )
    with pytest.raises(Exception, match="hash_table_workspace_bytes"):
        jax.block_until_ready(
            call(st.keys, st.scores, st.cand_keys, st.cand_scores, ids, jnp.int32(0))
        )


def test_in_place_on_the_gpu():
    config = DynamicTableConfig(name="t", dim=8, capacity=4096, bucket_size=32)
    st = H.init(config)
    step = jax.jit(lambda s, ids: H.find_or_insert(s, ids, 0, config=config), donate_argnums=(0,))
    keys = st.keys
    new, res = step(st, jnp.asarray(key_words(np.arange(3000))))
    assert keys.is_deleted()
    assert H.count_dict(res.counts)["inserted"] + H.count_dict(res.counts)["dropped"] == 3000
    assert int(H.occupancy(new, config)) == H.count_dict(res.counts)["inserted"]
