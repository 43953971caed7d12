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
from embark_jax.sharding.clusters.base import ClusterBase, group_input

__all__ = ["DPCluster", "DPResiduals"]


class DPResiduals(NamedTuple):
    """The group's local lookups in this device's replica, features one after the other."""

    rows: jax.Array  # [N] buffer row of each id slot, -1 for padding
    bag: jax.Array  # [N] output row of each id slot in the group's outputs one after the
    # other: a pooled feature's sample, a sequence feature's slot (each id its own bag)
    w: jax.Array | None  # [N] weight of each id slot (0 for padding); None: no feature of
    # the group is weighted


class DPCluster(ClusterBase):
    """Routing and lookups per group, not per feature: the group's ids are one array
    (`GroupInput`); each feature's row offset and output rows are small static tables indexed
    by each slot's feature. One lookup call per pooling kind (usually one per group). On one
    device the backward reads each feature's output gradient where it is
    (`ops.stage_backward_update` takes them as pieces); on more, the gradients are
    concatenated once for the all-gather that every replica applies."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        feats = self.features
        self.row_offset = np.array(
            [self.group.shard(f.table, 0, 0).row_offset for f in feats], np.int32
        )
        self.per_id = np.array([f.combiner is Combiner.NONE for f in feats])
        self.out_rows = [
            self.b * self.hotness[f.name] if p else self.b
            for f, p in zip(feats, self.per_id, strict=True)
        ]
        self.out_start = np.concatenate([[0], np.cumsum(self.out_rows)[:-1]]).astype(np.int32)
        # pooling kinds: a sequence feature pools like `sum` with one id per bag
        kinds = [Combiner.SUM if f.combiner is Combiner.NONE else f.combiner for f in feats]
        self.kinds = list(dict.fromkeys(kinds))
        self.kind_of = np.array([self.kinds.index(k) for k in kinds], np.int32)
        self.weighted = any(f.weighted for f in feats)
        # each id slot's pooling kind (a feature has b * hotness slots, as in `GroupInput`)
        self.slot_kind = np.repeat(self.kind_of, [self.b * self.hotness[f.name] for f in feats])

    def route(self, batch):
        gi = group_input(self.features, batch)
        f = gi.feature  # numpy: every per-slot table below is a constant
        rows = jnp.where(gi.ids >= 0, gi.ids + jnp.asarray(self.row_offset[f]), -1)
        slot_start = np.concatenate([[0], np.cumsum(gi.sizes)[:-1]]).astype(np.int32)
        within = np.arange(f.shape[0], dtype=np.int32) - slot_start[f]
        bag = self.out_start[f] + np.where(self.per_id[f], within, gi.sample)
        res = DPResiduals(rows, jnp.asarray(bag), gi.weights if self.weighted else None)
        return res, jnp.zeros((len(self.table_names),), jnp.int32)

    def _of_kind(self, res, k: int) -> jax.Array:
        """The slots' rows, -1 where the slot's feature pools by another kind than `k`."""
        if len(self.kinds) == 1:
            return res.rows
        return jnp.where(jnp.asarray(self.slot_kind == k), res.rows, -1)

    def owner(self, buffer, res):
        """One kernel call per pooling kind (sum, mean, sqrtn), usually one per group; each
        output row is its feature's, so each call's rows of its own kind are kept. With one
        kind the kernel writes each feature's output where it is (`split`)."""
        n_out = sum(self.out_rows)
        if len(self.kinds) == 1:
            parts = ops.lookup_pool(
                buffer,
                res.rows,
                res.bag,
                n_out,
                res.w,
                self.kinds[0],
                indices_are_sorted=True,
                split=self.out_rows,
            )
            return self._outputs(parts)
        y = None
        for k, kind in enumerate(self.kinds):
            y_k = ops.lookup_pool(
                buffer,
                self._of_kind(res, k),
                res.bag,
                n_out,
                res.w,
                kind,
                indices_are_sorted=True,
            )
            if y is None:
                y = y_k
            else:
                out_kind = np.repeat(self.kind_of, self.out_rows)
                y = jnp.where(jnp.asarray(out_kind == k)[:, None], y_k, y)
        return self.split(y)

    def split(self, y):
        """Group output rows `[sum of out_rows, width]` -> feature -> its output (one split)."""
        return self._outputs(jnp.split(y, np.cumsum(self.out_rows)[:-1].tolist()))

    def _outputs(self, parts):
        """Each feature's rows of the group output -> feature -> its output."""
        return {
            f.name: part.astype(jnp.float32).reshape(self.output_shape(f))
            for f, part in zip(self.features, parts, strict=True)
        }

    def combine(self, owner_out, res):
        return dict(owner_out)

    def marker_outputs(self, outputs):
        """One output when one lookup made them all (every output is a slice of it)."""
        return [next(iter(outputs.values()))] if len(self.kinds) == 1 else list(outputs.values())

    def stage(self, block, state, res, g_owner, how):
        rows, scale = self._slots(res)
        grads = [g_owner[f.name].astype(jnp.float32).reshape(-1, self.width) for f in self.features]
        vocab, width = block.shape[-2:]
        mode = self.options.dp_gradients
        dense = dp_exchange.dense_wins(
            vocab, width, rows.shape[0], sum(self.out_rows), self.num_devices
        )
        if mode is DPGradients.DENSE or (mode is DPGradients.AUTO and dense):
            return self._stage_dense(block, state, rows, res.bag, scale, grads, how)
        seg = res.bag
        if self.num_devices > 1:  # every replica applies every device's gradients
            grads = jnp.concatenate(grads)
            seg = seg + routing.device_index(self.axis_names) * grads.shape[0]
            rows, seg, scale, grads = (
                jax.lax.all_gather(x, self.axis_names, tiled=True)
                for x in (rows, seg, scale, grads)
            )
        return self.owner_stage(block, state, rows, seg, scale, grads, Combiner.SUM, how)

    def _stage_dense(self, block, state, rows, bag, scale, grads, how):
        """Dense all-reduce, then the sparse update of the rows any replica touched
        (untouched rows stay untouched: lazy optimizers stay lazy)."""
        vocab = block.shape[-2]
        per_id = jnp.take(jnp.concatenate(grads), bag, axis=0) * scale[:, None]
        g = jax.lax.psum(ops.segment_sum(per_id, rows, vocab), self.axis_names)
        ones = jnp.ones(rows.shape, jnp.float32)
        touched = jax.lax.psum(ops.segment_sum(ones, rows, vocab), self.axis_names)
        rows_all = jnp.where(touched > 0, jnp.arange(vocab, dtype=jnp.int32), -1)
        return self.owner_stage(block, state, rows_all, None, None, g, Combiner.NONE, how)

    def _slots(self, res):
        """The group's id slots `(rows, scale)` `[N]`: `scale` is d(output)/d(row) (the weight
        over the combiner's divisor), 0 with row -1 for padding."""
        n_out = sum(self.out_rows)
        scale = None
        for k, kind in enumerate(self.kinds):
            s_k = id_scale(self._of_kind(res, k), res.bag, n_out, res.w, kind, None)
            scale = s_k if scale is None else scale + s_k  # each slot has one kind
        return jnp.where(scale != 0, res.rows, -1), scale
