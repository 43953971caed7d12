"""Dynamic tables' hash table (docs/design.md §11): the config, the ABI mirror, the id words
and hash, and the kernels against the `jnp` reference (bit for bit) and both against a
pure-Python model of the table (tests/hash_table_model.py) on random and adversarial
streams: slots, inserted flags, per-call counts and the whole table state after every call.

`EMBARK_HASH_STREAMS=10000 pytest tests/ops/test_hash_table.py -k streams` runs 10,000 streams
instead of the default 300 (about 3 minutes on 2 cores)."""

import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax import ops
from embark_jax.core.dynamic import (
    FEISTEL_KEYS,
    DynamicTableConfig,
    Eviction,
    hash_words,
    join_key_words,
    key_words,
)
from embark_jax.ops import _ffi, abi, hash_reference
from embark_jax.ops import hash_table as H
from embark_jax.ops import optimizers as O
from tests.core.test_dynamic import cfg
from tests.hash_table_model import COUNT_NAMES, PAD, HashTableModel, hash64
from tests.ops.test_abi import HEADER, parse_x_macro
from tests.xla_ffi.test_kernels import x64

STREAMS = int(os.environ.get("EMBARK_HASH_STREAMS", "300"))
N = 32  # ids per call in the random streams


# --- the ABI mirror ----------------------------------------------------------------------


def test_hash_abi_lists_match_header():
    text = HEADER.read_text()
    evictions = [(n, int(v)) for n, v in parse_x_macro(text, "EMBARK_ABI_EVICTIONS")]
    assert [(e.name, e.value) for e in abi.EvictionId] == evictions
    assert [e.name for e in Eviction] == [e.name for e in abi.EvictionId]
    counts = [(n, int(v)) for n, v in parse_x_macro(text, "EMBARK_ABI_HASH_COUNTS")]
    assert [(c.name, c.value) for c in abi.HashCount] == counts
    assert [c.lower() for c, _ in counts] == list(COUNT_NAMES)
    keys = [int(v.rstrip("u"), 16) for _, v in parse_x_macro(text, "EMBARK_ABI_HASH_ROUND_KEYS")]
    assert tuple(keys) == abi.HASH_ROUND_KEYS == FEISTEL_KEYS


# --- ids and the hash --------------------------------------------------------------------

EDGE_IDS = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 2]


def _random_ids(rng, n) -> list[int]:
    return [int(x) for x in rng.integers(0, 2**64 - 1, n, dtype=np.uint64)]


def _words(ids: list[int]) -> np.ndarray:
    return key_words(np.array(ids, np.uint64))


def test_hash_agrees_in_numpy_jnp_and_the_model(rng):
    ids = EDGE_IDS + _random_ids(rng, 500)
    w = _words(ids)
    got_np = hash_words(w)
    got_jnp = np.asarray(hash_reference.hash_words(jnp.asarray(w)))
    want = np.array([hash64(i) for i in ids], np.uint32)
    np.testing.assert_array_equal(got_np, want)
    np.testing.assert_array_equal(got_jnp, want)
    # a bijection: distinct ids, distinct hashes; buckets spread evenly
    assert len({tuple(h) for h in want}) == len(set(ids))
    counts = np.bincount(hash_words(_words(_random_ids(rng, 40_000)))[:, 0] % 8, minlength=8)
    assert counts.min() > 4_600 and counts.max() < 5_400


def test_key_words_round_trip_and_sign_extension():
    ids = np.array([-1, 0, 5, -(2**63), 2**63 - 1, -7], np.int64)
    w = key_words(ids)
    assert w.dtype == np.uint32 and w.shape == (6, 2)
    np.testing.assert_array_equal(join_key_words(w), ids)
    assert tuple(w[0]) == (0xFFFFFFFF, 0xFFFFFFFF)  # -1: padding
    np.testing.assert_array_equal(
        key_words(np.array([2**64 - 2], np.uint64)), [[2**32 - 2, 2**32 - 1]]
    )
    np.testing.assert_array_equal(key_words(np.array([-1, 3], np.int32)), [w[0], [3, 0]])
    np.testing.assert_array_equal(key_words(np.array([255], np.uint8)), [[255, 0]])
    # on the device: int32 ids sign-extended, uint32 zero-extended, words as they are
    dev = H.as_key_words(jnp.asarray([-1, 7, -7], jnp.int32))
    np.testing.assert_array_equal(np.asarray(dev), key_words(np.array([-1, 7, -7])))
    dev = H.as_key_words(jnp.asarray([2**32 - 1], jnp.uint32))
    np.testing.assert_array_equal(np.asarray(dev), [[2**32 - 1, 0]])
    assert H.as_key_words(jnp.asarray(w)) is not None
    with x64(True):
        dev = H.as_key_words(jnp.asarray(ids))
        np.testing.assert_array_equal(np.asarray(dev), w)
        dev = H.as_key_words(jnp.asarray(np.array([2**64 - 2], np.uint64)))
        np.testing.assert_array_equal(np.asarray(dev), [[2**32 - 2, 2**32 - 1]])


