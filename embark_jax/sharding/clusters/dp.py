"""Data-parallel cluster: every device holds a replica; lookups are local. The backward
exchanges gradients by the rule of `core.dp_exchange`: a dense all-reduce of the `[V, d]`
gradient (tiny tables) or an all-gather of every device's id slots and pooled output
gradients (the fused kernel merges duplicates; no per-id gradient is written), and applies
the same update of the touched rows on every replica, so replicas stay identical and lazy
optimizers stay lazy (stochastic rounding too: its bits depend on the step's seed, the row
and the column only, never on the device)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax import ops
from embark_jax.core import dp_exchange
from embark_jax.core.options import DPGradients
from embark_jax.core.specs import Combiner
from embark_jax.ops.lookup import id_scale
from embark_jax.sharding import routing
from embark_jax.sharding.clusters.base import ClusterBase, feature_inputs

__all__ = ["DPCluster", "DPResiduals"]


class DPResiduals(NamedTuple):
    """Per feature: the local lookups of this device's replica."""

    rows: dict[str, jax.Array]  # [b * H] buffer row of each id slot, -1 for padding
    seg: dict[str, jax.Array]  # [b * H] sample of each id slot
    w: dict[str, jax.Array | None]  # [b * H] weight of each id slot (0 for padding); None:
    # an unweighted feature


class DPCluster(ClusterBase):
    def route(self, batch):
        res = DPResiduals({}, {}, {})
        for name, fi in feature_inputs(self.lowered, self.group, batch).items():
            f = self.lowered.config.feature_by_name[name]
            offset = self.group.shard(f.table, 0, 0).row_offset
            res.rows[name] = jnp.where(fi.ids >= 0, fi.ids + offset, -1)
            res.seg[name] = fi.seg
            res.w[name] = fi.weights if name in batch.features.weights else None
        return res, jnp.zeros((len(self.table_names),), jnp.int32)

    def owner(self, buffer, res):
        """One kernel call for all features that pool alike (same combiner, weighted or not;
        a sequence feature pools like `sum` with one id per bag), usually one per group: their
        bags one after the other."""
        calls: dict[tuple[Combiner, bool], list] = {}
        for f in self.features:
            kind = Combiner.SUM if f.combiner is Combiner.NONE else f.combiner
            calls.setdefault((kind, res.w[f.name] is not None), []).append(f)
        out = {}
        for (combiner, weighted), feats in calls.items():
            rows, seg, w, sizes = [], [], [], []
            for f in feats:
                n_ids = res.rows[f.name].shape[0]
                per_id = f.combiner is Combiner.NONE
                f_seg = jnp.arange(n_ids, dtype=jnp.int32) if per_id else res.seg[f.name]
                rows.append(res.rows[f.name])
                seg.append(f_seg + sum(sizes))
                w.append(res.w[f.name])
                sizes.append(n_ids if per_id else self.b)
            y = ops.lookup_pool(
                buffer,
                jnp.concatenate(rows),
                jnp.concatenate(seg),
                sum(sizes),
                jnp.concatenate(w) if weighted else None,
                combiner,
                indices_are_sorted=True,
            )
            parts = jnp.split(y, np.cumsum(sizes)[:-1].tolist()) if len(feats) > 1 else [y]
            for f, part in zip(feats, parts, strict=True):
                out[f.name] = part.astype(jnp.float32).reshape(self.output_shape(f))
        return out

    def combine(self, owner_out, res):
        return dict(owner_out)

    def stage(self, buffer, state, res, g_owner, optimizer, step, seed=None):
        rows, seg, scale, grads = self._flat(res, g_owner)
        vocab, width = buffer.shape
        mode = self.options.dp_gradients
        dense = dp_exchange.dense_wins(
            vocab, width, rows.shape[0], grads.shape[0], self.num_devices
        )
        if mode is DPGradients.DENSE or (mode is DPGradients.AUTO and dense):
            # dense all-reduce, then the sparse update of the rows any replica touched
            # (untouched rows stay untouched: lazy optimizers stay lazy)
            per_id = jnp.take(grads, seg, axis=0) * scale[:, None]
            g = jax.lax.psum(ops.segment_sum(per_id, rows, vocab), self.axis_names)
            ones = jnp.ones(rows.shape, jnp.float32)
            touched = jax.lax.psum(ops.segment_sum(ones, rows, vocab), self.axis_names)
            rows_all = jnp.where(touched > 0, jnp.arange(vocab, dtype=jnp.int32), -1)
            return self.owner_stage(
                buffer, state, rows_all, None, None, g, optimizer, Combiner.NONE, step, seed
            )
        if self.num_devices > 1:  # every replica applies every device's gradients
            seg = seg + routing.device_index(self.axis_names) * grads.shape[0]
            rows, seg, scale, grads = (
                jax.lax.all_gather(x, self.axis_names, tiled=True)
                for x in (rows, seg, scale, grads)
            )
        return self.owner_stage(
            buffer, state, rows, seg, scale, grads, optimizer, Combiner.SUM, step, seed
        )

    def _flat(self, res, g_owner):
        """The group's id slots `(rows, bag, scale)` `[N]` and output gradient rows
        `[M, width]` float32, features one after the other: a pooled feature's bag is its
        sample, a sequence feature's each id its own bag; `scale` is d(output)/d(row) (the
        weight over the combiner's divisor), 0 with row -1 for padding."""
        rows, seg, scale, grads = [], [], [], []
        offset = 0
        for f in self.features:
            f_rows = res.rows[f.name]
            g = g_owner[f.name].astype(jnp.float32)
            g = g.reshape(-1, g.shape[-1])
            n_out = g.shape[0]
            per_id = f.combiner is Combiner.NONE
            f_seg = jnp.arange(f_rows.shape[0], dtype=jnp.int32) if per_id else res.seg[f.name]
            f_scale = id_scale(f_rows, f_seg, n_out, res.w[f.name], f.combiner, None)
            rows.append(jnp.where(f_scale != 0, f_rows, -1))
            seg.append(f_seg + offset)
            scale.append(f_scale)
            grads.append(g)
            offset += n_out
        return tuple(jnp.concatenate(x) for x in (rows, seg, scale, grads))
