"""`embark_jax.ops.hash_reference`: the pure-JAX hash table the kernels are checked against
(the kernels against it, on random streams: tests/ops/test_hash_table.py)."""

import jax.numpy as jnp
import numpy as np

from embark_jax.core import dynamic
from embark_jax.ops import abi
from embark_jax.ops import hash_reference as R

EMPTY = np.uint32(R.EMPTY)


def _empty(rows=4):
    keys = jnp.full((rows, 2), EMPTY, jnp.uint32)
    zeros = jnp.zeros((rows, 2), jnp.int32)
    return keys, zeros, jnp.zeros((0, 2), jnp.uint32), jnp.zeros((0, 2), jnp.int32)


def test_bucket_and_shard_agree_with_the_host_hash():
    words = dynamic.key_words(np.arange(-1, 40))
    np.testing.assert_array_equal(R.shard_of(jnp.asarray(words), 3), dynamic.shard_of(words, 3))
    want = dynamic.hash_words(words)[:, 0] % 5
    np.testing.assert_array_equal(R.bucket_of(jnp.asarray(words), 5), want)


def test_insert_then_find_in_one_bucket():
    ids = jnp.asarray(dynamic.key_words(np.array([5, 7, 5, -1])))
    keys, scores, *_, slots, fresh, counts = R.find_or_insert(
        _empty(), ids, 0, bucket_size=4, eviction=abi.EvictionId.LRU, threshold=1, ttl=0
    )
    np.testing.assert_array_equal(slots, [0, 1, 0, -1])  # padding gets no slot
    np.testing.assert_array_equal(fresh, [True, True, False, False])
    assert counts[abi.HashCount.INSERTED] == 2 and counts[abi.HashCount.FOUND] == 1
    found = R.find(keys, scores, ids, jnp.int32(1), bucket_size=4, ttl=0)
    np.testing.assert_array_equal(found, [0, 1, 0, -1])
    missing = jnp.asarray(dynamic.key_words(np.array([6])))
    assert int(R.find(keys, scores, missing, jnp.int32(1), bucket_size=4, ttl=0)[0]) == -1


def test_a_full_bucket_without_eviction_drops_the_newcomer():
    ids = jnp.asarray(dynamic.key_words(np.array([1, 2, 3])))
    *_, slots, fresh, counts = R.find_or_insert(
        _empty(2), ids, 0, bucket_size=2, eviction=abi.EvictionId.NONE, threshold=1, ttl=0
    )
    np.testing.assert_array_equal(slots, [0, 1, -1])
    assert counts[abi.HashCount.DROPPED] == 1 and not bool(fresh[2])