@pytest.mark.parametrize(
    "ids, message",
    [
        (np.zeros((3, 3), np.int64), "got int64 of shape (3, 3)"),
        (np.array([1.5]), "got float64 of shape (1,)"),
        (jnp.zeros((4,), jnp.float32), "got float32 of shape (4,)"),
    ],
)
def test_bad_ids_are_refused(ids, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        H.find(H.init(cfg()), ids, config=cfg())


# --- running a stream on the kernels, the reference and the model ------------------------


@functools.cache
def _ops(bucket_size, eviction, threshold, ttl, backend):
    foi = jax.jit(
        functools.partial(
            H.find_or_insert_slots,
            bucket_size=bucket_size,
            eviction=eviction,
            threshold=threshold,
            ttl=ttl,
            backend=backend,
        )
    )
    fnd = jax.jit(
        functools.partial(H.find_slots, bucket_size=bucket_size, ttl=ttl, backend=backend)
    )
    return foi, fnd


def _table_ops(config, backend):
    return _ops(
        config.bucket_size,
        config.eviction.value,
        config.admission_threshold,
        config.ttl,
        backend,
    )


def run_stream(config, calls, backend="ffi"):
    """Runs `calls` ([(ids, step, query ids)]) through find_or_insert and find; yields per
    call (slots, inserted, counts dict, state arrays dict, found slots of the queries)."""
    foi, fnd = _table_ops(config, backend)
    st = H.init(config)
    arrays = (st.keys, st.scores, st.cand_keys, st.cand_scores)
    for ids, step, query in calls:
        out = foi(*arrays, jnp.asarray(_words(ids)), jnp.int32(step))
        arrays = out[:4]
        found = fnd(arrays[0], arrays[1], jnp.asarray(_words(query)), jnp.int32(step))
        names = ("keys", "scores", "cand_keys", "cand_scores")
        yield (
            np.asarray(out[4]).tolist(),
            np.asarray(out[5]).tolist(),
            H.count_dict(out[6]),
            {k: np.asarray(a) for k, a in zip(names, arrays, strict=True)},
            np.asarray(found).tolist(),
        )


def run_model(config, calls):
    model = HashTableModel.for_config(config)
    for ids, step, query in calls:
        slots, inserted, counts = model.find_or_insert(ids, step)
        yield slots, inserted, counts, model.arrays(), model.find(query)


def assert_same_calls(got, want, what):
    for c, (g, w) in enumerate(zip(got, want, strict=True)):
        for name, x, y in zip(("slots", "inserted", "counts", "state", "find"), g, w, strict=True):
            if name == "state":
                for k in x:
                    np.testing.assert_array_equal(x[k], y[k], err_msg=f"{what}: call {c}: {k}")
            else:
                assert x == y, f"{what}: call {c}: {name}"


# A fixed set of configurations (a jit compile each), covering every policy, admission
# with few and many candidates, ttl, buckets of one slot and tables of one bucket.
CONFIGS = [
    cfg(
        capacity=c,
        bucket_size=s,
        eviction=e,
        admission_threshold=t,
        admission_candidates=a,
        ttl_steps=ttl,
    )
    for (c, s, e, t, a, ttl) in [
        (16, 4, "lru", 1, None, None),
        (16, 4, "lfu", 1, None, None),
        (16, 4, "none", 1, None, None),
        (8, 8, "lru", 1, None, None),
        (6, 1, "lru", 1, None, None),
        (6, 1, "lfu", 2, 1, None),
        (16, 4, "lru", 2, None, None),
        (16, 4, "lfu", 3, 2, None),
        (16, 4, "none", 2, 1, None),
        (12, 4, "lru", 3, None, 2),
        (16, 4, "lfu", 1, None, 1),
        (16, 4, "none", 1, None, 3),
        (24, 8, "lfu", 2, 3, 2),
        (4, 4, "lru", 2, 2, 1),
        (32, 2, "lru", 1, None, None),
        (32, 2, "lfu", 2, None, 4),
    ]
]


@functools.cache
def _one_bucket_ids(num_buckets: int, count: int = 256) -> tuple[int, ...]:
    """Random ids that all hash to bucket 0 (an adversarial stream fills one bucket)."""
    rng = np.random.default_rng(num_buckets)
    out: list[int] = []
    while len(out) < count:
        cand = rng.integers(0, 2**64 - 1, 4096, dtype=np.uint64)
        hit = cand[hash_words(key_words(cand))[:, 0] % num_buckets == 0]
        out += [int(x) for x in hit]
    return tuple(out[:count])


def random_stream(rng, config, n=N):
    """A random stream of calls: ids from a small universe (repeats, evictions), sometimes
    only ids of one bucket, padding, edge ids; steps that repeat, advance or jump."""
    kind = rng.choice(["uniform", "zipf", "one_bucket", "mixed"])
    universe_size = int(rng.integers(2, 5)) * config.capacity
    universe = _random_ids(rng, universe_size) + EDGE_IDS
    one = list(_one_bucket_ids(config.num_buckets))[: 3 * config.bucket_size + 4]
    calls, step = [], int(rng.integers(0, 3))
    for _ in range(int(rng.integers(3, 10))):
        if kind == "uniform":
            ids = [universe[i] for i in rng.integers(0, len(universe), n)]
        elif kind == "zipf":
            ids = [universe[(int(z) - 1) % len(universe)] for z in rng.zipf(1.3, n)]
        elif kind == "one_bucket":
            ids = [one[i] for i in rng.integers(0, len(one), n)]
        else:
            pool = universe[: config.capacity] + one
            ids = [pool[i] for i in rng.integers(0, len(pool), n)]
        ids = [PAD if rng.random() < 0.05 else i for i in ids]
        query = [universe[i] for i in rng.integers(0, len(universe), 8)] + ids[:8]
        calls.append((ids, step, query))
        step += int(rng.choice([0, 1, 1, 1, 2, 5]))
    return calls


def test_streams_match_the_python_model():
    rng = np.random.default_rng(1234)
    for s in range(STREAMS):
        config = CONFIGS[s % len(CONFIGS)]
        calls = random_stream(rng, config)
        assert_same_calls(
            run_stream(config, calls), run_model(config, calls), f"stream {s} ({config})"
        )


@pytest.mark.parametrize(
    "config",
    [CONFIGS[i] for i in (0, 2, 5, 9, 12, 13)],
    ids=lambda c: f"{c.eviction.value}-t{c.admission_threshold}-ttl{c.ttl}-s{c.bucket_size}",
)
def test_kernel_equals_reference_bit_for_bit(config):
    rng = np.random.default_rng(config.capacity * 31 + config.admission_threshold)
    for _ in range(2):
        calls = random_stream(rng, config)
        got = list(run_stream(config, calls, "ffi"))
        assert_same_calls(got, run_stream(config, calls, "reference"), "reference")
        assert_same_calls(got, run_model(config, calls), "model")


def test_one_bucket_filled_lru_lfu_none():
    """Hand-checked adversarial case: 6 ids of one bucket of 4 slots."""
    ids = list(_one_bucket_ids(4, 6))
    for policy in ("lru", "lfu", "none"):
        config = cfg(capacity=16, bucket_size=4, eviction=policy)
        calls = [
            (ids[:6], 0, ids),  # 4 inserted, 2 dropped: every entry was seen at step 0
            (ids[:1] * 3 + ids[4:6], 1, ids),  # id 0 seen again; ids 4, 5 replace two others
        ]
        got = list(run_stream(config, calls))
        slots, _, counts, _, _ = got[0]
        assert slots == [0, 1, 2, 3, -1, -1]
        assert counts == dict(found=0, inserted=4, evicted=0, expired=0, refused=0, dropped=2)
        slots, inserted, counts, _, found = got[1]
        if policy == "none":
            assert slots == [0, 0, 0, -1, -1] and counts["dropped"] == 2
        else:
            # LRU: ids 1, 2 (seen at step 0, lowest positions); LFU: the same (seen once)
            assert slots == [0, 0, 0, 1, 2] and inserted == [False] * 3 + [True] * 2
            assert counts == dict(found=3, inserted=2, evicted=2, expired=0, refused=0, dropped=0)
            assert found == [0, -1, -1, 3, 1, 2]
        assert_same_calls(got, run_model(config, calls), policy)


def test_lfu_keeps_the_frequent_and_lru_the_recent():
    ids = list(_one_bucket_ids(1, 6))
    calls = [
        (ids[:1] * 5 + ids[1:4], 0, []),  # id 0 seen 5 times, ids 1-3 once, at step 0
        (ids[1:4], 1, []),  # ids 1-3 seen again at step 1: id 0 is the least recent
        (ids[4:5], 2, ids),
    ]
    lru = list(run_stream(cfg(capacity=4, eviction="lru"), calls))
    lfu = list(run_stream(cfg(capacity=4, eviction="lfu"), calls))
    assert lru[2][0] == [0] and lru[2][4] == [-1, 1, 2, 3, 0, -1]  # id 0 evicted
    assert lfu[2][0] == [1] and lfu[2][4] == [0, -1, 2, 3, 1, -1]  # id 1 (seen twice) evicted


def test_admission_threshold_counts_sightings():
    config = cfg(capacity=16, admission_threshold=3)
    a, b = _random_ids(np.random.default_rng(5), 2)
    calls = [([a, a, b], 0, [a, b]), ([a, b], 1, [a, b]), ([b], 2, [a, b])]
    got = list(run_stream(config, calls))
    assert got[0][0][:2] == [-1, -1] and got[0][2]["refused"] == 3
    assert got[0][4] == [-1, -1]  # refused ids find nothing
    assert got[1][0][0] >= 0 and got[1][0][1] == -1 and got[1][2]["inserted"] == 1
    assert got[2][0][0] >= 0 and got[2][1] == [True]
    # an admitted id leaves the candidates; its score counts every sighting
    st = got[2][3]
    assert (st["cand_keys"] == 0xFFFFFFFF).all()
    assert st["scores"][got[1][0][0]].tolist() == [1, 3]
    assert_same_calls(got, run_model(config, calls), "admission")


def test_ttl_expires_entries_and_reuses_their_slots():
    config = cfg(capacity=4, ttl_steps=2)
    ids = list(_one_bucket_ids(1, 6))
    calls = [
        (ids[:4], 0, ids),
        (ids[:1], 2, ids),  # step 2: nothing expired yet (2 - 0 <= 2)
        (ids[4:6], 3, ids),  # step 3: ids 1-3 expired; ids 4, 5 take slots 1 and 2
        (ids[1:2], 3, ids),  # id 1 is new again: slot 3 (expired id 3's)
    ]
    got = list(run_stream(config, calls))
    assert got[1][4] == [0, 1, 2, 3, -1, -1]
    assert got[2][0] == [1, 2] and got[2][2]["expired"] == 2 and got[2][2]["evicted"] == 0
    assert got[2][4] == [0, -1, -1, -1, 1, 2]
    assert got[3][0] == [3] and got[3][2] == dict(
        found=0, inserted=1, evicted=0, expired=1, refused=0, dropped=0
    )
    assert_same_calls(got, run_model(config, calls), "ttl")


def test_large_batch_parallel_path_matches_the_model():
    """Batches of >= 4096 ids run on every thread, one range of buckets each."""
    rng = np.random.default_rng(7)
    for config in (
        cfg(capacity=4096, bucket_size=16, eviction="lfu", admission_threshold=2, ttl_steps=3),
        cfg(capacity=1024, bucket_size=8),
    ):
        universe = _random_ids(rng, 3 * config.capacity)
        calls = []
        for step in range(4):
            ids = [universe[int(z) % len(universe)] for z in rng.zipf(1.2, 6000)]
            calls.append((ids, step * 2, universe[:64]))
        assert_same_calls(run_stream(config, calls), run_model(config, calls), "large")


def stream_digest() -> str:
    """sha256 of the table and outputs after a fixed stream of large batches."""
    c = DynamicTableConfig(name="t", dim=2, capacity=2048, bucket_size=8, eviction="lfu")
    st = H.init(c)
    rng = np.random.default_rng(3)
    h = hashlib.sha256()
    for step in range(3):
        st, res = H.find_or_insert(st, rng.integers(0, 6000, 20000), step, config=c)
        for a in (st.keys, st.scores, st.values, res.slots, res.inserted, res.counts):
            h.update(np.asarray(a).tobytes())
    return h.hexdigest()


def test_deterministic_across_thread_counts():
    """The same stream on 3 worker threads (a subprocess) and on this process's (2 here)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    code = "from tests.ops.test_hash_table import stream_digest; print(stream_digest())"
    env = {**os.environ, "EMBARK_CPU_THREADS": "3", "JAX_PLATFORMS": "cpu"}
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env
    )
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() == stream_digest()


# --- the table-level ops -----------------------------------------------------------------


def test_find_changes_nothing_and_unknown_ids_read_minus_one(rng):
    config = cfg(capacity=16)
    st = H.init(config)
    st, res = H.find_or_insert(st, np.array([5, 6, -1, 7], np.int64), 0, config=config)
    assert np.asarray(res.slots)[2] == -1 and int(H.count_dict(res.counts)["inserted"]) == 3
    before = [np.asarray(x) for x in jax.tree.leaves(st)]
    found = H.find(st, np.array([7, 5, 99, -1, 6]), config=config)
    slots = np.asarray(res.slots)
    np.testing.assert_array_equal(np.asarray(found), [slots[3], slots[0], -1, -1, slots[1]])
    for a, b in zip(before, jax.tree.leaves(st), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert int(H.occupancy(st, config)) == 3


@pytest.mark.parametrize("initializer", ["uniform", "zeros"])
def test_inserted_rows_get_the_initializer_and_fresh_slots(initializer):
    config = cfg(capacity=8, dim=6, initializer=initializer, seed=9)
    opt = O.Adagrad(learning_rate=0.1, initial_accumulator=0.25)
    st = H.init(config, optimizer=opt)
    # dirty every row, then insert: inserted rows are reset, the others keep their values
    st = st._replace(
        values=jnp.full_like(st.values, 7.0),
        opt_state=O.AdagradState(jnp.full_like(st.opt_state.accumulator, 3.0)),
    )
    ids = np.array([11, 12, 11])
    st, res = H.find_or_insert(st, ids, 0, config=config, optimizer=opt)
    rows = np.asarray(res.slots)
    assert np.asarray(res.inserted).tolist() == [True, True, False] and rows[0] == rows[2]
    want = np.asarray(H.initial_rows(config, jnp.asarray(key_words(ids[:2]))))
    np.testing.assert_array_equal(np.asarray(st.values)[rows[:2]], want)
    if initializer == "uniform":
        assert np.all(np.abs(want) <= config.scale) and len(np.unique(want)) == want.size
    else:
        assert not want.any()
    acc = np.asarray(st.opt_state.accumulator)
    assert (acc[rows[:2]] == 0.25).all()
    others = np.setdiff1d(np.arange(8), rows)
    assert (np.asarray(st.values)[others] == 7.0).all() and (acc[others] == 3.0).all()
    with pytest.raises(ValueError, match="pass the optimizer that made them"):
        H.find_or_insert(st, ids, 1, config=config)


def test_the_initializer_depends_on_the_id_only():
    config = cfg(dim=8, seed=3)
    w = jnp.asarray(key_words(np.array([1, 2, 3])))
    a = np.asarray(H.initial_rows(config, w))
    b = np.asarray(H.initial_rows(config, w[::-1]))
    np.testing.assert_array_equal(a, b[::-1])
    c = np.asarray(H.initial_rows(dataclasses.replace(config, seed=4), w))
    assert not np.array_equal(a, c)


@pytest.mark.parametrize(
    "state_change, message",
    [
        (lambda s: s._replace(keys=s.keys[:8]), "state.keys must be uint32[16, 2]"),
        (
            lambda s: s._replace(values=s.values.astype(jnp.bfloat16)),
            "state.values must be float32[16, 4]",
        ),
    ],
)
def test_state_and_step_are_checked(state_change, message):
    config = cfg()
    st = state_change(H.init(config))
    with pytest.raises(ValueError, match=re.escape(message)):
        H.find_or_insert(st, np.array([1]), 0, config=config)
    for bad in (-1, 2**31, True, 1.5):
        with pytest.raises(ValueError, match="step must be"):
            H.find_or_insert(H.init(config), np.array([1]), bad, config=config)


def test_find_or_insert_is_in_place_with_donation():
    config = cfg(capacity=1024, bucket_size=16, dim=8)
    st = H.init(config)
    step = jax.jit(lambda s, ids: H.find_or_insert(s, ids, 1, config=config), donate_argnums=(0,))
    ids = jnp.asarray(key_words(np.arange(100)))
    hlo = step.lower(st, ids).compile().as_text()
    assert "embark_hash_find_or_insert" in hlo and "input_output_alias" in hlo
    keys = st.keys
    _, res = step(st, ids)
    assert keys.is_deleted() and int(H.count_dict(res.counts)["inserted"]) == 100


def test_operand_contract_names_the_operand():
    config = cfg()
    st = H.init(config)
    bad_ids = jnp.zeros((4, 3), jnp.uint32)
    with pytest.raises(Exception, match=r"hash_find: ids must have dimension 1 = 2"):
        _ffi._call(abi.Target.HASH_FIND, _ffi.result_type(bad_ids, (4,), jnp.int32))(
            st.keys, st.scores, bad_ids, jnp.int32(0), bucket_size=np.int64(4), ttl=np.int64(0)
        )
    ids = jnp.zeros((4, 2), jnp.uint32)
    with pytest.raises(
        Exception, match=r"hash_find: attribute bucket_size must be >= 1 and divide"
    ):
        _ffi._call(abi.Target.HASH_FIND, _ffi.result_type(ids, (4,), jnp.int32))(
            st.keys, st.scores, ids, jnp.int32(0), bucket_size=np.int64(5), ttl=np.int64(0)
        )
    with pytest.raises(Exception, match=r"attribute eviction must be one of 0 \(NONE\)"):
        _ffi._call(
            abi.Target.HASH_FIND_OR_INSERT,
            (
                _ffi.result_type(st.keys, st.keys.shape, jnp.uint32),
                _ffi.result_type(st.keys, st.keys.shape, jnp.int32),
                _ffi.result_type(st.cand_keys, st.cand_keys.shape, jnp.uint32),
                _ffi.result_type(st.cand_keys, st.cand_keys.shape, jnp.int32),
                _ffi.result_type(ids, (4,), jnp.int32),
                _ffi.result_type(ids, (4,), jnp.bool_),
                _ffi.result_type(ids, (6,), jnp.int32),
                _ffi.result_type(ids, (1,), jnp.uint8),
            ),
        )(
            st.keys,
            st.scores,
            st.cand_keys,
            st.cand_scores,
            ids,
            jnp.int32(0),
            bucket_size=np.int64(4),
            eviction=np.int64(7),
            threshold=np.int64(1),
            ttl=np.int64(0),
        )


def test_inside_shard_map_each_device_owns_a_table():
    """One shard per device: the kernels run per device with their own tables."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    g = len(jax.devices())
    mesh = jax.make_mesh((g,), ("device",))
    config = cfg(capacity=64, bucket_size=8)
    one = H.init(config)
    sharded = NamedSharding(mesh, P("device"))
    stacked = jax.tree.map(lambda x: jax.device_put(np.stack([x] * g), sharded), one)
    ids = jax.device_put(np.stack([key_words(np.arange(d, d + 20)) for d in range(g)]), sharded)

    def body(st, ids):
        st = jax.tree.map(lambda x: x[0], st)
        st, res = H.find_or_insert(st, ids[0], 0, config=config)
        return res.slots[None], res.counts[None]

    spec = P("device")
    slots, counts = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))
    )(stacked, ids)
    slots, counts = np.asarray(slots), np.asarray(counts)
    for d in range(g):
        model = HashTableModel.for_config(config)
        want, _, c = model.find_or_insert(list(range(d, d + 20)), 0)
        assert slots[d].tolist() == want
        assert H.count_dict(counts[d]) == c


