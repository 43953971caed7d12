"""Dynamic tables in logical form (`training.dynamic_io`): export, import onto 1, 3 or 8
shards and export again is the identity; every id is found at its row; delta export;
imports that do not fit or bad input are one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax.core.dynamic import DynamicTableConfig, key_words, shard_of
from embark_jax.ops import hash_table
from embark_jax.training.dynamic_io import (
    LogicalDynamicTable,
    delta_since,
    export_logical,
    import_logical,
)
from tests.sharding.test_dynamic import _shards, _train


@pytest.fixture(scope="module")
def trained():
    shards = _shards(8)
    states, _, _ = _train(shards)
    return shards, states


def _grown(t, factor):
    return DynamicTableConfig(
        name=t.name, dim=t.dim, capacity=t.capacity * factor, bucket_size=t.bucket_size
    )


@pytest.mark.parametrize("num_shards", [1, 3, 8])
def test_reshard_round_trip_is_exact_and_every_id_is_found(trained, num_shards):
    shards, states = trained
    for t in shards.config.tables:
        logical = export_logical(states[t.name], t)
        assert logical.ids.size > 10 and logical.step == 3
        assert (np.diff(logical.ids.view(np.uint64)) > 0).all()  # sorted, distinct
        cfg = t if num_shards == 8 else _grown(t, 8)
        host = import_logical(logical, cfg, num_shards, shards.optimizers[t.name])
        again = export_logical(host, cfg)
        for k, v in logical.as_tree().items():
            np.testing.assert_array_equal(again.as_tree()[k], v, err_msg=k)
        words = key_words(logical.ids)
        owner = shard_of(words, num_shards)
        for g in range(num_shards):
            one = jax.tree.map(lambda x, g=g: jnp.asarray(x[g]), host)
            slots = np.asarray(hash_table.find(one, jnp.asarray(words[owner == g]), config=cfg))
            assert (slots >= 0).all()
            np.testing.assert_array_equal(np.asarray(one.values)[slots], logical.values[owner == g])


def test_delta_since_is_the_rows_seen_since(trained):
    shards, states = trained
    t = shards.config.tables[0]
    logical = export_logical(states[t.name], t)
    ids, values = delta_since(states[t.name], t, 2)
    want = logical.scores[:, 0] >= 2
    np.testing.assert_array_equal(ids, logical.ids[want])
    np.testing.assert_array_equal(values, logical.values[want])
    assert 0 < ids.size < logical.ids.size
    assert delta_since(states[t.name], t, 4)[0].size == 0


def test_imports_that_do_not_fit_or_bad_input_are_one_line_errors(trained):
    shards, states = trained
    t = shards.config.tables[0]
    logical = export_logical(states[t.name], t)
    small = DynamicTableConfig(
        name=t.name, dim=t.dim, capacity=t.bucket_size, bucket_size=t.bucket_size
    )
    with pytest.raises(
        ValueError, match=r"ids do not fit their buckets on 1 shards of 8 slots \(e.g. shard 0"
    ):
        import_logical(logical, small, 1)
    with pytest.raises(ValueError, match=r"num_shards must be an int >= 1, got 0"):
        import_logical(logical, t, 0)
    twice = logical._replace(ids=np.concatenate([logical.ids[:1], logical.ids[:-1]]))
    with pytest.raises(ValueError, match=r"ids must be distinct, 1 repeat"):
        import_logical(twice, t, 8)
    with pytest.raises(ValueError, match=r"values must be float32\[\d+, 8\]"):
        import_logical(logical._replace(values=logical.values[:, :4]), t, 8)
    padded = logical._replace(ids=np.where(np.arange(logical.ids.size) == 0, -1, logical.ids))
    with pytest.raises(ValueError, match=r"ids hold the padding id -1"):
        import_logical(padded, t, 8)
    assert LogicalDynamicTable.from_tree(logical.as_tree()).step == logical.step


def test_export_and_delta_refuse_a_state_of_another_table(trained):
    shards, states = trained
    t = shards.config.tables[0]
    state = states[t.name]
    wider = DynamicTableConfig(name=t.name, dim=t.dim * 2, capacity=t.capacity)
    for fn, args in ((export_logical, ()), (delta_since, (0,))):
        with pytest.raises(ValueError, match=rf"^{fn.__name__}: table 'users' has capacity"):
            fn(state, wider, *args)
        with pytest.raises(ValueError, match=rf"^{fn.__name__}: table 'users' has capacity"):
            fn(state, _grown(t, 2), *args)
        with pytest.raises(ValueError, match=rf"^{fn.__name__}: state must be a DynamicTableState"):
            fn(state._asdict(), t, *args)
    with pytest.raises(ValueError, match=r"since_step must be an int, got 1.5"):
        delta_since(state, t, 1.5)
