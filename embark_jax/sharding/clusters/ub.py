"""Unique-based cluster: each device dedups the ids of every table, routes the unique ids to
their owners (id % r, in every column slice), owners dedup again across sources and return
one vector per unique id; the requester assembles the column slices and pools (or, for the
`none` combiner, copies) through the inverse index. The backward merges duplicate gradients
on both sides: the requester's pooling VJP reduces per unique id, the owner's fused update
merges repeats across sources.
"""

from __future__ import annotations

import jax.numpy as jnp

from embark_jax import ops
from embark_jax.core.specs import Combiner
from embark_jax.sharding import routing
from embark_jax.sharding.clusters.base import ClusterBase, feature_inputs

__all__ = ["UBCluster"]


class UBCluster(ClusterBase):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unique_capacity: dict[str, int] = {}
        per_dst = [0] * self.num_devices
        for t in self.table_names:
            tp = self.plan_of(t)
            ids_per_device = sum(
                self.b * self.hotness[f.name] for f in self.features if f.table == t
            )
            worst = min(ids_per_device, self.lowered.table(t).vocab_size)
            cap_u = worst if tp.unique_capacity is None else min(worst, tp.unique_capacity)
            self.unique_capacity[t] = max(1, cap_u)
            cap = routing.bucket_capacity(
                cap_u / tp.row_shards,
                cap_u,
                tp.capacity_factor or self.options.capacity_factor,
                tp.row_shards,
            )
            dev, _ = self.placement(t)
            for d in dev.reshape(-1):
                per_dst[int(d)] += cap
        self.capacity = max(1, max(per_dst))

    def route(self, batch):
        inputs = feature_inputs(self.lowered, self.group, batch)
        res = {"inv": {}, "seg": {}, "w": {}}
        dsts, rows, tidx, dropped_ids = [], [], [], []
        for t in self.table_names:
            tp = self.plan_of(t)
            dev, off = self.placement(t)
            feats = [f for f in self.features if f.table == t]
            ids = jnp.concatenate([inputs[f.name].ids for f in feats])
            cap_u = self.unique_capacity[t]
            uniq, inv, _, _ = ops.unique(ids, cap_u)
            dropped_ids.append(jnp.sum(((ids >= 0) & (inv < 0)).astype(jnp.int32)))
            start = 0
            for f in feats:
                n = inputs[f.name].ids.shape[0]
                res["inv"][f.name] = inv[start : start + n]
                res["seg"][f.name] = inputs[f.name].seg
                res["w"][f.name] = inputs[f.name].weights
                start += n
            valid = uniq >= 0
            j = jnp.where(valid, uniq % tp.row_shards, 0)
            for k in range(tp.column_shards):
                dsts.append(jnp.where(valid, jnp.asarray(dev[k])[j], -1))
                rows.append(jnp.asarray(off[k])[j] + uniq // tp.row_shards)
                tidx.append(jnp.full((cap_u,), self.table_index(t), jnp.int32))
        send, slot, dropped = routing.bucket(
            jnp.concatenate(dsts),
            self.num_devices,
            self.capacity,
            {"row": (jnp.concatenate(rows), -1)},
        )
        recv_rows = routing.exchange(send["row"], self.axis_names).reshape(-1)
        res.update(rows=recv_rows, slot=slot)
        overflow = ops.segment_sum(
            dropped.astype(jnp.int32),
            jnp.concatenate(tidx),
            len(self.table_names),
            backend="reference",
        )
        return res, overflow + jnp.stack(dropped_ids)

    def owner(self, buffer, res):
        rows = res["rows"]
        uniq, inv, _, _ = ops.unique(rows, rows.shape[0])  # dedup across sources
        vecs = ops.lookup_pool(buffer, uniq, None, 0, combiner="none")
        out = jnp.where((inv >= 0)[:, None], jnp.take(vecs, jnp.maximum(inv, 0), axis=0), 0)
        return self.options.to_wire(out).reshape(self.num_devices, self.capacity, self.width)

    def combine(self, owner_out, res):
        recv = routing.exchange(owner_out, self.axis_names).reshape(-1, self.width)
        recv = recv.astype(jnp.float32)
        slot = res["slot"]
        got = jnp.where((slot >= 0)[:, None], jnp.take(recv, jnp.maximum(slot, 0), axis=0), 0)
        out, start = {}, 0
        for t in self.table_names:
            tp = self.plan_of(t)
            cap_u = self.unique_capacity[t]
            c = tp.column_shards
            emb = got[start : start + c * cap_u].reshape(c, cap_u, self.width)
            emb = jnp.transpose(emb, (1, 0, 2)).reshape(cap_u, c * self.width)
            start += c * cap_u
            for f in self.features:
                if f.table != t:
                    continue
                y = ops.lookup_pool(
                    emb,
                    res["inv"][f.name],
                    res["seg"][f.name],
                    self.b,
                    res["w"][f.name],
                    f.combiner,
                    indices_are_sorted=True,
                )
                out[f.name] = y.reshape(self.output_shape(f))
        return out

    def update(self, buffer, state, res, g_owner, optimizer):
        g = g_owner.reshape(-1, self.width)
        return self.owner_sparse_update(
            buffer, state, res["rows"], None, None, g, optimizer, Combiner.NONE
        )