# --- training on a dynamic table: find_or_insert + lookup_pool + the fused update ----------


@pytest.mark.parametrize(
    "opt", [O.SGD(learning_rate=0.1), O.Adagrad(learning_rate=0.1)], ids=lambda o: type(o).__name__
)
def test_training_steps_on_a_dynamic_table(opt):
    """A few steps: slots from find_or_insert are the rows of lookup_pool and of the fused
    backward + optimizer; the FFI path equals the reference path."""
    config = cfg(capacity=64, bucket_size=8, dim=8, eviction="lfu", admission_threshold=2)
    rng = np.random.default_rng(11)
    b, h = 16, 3
    universe = rng.integers(-(2**62), 2**62, 80)

    def step_fn(st, ids, step, backend):
        st, res = H.find_or_insert(st, ids, step, config=config, optimizer=opt, backend=backend)
        seg = jnp.repeat(jnp.arange(b, dtype=jnp.int32), h)
        out = ops.lookup_pool(st.values, res.slots, seg, b, combiner="mean", backend=backend)
        grads = jnp.tanh(out) + 0.1  # a stand-in for the model's gradient
        values, opt_state, _ = ops.lookup_pool_backward_update(
            st.values,
            st.opt_state,
            grads,
            res.slots,
            seg,
            optimizer=opt,
            combiner="mean",
            backend=backend,
        )
        return st._replace(values=values, opt_state=opt_state), out, res.counts

    streams = [universe[rng.integers(0, 80, b * h)] for _ in range(5)]
    results = {}
    for backend in ("ffi", "reference"):
        fn = jax.jit(functools.partial(step_fn, backend=backend))
        st = H.init(config, optimizer=opt)
        outs = []
        for step, ids in enumerate(streams):
            st, out, counts = fn(st, jnp.asarray(key_words(ids)), step)
            outs.append((np.asarray(out), H.count_dict(counts)))
        results[backend] = (st, outs)
    (st_f, outs_f), (st_r, outs_r) = results["ffi"], results["reference"]
    for (of, cf), (orf, cr) in zip(outs_f, outs_r, strict=True):
        assert cf == cr
        np.testing.assert_allclose(of, orf, rtol=1e-6, atol=1e-6)
    for name in ("keys", "scores", "cand_keys", "cand_scores"):
        np.testing.assert_array_equal(
            np.asarray(getattr(st_f, name)), np.asarray(getattr(st_r, name))
        )
    np.testing.assert_allclose(
        np.asarray(st_f.values), np.asarray(st_r.values), rtol=1e-6, atol=1e-6
    )
    for a, r in zip(jax.tree.leaves(st_f.opt_state), jax.tree.leaves(st_r.opt_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-6, atol=1e-6)
    # the rows moved: trained rows differ from their initial values
    held = np.asarray(H.find(st_f, jnp.asarray(key_words(universe)), config=config))
    rows = held[held >= 0]
    init = np.asarray(H.initial_rows(config, jnp.asarray(key_words(universe[held >= 0]))))
    assert len(rows) > 10 and not np.allclose(np.asarray(st_f.values)[rows], init)


def _sha(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.asarray(a).tobytes())
    return h.hexdigest()


def test_same_ids_same_order_same_table():
    config = cfg(capacity=256, bucket_size=8, eviction="lru", admission_threshold=2, ttl_steps=3)
    rng = np.random.default_rng(2)
    stream = [rng.integers(0, 600, 300) for _ in range(6)]

    def run():
        st = H.init(config)
        for step, ids in enumerate(stream):
            st, _ = H.find_or_insert(st, ids, step, config=config)
        return _sha(*jax.tree.leaves(st))

    assert run() == run()
    st = H.init(config)
    for step, ids in enumerate(stream):
        st, _ = H.find_or_insert(st, ids[::-1], step, config=config)
    assert _sha(*jax.tree.leaves(st)) != run()  # the order is part of the input


def test_readme_dynamic_table_example_runs(tmp_path):
    from tests.test_readme import readme_python_blocks, run_clean

    blocks = [b for b in readme_python_blocks() if "hash_table.find_or_insert" in b]
    assert len(blocks) == 1
    r = run_clean(blocks[0], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("0 [ -1  -1  -1 608 736  -1] {'found': 0, 'inserted': 2")
    assert "'refused': 3" in lines[0] and "'found': 4, 'inserted': 1" in lines[1]
    assert lines[-1] == "[608  -1]"  # the comments in the README show these
