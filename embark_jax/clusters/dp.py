"""Data-parallel cluster: every device holds a replica; lookups are local. The backward
gathers every device's sparse row gradients (all-gather over the mesh) and applies the same
merged update on every replica, so replicas stay identical and lazy optimizers stay lazy."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embark_jax import ops
from embark_jax.clusters.base import ClusterBase, feature_inputs
from embark_jax.ops.lookup import id_scale
from embark_jax.specs import Combiner

__all__ = ["DPCluster"]


class DPCluster(ClusterBase):
    def route(self, batch):
        res = {}
        for name, fi in feature_inputs(self.lowered, self.group, batch).items():
            f = self.lowered.config.feature_by_name[name]
            offset = self.group.shard(f.table, 0, 0).row_offset
            res[name] = {
                "rows": jnp.where(fi.ids >= 0, fi.ids + offset, -1),
                "seg": fi.seg,
                "w": fi.weights,
            }
        return res, jnp.zeros((len(self.table_names),), jnp.int32)

    def owner(self, buffer, res):
        out = {}
        for f in self.features:
            r = res[f.name]
            y = ops.lookup_pool(
                buffer, r["rows"], r["seg"], self.b, r["w"], f.combiner, indices_are_sorted=True
            )
            out[f.name] = y.astype(jnp.float32).reshape(self.output_shape(f))
        return out

    def combine(self, owner_out, res):
        return dict(owner_out)

    def update(self, buffer, state, res, g_owner, optimizer):
        rows, grads = [], []
        for f in self.features:
            r = res[f.name]
            g = g_owner[f.name].astype(jnp.float32)
            per_id = f.combiner is Combiner.NONE
            g = g.reshape(-1, g.shape[-1])
            n_out = g.shape[0]
            seg = jnp.arange(r["rows"].shape[0], dtype=jnp.int32) if per_id else r["seg"]
            scale = id_scale(r["rows"], seg, n_out, r["w"], f.combiner, None)
            grads.append(jnp.take(g, seg, axis=0) * scale[:, None])
            rows.append(jnp.where(scale != 0, r["rows"], -1))
        rows = jax.lax.all_gather(jnp.concatenate(rows), self.axis_names, tiled=True)
        grads = jax.lax.all_gather(jnp.concatenate(grads), self.axis_names, tiled=True)
        return self.owner_sparse_update(
            buffer, state, rows, None, None, grads, optimizer, Combiner.NONE
        )
