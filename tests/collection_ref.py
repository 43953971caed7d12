"""Single-device reference of an embedding collection: forward from full tables, and the
optimizer update of every table from the merged per-id gradients of all its features."""

import jax.numpy as jnp
import numpy as np

from embark_jax import ops
from embark_jax.core.specs import Combiner
from embark_jax.ops.lookup import id_scale


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
