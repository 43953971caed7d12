"""Single-device reference of an embedding collection: forward from full tables, the
optimizer update of every table from the merged per-id gradients of all its features, and
(`routed`) what a routed group delivers when its buckets overflow."""

import jax.numpy as jnp
import numpy as np

from embark_jax import ops
from embark_jax.core.specs import Combiner
from embark_jax.ops.lookup import id_scale
from tests import numpy_ref


def forward(config, tables, batch):
    out = {}
    b = batch.batch_size
    for f in config.features:
        ids, seg, w = batch.flat(f.name)
        y = ops.reference.lookup_pool(jnp.asarray(tables[f.table]), ids, seg, b, w, f.combiner)
        if f.combiner is Combiner.NONE:
            y = y.reshape(b, batch.hotness(f.name), -1)
        out[f.name] = np.asarray(y)
    return out


def update(config, tables, batch, grads, optimizer, states=None):
    """Returns (new tables, new states) after one sparse step on every table; `optimizer`
    is one for all tables or a dict table name -> optimizer."""
    new_t, new_s = {}, {}
    b = batch.batch_size
    for t in config.tables:
        rows, per_id = [], []
        for f in config.features:
            if f.table != t.name:
                continue
            ids, seg, w = batch.flat(f.name)
            g = jnp.asarray(grads[f.name], jnp.float32).reshape(-1, t.dim)
            src = jnp.arange(ids.shape[0]) if f.combiner is Combiner.NONE else seg
            scale = id_scale(ids, src, g.shape[0], w, f.combiner, t.vocab_size)
            per_id.append(g[src] * scale[:, None])
            rows.append(jnp.where(scale != 0, ids, -1))
        rows, per_id = jnp.concatenate(rows), jnp.concatenate(per_id)
        uniq, merged = ops.merge_duplicate_rows(rows, per_id, backend="reference")
        table = jnp.asarray(tables[t.name])
        opt = optimizer[t.name] if isinstance(optimizer, dict) else optimizer
        state = opt.init(table) if states is None else states[t.name]
        table, state = opt.update(table, state, uniq, merged)
        new_t[t.name], new_s[t.name] = np.asarray(table), state
    del b
    return new_t, new_s


def routed(coll, batch):
    """`(outputs, lost per table)` of a collection whose tables form one RB or UB group,
    from the numpy bucket simulation at the capacities its cluster allocated."""
    from embark_jax.sharding.collection import _clusters_for

    lowered = coll.lowered
    (group,) = lowered.groups
    cl = _clusters_for(lowered, batch, coll.options)[group.name]
    tables = coll.full_tables()
    devices = {tp.name: tp.devices for tp in lowered.plan.tables}
    feats = [(f.name, f.table, f.combiner.value) for f in lowered.features_of(group)]
    ids = {n: np.asarray(batch.ids[n]) for n in batch.feature_names}
    g = lowered.num_devices
    if group.cluster.value == "rb":
        return numpy_ref.rb_lookup(tables, devices, feats, ids, g, cl.capacity)
    return numpy_ref.ub_lookup(tables, devices, feats, ids, g, cl.capacity, cl.unique_capacity)
