"""Data-parallel cluster: every device holds a replica; lookups are local. The backward
exchanges gradients by whichever moves fewer bytes, a dense all-reduce of the `[V, d]`
gradient (small tables) or an all-gather of every device's per-id gradients (large ones),
and applies the same update of the touched rows on every replica, so replicas stay
identical and lazy optimizers stay lazy (stochastic rounding too: its bits depend on the
step's seed, the row and the column only, never on the device)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from embark_jax import ops
from embark_jax.core.options import DPGradients
from embark_jax.core.specs import Combiner
from embark_jax.ops.lookup import id_scale
from embark_jax.sharding.clusters.base import ClusterBase, feature_inputs

__all__ = ["DPCluster", "DPResiduals"]


class DPResiduals(NamedTuple):
    """Per feature: the local lookups of this device's replica."""

    rows: dict[str, jax.Array]  # [b * H] buffer row of each id slot, -1 for padding
    seg: dict[str, jax.Array]  # [b * H] sample of each id slot
    w: dict[str, jax.Array]  # [b * H] weight of each id slot (0 for padding)


class DPCluster(ClusterBase):
    def route(self, batch):
        res = DPResiduals({}, {}, {})
        for name, fi in feature_inputs(self.lowered, self.group, batch).items():
            f = self.lowered.config.feature_by_name[name]
            offset = self.group.shard(f.table, 0, 0).row_offset
            res.rows[name] = jnp.where(fi.ids >= 0, fi.ids + offset, -1)
            res.seg[name] = fi.seg
            res.w[name] = fi.weights
        return res, jnp.zeros((len(self.table_names),), jnp.int32)

    def owner(self, buffer, res):
        out = {}
        for f in self.features:
            rows, seg, w = res.rows[f.name], res.seg[f.name], res.w[f.name]
            y = ops.lookup_pool(buffer, rows, seg, self.b, w, f.combiner, indices_are_sorted=True)
            out[f.name] = y.astype(jnp.float32).reshape(self.output_shape(f))
        return out

    def combine(self, owner_out, res):
        return dict(owner_out)

    def stage(self, buffer, state, res, g_owner, optimizer, step, seed=None):
        rows, grads = [], []
        for f in self.features:
            f_rows = res.rows[f.name]
            g = g_owner[f.name].astype(jnp.float32)
            per_id = f.combiner is Combiner.NONE
            g = g.reshape(-1, g.shape[-1])
            n_out = g.shape[0]
            seg = jnp.arange(f_rows.shape[0], dtype=jnp.int32) if per_id else res.seg[f.name]
            scale = id_scale(f_rows, seg, n_out, res.w[f.name], f.combiner, None)
            grads.append(jnp.take(g, seg, axis=0) * scale[:, None])
            rows.append(jnp.where(scale != 0, f_rows, -1))
        rows, grads = jnp.concatenate(rows), jnp.concatenate(grads)
        vocab, width = buffer.shape
        dense_bytes = 2 * vocab * (width + 1) * 4  # all-reduce of grads + touched counts
        sparse_bytes = self.num_devices * rows.shape[0] * (width + 1) * 4
        mode = self.options.dp_gradients
        if mode is DPGradients.DENSE or (mode is DPGradients.AUTO and dense_bytes < sparse_bytes):
            # dense all-reduce, then the sparse update of the rows any replica touched
            # (untouched rows stay untouched: lazy optimizers stay lazy)
            g = jax.lax.psum(ops.segment_sum(grads, rows, vocab), self.axis_names)
            ones = jnp.ones(rows.shape, jnp.float32)
            touched = jax.lax.psum(ops.segment_sum(ones, rows, vocab), self.axis_names)
            rows_all = jnp.where(touched > 0, jnp.arange(vocab, dtype=jnp.int32), -1)
            return self.owner_stage(
                buffer, state, rows_all, None, None, g, optimizer, Combiner.NONE, step, seed
            )
        rows = jax.lax.all_gather(rows, self.axis_names, tiled=True)
        grads = jax.lax.all_gather(grads, self.axis_names, tiled=True)
        return self.owner_stage(
            buffer, state, rows, None, None, grads, optimizer, Combiner.NONE, step, seed
        )
