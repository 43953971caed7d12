"""Dynamic tables sharded over 8 fake devices (`sharding.dynamic`) against one device: the
same outputs every step and the same logical table (id -> row) after training, exact
counts, evaluation that changes nothing, one-line errors, and a donated step with no
whole-table copy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from embark_jax.core.dynamic import (
    DynamicConfig,
    DynamicFeatureConfig,
    DynamicTableConfig,
    join_key_words,
    key_words,
    shard_of,
)
from embark_jax.ops import hash_table
from embark_jax.ops.optimizers import RowWiseAdagrad
from embark_jax.sharding.dynamic import COUNT_NAMES, DynamicShards, count_dict, unique_words

B = 16
CONFIG = DynamicConfig(
    (
        DynamicTableConfig(name="users", dim=8, capacity=64, bucket_size=8),
        DynamicTableConfig(name="items", dim=4, capacity=64, bucket_size=4, eviction="lfu"),
    ),
    (
        DynamicFeatureConfig(name="user", table="users", max_hotness=1),
        DynamicFeatureConfig(name="clicked", table="items", max_hotness=3, combiner="mean"),
        DynamicFeatureConfig(name="viewed", table="items", max_hotness=2, combiner="sqrtn"),
    ),
)


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("d",))


def _shards(n, config=CONFIG, scale=1):
    tables = tuple(
        DynamicTableConfig(
            name=t.name,
            dim=t.dim,
            capacity=t.capacity * scale,
            bucket_size=t.bucket_size,
            eviction=t.eviction,
        )
        for t in config.tables
    )
    cfg = DynamicConfig(tables, config.features)
    opt = RowWiseAdagrad(learning_rate=0.5)
    return DynamicShards(cfg, _mesh(n), {t.name: opt for t in tables})


def _batch(rng, mesh, pool=40):
    out = {}
    for f in CONFIG.features:
        raw = rng.integers(0, pool, (B, f.max_hotness)).astype(np.int64) * 0x9E3779B97F4A7C1
        raw[rng.random(raw.shape) < 0.25] = -1  # padding
        words = key_words(raw.reshape(-1)).reshape(B, f.max_hotness, 2)
        out[f.name] = jax.device_put(words, NamedSharding(mesh, P("d")))
    return out


def _train(shards, steps=4, seed=0):
    """`steps` donated steps, compiled once; gradients are a fixed function of the outputs."""

    @jax.jit
    def one(states, ids, step):
        lk = shards.lookup(states, ids, step)
        grads = {k: jnp.cos(v + step) for k, v in lk.outputs.items()}
        staged, finite = shards.stage(lk.states, lk.residuals, grads, step)
        return shards.commit(lk.states, staged, finite), lk.outputs, lk.counts

    states = shards.init()
    rng = np.random.default_rng(seed)
    outputs, counts = [], []
    for step in range(steps):
        states, out, cnt = one(states, _batch(rng, shards.mesh), jnp.int32(step))
        outputs.append({k: np.asarray(v) for k, v in out.items()})
        counts.append(count_dict(shards.config, cnt))
    return states, outputs, counts


def _host(state):
    """The fields of a state the checks read (a zero-size sharded array cannot be fetched)."""
    return {k: np.asarray(getattr(state, k)) for k in ("keys", "scores", "values")} | {
        "acc": np.asarray(state.opt_state.accumulator)
    }


def _logical(shards, states):
    """id -> (row, optimizer slot row) over every shard."""
    out = {}
    for t in shards.config.tables:
        s = _host(states[t.name])
        rows = {}
        for g in range(shards.num_shards):
            keys = s["keys"][g]
            live = ~((keys[:, 0] == 0xFFFFFFFF) & (keys[:, 1] == 0xFFFFFFFF))
            ids = join_key_words(keys[live])
            assert (shard_of(keys[live], shards.num_shards) == g).all()
            for i, v, a in zip(ids, s["values"][g][live], s["acc"][g][live], strict=True):
                rows[int(i)] = (v, a)
        out[t.name] = rows
    return out


def test_unique_words_matches_numpy(rng):
    raw = rng.integers(-3, 5, 200).astype(np.int64) << 33
    raw[::7] = -1
    uniq, inv = jax.jit(unique_words)(jnp.asarray(key_words(raw)))
    uniq, inv = np.asarray(uniq), np.asarray(inv)
    want = np.unique(raw[raw != -1].view(np.uint64)).view(np.int64)
    k = len(want)
    assert sorted(join_key_words(uniq[:k]).view(np.uint64)) == sorted(want.view(np.uint64))
    assert (uniq[k:] == 0xFFFFFFFF).all()
    np.testing.assert_array_equal(inv == -1, raw == -1)
    np.testing.assert_array_equal(
        join_key_words(uniq[np.maximum(inv, 0)])[raw != -1], raw[raw != -1]
    )


def test_eight_devices_match_one():
    """Outputs every step and the trained table (each id's row and optimizer slot) are the
    same on 8 shards as on 1 shard of 8x the capacity (nothing evicted in either)."""
    s8, s1 = _shards(8), _shards(1, scale=8)
    st8, out8, _c8 = _train(s8)
    st1, out1, c1 = _train(s1)
    for a, b in zip(out8, out1, strict=True):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-6)
    assert any(np.abs(a[k]).max() > 0 for a in out8 for k in a)
    l8, l1 = _logical(s8, st8), _logical(s1, st1)
    for t in l8:
        assert l8[t].keys() == l1[t].keys() and len(l8[t]) > 10
        for i in l8[t]:
            np.testing.assert_allclose(l8[t][i][0], l1[t][i][0], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(l8[t][i][1], l1[t][i][1], rtol=1e-6, atol=1e-6)
    # a table of one shard inserts each id once; every id is counted once per step
    total = {t: sum(c[t]["inserted"] for c in c1) for t in l1}
    assert total == {t: len(l1[t]) for t in l1}


def test_counts_account_for_every_unique_id_per_device():
    """found + inserted + refused + dropped = the distinct ids each device sent (summed over
    devices), with a bucket too small for them: the drops are counted, not hidden."""
    tiny = DynamicConfig(
        (DynamicTableConfig(name="t", dim=4, capacity=2, bucket_size=1, eviction="none"),),
        (DynamicFeatureConfig(name="f", table="t", max_hotness=4),),
    )
    shards = DynamicShards(tiny, _mesh(8), {"t": RowWiseAdagrad(learning_rate=0.1)})
    states = shards.init()
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 1000, (B, 4)).astype(np.int64)
    words = key_words(raw.reshape(-1)).reshape(B, 4, 2)
    ids = {"f": jax.device_put(words, NamedSharding(shards.mesh, P("d")))}
    lk = jax.jit(shards.lookup)(states, ids, 0)
    c = count_dict(tiny, lk.counts)["t"]
    per_device = sum(len(np.unique(raw[d * 2 : d * 2 + 2])) for d in range(8))
    assert c["found"] + c["inserted"] + c["refused"] + c["dropped"] == per_device
    assert c["dropped"] > 0 and c["inserted"] <= 8 * 2 and c["overflow"] == 0
    assert list(count_dict(tiny, lk.counts)["t"]) == list(COUNT_NAMES)


def test_evaluation_reads_and_changes_nothing():
    shards = _shards(8)
    states, _, _ = _train(shards, steps=2)
    before = {t: _host(s) for t, s in states.items()}
    rng = np.random.default_rng(0)  # the first training batch: known ids
    known = _batch(rng, shards.mesh)
    unknown = {k: jnp.full_like(v, 7) for k, v in known.items()}  # never inserted
    evaluate = jax.jit(lambda s, ids: shards.lookup(s, ids, 5, train=False))
    lk = evaluate(states, known)
    for t, s in lk.states.items():
        jax.tree.map(np.testing.assert_array_equal, _host(s), before[t])
    assert np.abs(np.asarray(lk.outputs["user"])).max() > 0
    zero = evaluate(states, unknown)
    for v in zero.outputs.values():
        np.testing.assert_array_equal(np.asarray(v), 0.0)
    assert int(np.asarray(zero.counts).sum()) == 0


def test_bad_ids_are_one_line_errors():
    shards = _shards(8)
    states = shards.init()
    ids = _batch(np.random.default_rng(0), shards.mesh)
    with pytest.raises(
        ValueError, match=r"features \['clicked', 'user'\] given, \['clicked', 'user', 'viewed'\]"
    ):
        shards.lookup(states, {k: v for k, v in ids.items() if k != "viewed"}, 0)
    bad = dict(ids, user=ids["user"].astype(jnp.int32))
    with pytest.raises(ValueError, match=r"dynamic feature 'user': ids must be uint32 \[B, 1, 2\]"):
        shards.lookup(states, bad, 0)
    odd = {k: v[:12] for k, v in ids.items()}
    with pytest.raises(ValueError, match=r"batch sizes \[12\] must be one size divisible by the 8"):
        shards.lookup(states, odd, 0)
    with pytest.raises(ValueError, match=r"no optimizer for dynamic tables \['items'\]"):
        DynamicShards(CONFIG, _mesh(8), {"users": RowWiseAdagrad(learning_rate=0.1)})
    with pytest.raises(
        ValueError, match=r"dynamic feature 'f': combiner must be sum, mean or sqrtn"
    ):
        DynamicFeatureConfig(name="f", table="t", combiner="none")


def test_a_donated_step_copies_no_table():
    """Lookup (with inserts), staged update and commit in one donated jit: the state is
    aliased and the temporaries are a small fraction of the shard (no whole-table copy)."""
    big = DynamicConfig(
        (DynamicTableConfig(name="t", dim=16, capacity=1 << 15),),
        (DynamicFeatureConfig(name="f", table="t", max_hotness=4),),
    )
    shards = DynamicShards(big, _mesh(8), {"t": RowWiseAdagrad(learning_rate=0.1)})
    states = shards.init()

    def step(states, ids):
        lk = shards.lookup(states, ids, 1)
        staged, finite = shards.stage(lk.states, lk.residuals, lk.outputs, 1)
        return shards.commit(lk.states, staged, finite)

    words = key_words(np.arange(B * 4, dtype=np.int64) * 977).reshape(B, 4, 2)
    ids = {"f": jax.device_put(words, NamedSharding(shards.mesh, P("d")))}
    compiled = jax.jit(step, donate_argnums=0).lower(states, ids).compile()
    mem = compiled.memory_analysis()
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(states)) // 8
    assert mem.alias_size_in_bytes >= 0.99 * mem.argument_size_in_bytes - 4096
    assert mem.temp_size_in_bytes < 0.05 * state_bytes, (mem.temp_size_in_bytes, state_bytes)
    new = jax.jit(step, donate_argnums=0)(states, ids)
    assert int(hash_table.occupancy(jax.tree.map(lambda x: x[0], new["t"]), big.tables[0])) > 0


def test_a_replicated_table_matches_one_shard_and_its_copies_stay_identical():
    """`items` held whole on each of 8 devices (`DynamicConfig.replicated`), `users`
    sharded: outputs every step equal the 1-shard run's; the 8 copies are bit-identical and
    each holds every id with the 1-shard run's row and optimizer slot; inserts count once."""
    base = _shards(8)
    items = base.config.table("items")
    whole = dataclasses.replace(items, capacity=items.capacity * 8)
    cfg = DynamicConfig(
        (base.config.table("users"), whole), base.config.features, replicated=("items",)
    )
    rep = DynamicShards(cfg, base.mesh, base.optimizers)
    st_r, out_r, c_r = _train(rep)
    s1 = _shards(1, scale=8)
    st1, out1, _ = _train(s1)
    for a, b in zip(out_r, out1, strict=True):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-6)
    copies = _host(st_r["items"])
    for k, v in copies.items():
        assert all(np.array_equal(v[g], v[0]) for g in range(8)), k
    live = lambda keys: ~((keys[:, 0] == 0xFFFFFFFF) & (keys[:, 1] == 0xFFFFFFFF))  # noqa: E731
    got = {
        int(i): (v, a)
        for i, v, a in zip(
            join_key_words(copies["keys"][0][live(copies["keys"][0])]),
            copies["values"][0][live(copies["keys"][0])],
            copies["acc"][0][live(copies["keys"][0])],
            strict=True,
        )
    }
    want = _logical(s1, st1)["items"]
    assert got.keys() == want.keys() and len(got) > 10
    for i in got:
        np.testing.assert_allclose(got[i][0], want[i][0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got[i][1], want[i][1], rtol=1e-6, atol=1e-6)
    assert sum(c["items"]["inserted"] for c in c_r) == len(got)
    assert all(c["items"]["overflow"] == 0 for c in c_r)
    # the HLO of the replicated table's path has no all-to-all of its own: one table routed
    hlo = (
        jax.jit(lambda s, i: rep.lookup(s, i, 0))
        .lower(st_r, _batch(np.random.default_rng(0), rep.mesh))
        .as_text()
    )
    plain = (
        jax.jit(lambda s, i: base.lookup(s, i, 0))
        .lower(base.init(), _batch(np.random.default_rng(0), base.mesh))
        .as_text()
    )
    assert hlo.count("all_to_all") < plain.count("all_to_all")


def test_a_replicated_table_sends_at_most_capacity_ids_and_counts_the_rest():
    """Each device sends its first `capacity` unique ids (in (high, low) word order); the
    occurrences of the others are `overflow` and read zeros; every inserted id is held by
    all 8 copies."""
    small = DynamicConfig(
        (DynamicTableConfig(name="t", dim=4, capacity=4, bucket_size=4, eviction="none"),),
        (DynamicFeatureConfig(name="f", table="t", max_hotness=4),),
        replicated=("t",),
    )
    shards = DynamicShards(small, _mesh(8), {"t": RowWiseAdagrad(learning_rate=0.1)})
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 1000, (B, 4)).astype(np.int64) * 0x100000001
    words = key_words(raw.reshape(-1)).reshape(B, 4, 2)
    ids = {"f": jax.device_put(words, NamedSharding(shards.mesh, P("d")))}
    lk = jax.jit(shards.lookup)(shards.init(), ids, 0)
    c = count_dict(small, lk.counts)["t"]
    b = B // 8
    lost = 0
    for d in range(8):
        mine = raw[d * b : (d + 1) * b].reshape(-1)
        order = np.unique(mine.view(np.uint64))  # (high, low) order = unsigned order
        lost += int(np.isin(mine.view(np.uint64), order[4:]).sum())
    assert c["overflow"] == lost > 0
    assert c["inserted"] == 4 and c["found"] == 0  # the first 4 distinct ids of device 0
    keys = np.asarray(lk.states["t"].keys)
    assert all(np.array_equal(keys[g], keys[0]) for g in range(8))
