"""Unique-based cluster: each device dedups the ids of every table, routes the unique ids to
their owners (the table's `ShardLayout`, in every column slice), owners dedup again across
sources and return one vector per unique id; the requester assembles the column slices and
pools (or, for the `none` combiner, copies) through the inverse index. The backward merges
duplicate gradients on both sides: the requester's pooling VJP reduces per unique id, the
owner's fused update merges repeats across sources (`docs/design.md`, "Clusters").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from embark_jax import ops
from embark_jax.core.specs import Combiner
from embark_jax.sharding import routing
from embark_jax.sharding.capacity import group_capacity, table_capacity
from embark_jax.sharding.clusters.base import ClusterBase, feature_inputs

__all__ = ["UBCluster", "UBResiduals"]


class UBResiduals(NamedTuple):
    """What the owner received, and how the requester maps its ids to the vectors back."""

    rows: jax.Array  # [G * capacity] buffer row of each received unique id, -1: empty slot
    slot: jax.Array  # flat send slot of each (table, column slice, unique id), -1: dropped
    inv: dict[str, jax.Array]  # feature -> [b * H] unique index of each id slot, -1: none
    seg: dict[str, jax.Array]  # feature -> [b * H] sample of each id slot
    w: dict[str, jax.Array]  # feature -> [b * H] weight of each id slot


class UBCluster(ClusterBase):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unique_capacity: dict[str, int] = {
            t: table_capacity(self.lowered, t, self.b, self.hotness, self.options).unique
            for t in self.table_names
        }
        self.capacity = group_capacity(self.lowered, self.group, self.b, self.hotness, self.options)

    def route(self, batch):
        inputs = feature_inputs(self.lowered, self.group, batch)
        inv_of, dsts, rows, dedup = {}, [], [], []
        for t in self.table_names:
            feats = [f for f in self.features if f.table == t]
            ids = jnp.concatenate([inputs[f.name].ids for f in feats])
            uniq, inv, _, _ = ops.unique(ids, self.unique_capacity[t])
            dedup.append((ids, inv))
            start = 0
            for f in feats:
                n = inputs[f.name].ids.shape[0]
                inv_of[f.name] = inv[start : start + n]
                start += n
            req = self.shard_requests(t, uniq)
            dsts += req.dst
            rows += req.row
        send, slot, dropped = routing.bucket(
            jnp.concatenate(dsts),
            self.num_devices,
            self.capacity,
            {"row": (jnp.concatenate(rows), -1)},
        )
        recv_rows = routing.exchange(send["row"], self.axis_names).reshape(-1)
        res = UBResiduals(
            rows=recv_rows,
            slot=slot,
            inv=inv_of,
            seg={f.name: inputs[f.name].seg for f in self.features},
            w={f.name: inputs[f.name].weights for f in self.features},
        )
        return res, self._lost_per_table(dropped, dedup)

    def _lost_per_table(self, dropped, dedup):
        """Overflow per table: id occurrences (not unique ids) whose vector did not come
        back whole: the id found no dedup slot, or a column slice of its unique id was
        dropped from a routing bucket (then every occurrence of the id lost it)."""
        lost, start = [], 0
        for t, (ids, inv) in zip(self.table_names, dedup, strict=True):
            cap_u, c = self.unique_capacity[t], self.layouts[t].column_shards
            slot_lost = jnp.any(dropped[start : start + c * cap_u].reshape(c, cap_u), axis=0)
            start += c * cap_u
            gone = (inv < 0) | jnp.take(slot_lost, jnp.maximum(inv, 0))
            lost.append(jnp.sum((ids >= 0) & gone, dtype=jnp.int32))
        return jnp.stack(lost)

    def owner(self, buffer, res):
        rows = res.rows
        uniq, inv, _, _ = ops.unique(rows, rows.shape[0])  # dedup across sources
        vecs = ops.lookup_pool(buffer, uniq, None, 0, combiner="none")
        out = jnp.where((inv >= 0)[:, None], jnp.take(vecs, jnp.maximum(inv, 0), axis=0), 0)
        return self.options.to_wire(out).reshape(self.num_devices, self.capacity, self.width)

    def combine(self, owner_out, res):
        recv = routing.exchange(owner_out, self.axis_names).reshape(-1, self.width)
        recv = recv.astype(jnp.float32)
        slot = res.slot
        got = jnp.where((slot >= 0)[:, None], jnp.take(recv, jnp.maximum(slot, 0), axis=0), 0)
        out, start = {}, 0
        for t in self.table_names:
            cap_u = self.unique_capacity[t]
            c = self.layouts[t].column_shards
            emb = got[start : start + c * cap_u].reshape(c, cap_u, self.width)
            emb = jnp.transpose(emb, (1, 0, 2)).reshape(cap_u, c * self.width)
            start += c * cap_u
            for f in self.features:
                if f.table != t:
                    continue
                y = ops.lookup_pool(
                    emb,
                    res.inv[f.name],
                    res.seg[f.name],
                    self.b,
                    res.w[f.name],
                    f.combiner,
                    indices_are_sorted=True,
                )
                out[f.name] = y.reshape(self.output_shape(f))
        return out

    def stage(self, buffer, state, res, g_owner, optimizer, step, seed=None):
        g = g_owner.reshape(-1, self.width)
        return self.owner_stage(
            buffer, state, res.rows, None, None, g, optimizer, Combiner.NONE, step, seed
        )
