"""Unique-based cluster: each device dedups the ids of every table, routes the unique ids to
their owners (the table's `ShardLayout`, in every column slice), owners return one vector per
received slot; the requester pools (or, for the `none` combiner, copies) straight from the
received vectors through the inverse index and the send slots. The backward merges duplicate
gradients on both sides: the requester's pooling VJP reduces per received slot, the owner's
fused update merges repeats across sources (`docs/design.md`, "Clusters").
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
        # one row per received slot, read straight into the send buffer (an empty slot,
        # row -1, reads zeros): no deduplicated copy to gather from a second time
        out = ops.lookup_pool(buffer, res.rows, None, 0, combiner="none")
        return self.options.to_wire(out).reshape(self.num_devices, self.capacity, self.width)

    def combine(self, owner_out, res):
        recv = routing.exchange(owner_out, self.axis_names).reshape(-1, self.width)
        recv = recv.astype(jnp.float32)
        slots, start = {}, 0
        for t in self.table_names:
            cap_u, c = self.unique_capacity[t], self.layouts[t].column_shards
            slots[t] = res.slot[start : start + c * cap_u].reshape(c, cap_u)
            start += c * cap_u
        out = {}
        for kind in dict.fromkeys(self._pooling(f) for f in self.features):
            feats = [f for f in self.features if self._pooling(f) is kind]
            out.update(self._pool(recv, slots, res, feats, kind))
        return {f.name: out[f.name].reshape(self.output_shape(f)) for f in self.features}

    @staticmethod
    def _pooling(f) -> Combiner:
        """How a feature pools the received vectors: mean and sqrtn sum first (`_pool`)."""
        return Combiner.SUM if f.combiner in (Combiner.MEAN, Combiner.SQRTN) else f.combiner

    def _pool(self, recv, slots, res, feats, kind: Combiner):
        """The outputs of `feats` (all pooling by `kind`) read straight from the received
        vectors in one kernel call: column slice k of an id's vector is row
        `slots[table][k, inv]` of `recv` (none: the id found no dedup slot, or that slice was
        dropped from its bucket, and reads zeros); each (feature, slice) pools into its own
        bags, written as its own output piece (`lookup_pool(split=)`). A mean or sqrtn bag is
        divided by the weights of its ids that found a dedup slot, as if each had read its
        whole vector. No per-slot or per-id copy of the vectors is made; the pooling's VJP
        scatters each id's output gradient straight into `recv`'s gradient."""
        weighted = any(res.w[f.name] is not None for f in feats)
        rows, seg, w, sizes = [], [], [], []
        for f in feats:
            inv, s = res.inv[f.name], res.seg[f.name]
            found = inv >= 0
            for k in range(slots[f.table].shape[0]):
                rows.append(jnp.where(found, jnp.take(slots[f.table][k], jnp.maximum(inv, 0)), -1))
                if kind is not Combiner.NONE:  # bags of (feature, slice) one after the other
                    seg.append(s + len(sizes) * self.b)
                if weighted:
                    fw = res.w[f.name]
                    w.append(jnp.ones(inv.shape, jnp.float32) if fw is None else fw)
                sizes.append(self.b if kind is not Combiner.NONE else inv.shape[0])
        parts = ops.lookup_pool(
            recv,
            jnp.concatenate(rows),
            jnp.concatenate(seg) if seg else None,
            len(sizes) * self.b,
            jnp.concatenate(w) if weighted else None,
            kind,
            indices_are_sorted=True,
            split=sizes,
        )
        out, i = {}, 0
        for f in feats:
            c = slots[f.table].shape[0]
            y = parts[i] if c == 1 else jnp.concatenate(parts[i : i + c], axis=-1)
            i += c
            if f.combiner in (Combiner.MEAN, Combiner.SQRTN):
                inv, s, fw = res.inv[f.name], res.seg[f.name], res.w[f.name]
                ids = jnp.where(inv >= 0, 0, -1)
                denom = ops.reference.pool_denominator(ids, s, self.b, fw, f.combiner)
                y = self.apply_denominator(y, denom)
            out[f.name] = y
        return out

    def stage(self, block, state, res, g_owner, how):
        g = g_owner.reshape(-1, self.width)
        return self.owner_stage(block, state, res.rows, None, None, g, Combiner.NONE, how)
