"""Reduction-based cluster: ids go to the row shard that owns them (the table's
`ShardLayout`) in every column slice; owners pool their ids per (source, sample, feature) into
one partial vector; partial vectors return and are summed over row shards; column slices are
concatenated (`docs/design.md`, "Clusters").

On a `("node", "local")` mesh the return path is hierarchical: partial vectors are first
summed inside each node (all-to-all over "local"), then exchanged across nodes only between
devices of the same local rank (all-to-all over "node"): the inter-node volume no longer
grows with the number of row shards per node.

Owner-side bags: each device serves a static list of (feature, column slice) "slots"; a
request's bag is `slot * b + sample`, and the owner pools into `[G sources, S slots, b]`.

Routing and the return path are built once per group, not per feature: the group's ids are
one array (`GroupInput`), and what differs between features (their table's split, the
devices and offsets of its shards, their owner slots, their combiner) are small static
tables indexed by each request's feature, so the step's operations do not grow with the
number of features.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax import ops
from embark_jax.core.layout import local_row_of, row_shard_of
from embark_jax.core.specs import Combiner
from embark_jax.sharding import routing
from embark_jax.sharding.capacity import group_capacity
from embark_jax.sharding.clusters.base import ClusterBase, group_input, slot_features

__all__ = ["RBCluster", "RBResiduals"]


class RBResiduals(NamedTuple):
    """What the owner received, flat over `[G sources, capacity]`, and the requester's
    pooling divisors."""

    rows: jax.Array  # buffer row of each received request, -1 for empty slots
    seg: jax.Array  # owner bag `(src * S + slot) * b + sample`, -1 for empty slots
    w: jax.Array  # weight of each received request (0 for empty slots)
    denom: jax.Array | None  # [b, F] divisor of each feature's bags; None: no mean / sqrtn


class RBCluster(ClusterBase):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        g_count = self.num_devices
        # served[dst] = ordered (feature, k) slots a device pools for
        self.served: list[list[tuple[str, int]]] = [[] for _ in range(g_count)]
        for f in self.features:
            dev, _ = self.placement(f.table)
            for k in range(dev.shape[0]):
                for j in range(dev.shape[1]):
                    self.served[int(dev[k, j])].append((f.name, k))
        self.slots = max(1, max(len(s) for s in self.served))
        self.slot_of = {
            (f, k, d): i for d, s in enumerate(self.served) for i, (f, k) in enumerate(s)
        }
        # feature -> [c, r] owner slot of each of its table's shards
        self.slot_table: dict[str, np.ndarray] = {}
        for f in self.features:
            dev, _ = self.placement(f.table)
            self.slot_table[f.name] = np.array(
                [[self.slot_of[(f.name, k, int(d))] for d in col] for k, col in enumerate(dev)],
                np.int32,
            )
        self._init_requests()
        self.capacity = group_capacity(self.lowered, self.group, self.b, self.hotness, self.options)
        topo = self.lowered.plan.topology
        self.hier = self.options.hierarchical and topo.num_nodes > 1
        if self.hier:
            self._init_hierarchical(topo.num_nodes, topo.devices_per_node)
        else:
            self.piece_index = _padded(
                [
                    self.slot_table[f.name][k] + self.slots * self.placement(f.table)[0][k]
                    for f, k in self.pieces
                ],
                g_count * self.slots,
            )

    def _init_requests(self) -> None:
        """Static per-feature tables for routing: feature i's table splits `[c_i, r_i]`, its
        shards' (device, row offset, owner slot) flat from `place_start[i]` in (k, j) order,
        and the pieces (feature, column slice) of the group's outputs in order."""
        split, table, dev, off, slot, start = [], [], [], [], [], [0]
        for f in self.features:
            d, o = self.placement(f.table)
            split.append(d.shape)
            table.append(self.table_index(f.table))
            dev.append(d.ravel())
            off.append(o.ravel())
            slot.append(self.slot_table[f.name].ravel())
            start.append(start[-1] + d.size)
        self.splits = np.array(split, np.int32)  # [F, 2]: (c, r)
        self.feature_table = np.array(table, np.int32)
        self.place_start = np.array(start[:-1], np.int32)
        self.place = np.stack([np.concatenate(x) for x in (dev, off, slot)])  # [3, P]
        self.pieces = [
            (f, k) for f in self.features for k in range(self.layouts[f.table].column_shards)
        ]
        self.piece_feature = np.array([self.features.index(f) for f, _ in self.pieces])
        self.piece_starts = np.cumsum(self.splits[:, 0])[:-1].tolist()
        self.divides = np.array(
            [f.combiner in (Combiner.MEAN, Combiner.SQRTN) for f in self.features]
        )

    def _init_hierarchical(self, n_nodes: int, local: int) -> None:
        """The node-level slots: what each node serves, and each owner slot's node slot."""
        self.node_served: list[list[tuple[str, int]]] = [[] for _ in range(n_nodes)]
        for d in range(self.num_devices):
            for fk in self.served[d]:
                if fk not in self.node_served[d // local]:
                    self.node_served[d // local].append(fk)
        self.node_slots = max(1, max(len(s) for s in self.node_served))
        # owner slot -> node slot, per device (-1: padding slot)
        table = np.full((self.num_devices, self.slots), -1, np.int32)
        for d in range(self.num_devices):
            for i, fk in enumerate(self.served[d]):
                table[d, i] = self.node_served[d // local].index(fk)
        self.owner_to_node_slot = table
        # each piece's (source node, node slot) entries of the received partials
        rows = []
        for f, k in self.pieces:
            nodes = sorted({int(d) // local for d in self.placement(f.table)[0][k]})
            rows.append(
                [n * self.node_slots + self.node_served[n].index((f.name, k)) for n in nodes]
            )
        self.piece_index = _padded(rows, n_nodes * self.node_slots)

    # --- routing ---------------------------------------------------------------------

    def route(self, batch):
        gi = group_input(self.features, batch)
        feat, k, slot = self._requests(gi)  # numpy: per-request tables are constants
        take = (lambda x: x) if slot is None else (lambda x: x[slot])
        ids = take(gi.ids)
        valid = ids >= 0
        r = self.splits[:, 1][feat]
        j = jnp.where(valid, row_shard_of(ids, jnp.asarray(r)), 0)
        p = jnp.asarray(self.place_start[feat] + k * r) + j
        dev, off, owner_slot = (jnp.asarray(x)[p] for x in self.place)
        payloads = {
            "row": (off + local_row_of(ids, jnp.asarray(r)), -1),
            "bag": (owner_slot * self.b + jnp.asarray(take(gi.sample)), 0),
        }
        if any(f.weighted for f in self.features):  # weights travel only when there are any
            payloads["w"] = (take(gi.weights), 0.0)
        dst = jnp.where(valid, dev, -1)
        send, _, dropped = routing.bucket(dst, self.num_devices, self.capacity, payloads)
        recv = {k: routing.exchange(v, self.axis_names) for k, v in send.items()}
        src = jnp.arange(self.num_devices, dtype=jnp.int32)[:, None]
        valid = recv["row"] >= 0
        seg = jnp.where(valid, src * (self.slots * self.b) + recv["bag"], -1)
        w = recv["w"] if "w" in recv else valid.astype(jnp.float32)
        denom = self._denominators(gi)
        res = RBResiduals(recv["row"].reshape(-1), seg.reshape(-1), w.reshape(-1), denom)
        return res, self._lost_per_table(gi, dropped, slot)

    def _requests(self, gi):
        """`(feature, column slice, slot)` of each request, numpy: every slot of feature i
        sends c_i requests, features one after the other and each one's slices in order
        (slot None: one request per slot, as with a single column slice everywhere)."""
        c = self.splits[:, 0]
        if (c == 1).all():
            return gi.feature, 0, None
        sizes = np.array(gi.sizes)
        counts = c * sizes
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
        slot_starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)
        feat = slot_features(counts)
        within = np.arange(feat.shape[0], dtype=np.int32) - starts[feat]
        size = sizes.astype(np.int32)[feat]
        return feat, within // size, slot_starts[feat] + within % size

    def _denominators(self, gi):
        """`[b, F]` divisors of the features' bags (1 for sum), or None when no feature of
        the group divides."""
        if not self.divides.any():
            return None
        f_count = len(self.features)
        seg = gi.feature * self.b + gi.sample
        combiners = [f.combiner for f in self.features]
        denom = jnp.ones((f_count * self.b,), jnp.float32)
        for kind in (Combiner.MEAN, Combiner.SQRTN):
            mask = np.repeat([c is kind for c in combiners], self.b)
            if mask.any():
                d = ops.reference.pool_denominator(gi.ids, seg, f_count * self.b, gi.weights, kind)
                denom = jnp.where(mask, d, denom)
        return denom.reshape(f_count, self.b).T

    def _lost_per_table(self, gi, dropped, slot):
        """Overflow per table: id occurrences with at least one column slice dropped (a
        request per column slice was sent; the occurrence counts once)."""
        lost = dropped.astype(jnp.int32)
        if slot is not None:
            lost = jnp.zeros(gi.ids.shape, jnp.int32).at[slot].max(lost)
        table = jnp.asarray(self.feature_table[gi.feature])
        return jnp.zeros((len(self.table_names),), jnp.int32).at[table].add(lost)

    # --- owner: pool per (source, slot, sample) -----------------------------------------

    def owner(self, buffer, res):
        n_seg = self.num_devices * self.slots * self.b
        pooled = ops.lookup_pool(buffer, res.rows, res.seg, n_seg, res.w, "sum")
        pooled = self.options.to_wire(pooled)
        return pooled.reshape(self.num_devices, self.slots, self.b, self.width)

    # --- return path ---------------------------------------------------------------------

    def combine(self, owner_out, res):
        return self.split(self.combine_group(owner_out, res))

    def combine_group(self, owner_out, res):
        """`[b, Q pieces, width]` float32: each (feature, column slice) piece summed over its
        row shards, divided by its feature's divisors; a feature's pieces side by side."""
        if self.hier:
            recv = self._node_partials(owner_out)  # [N src-node, S_node, b, w]
        else:
            recv = routing.exchange(owner_out, self.axis_names)  # [G src, S, b, w]
        y = _gather_sum(recv.reshape(-1, self.b, self.width), self.piece_index)
        y = jnp.transpose(y, (1, 0, 2)).astype(jnp.float32)
        if res.denom is None:
            return y
        return self.apply_denominator(y, res.denom[:, self.piece_feature])

    def marker_outputs(self, outputs):
        """One output: every output is a slice of one combined array, which depends on the
        owner's single lookup."""
        return [next(iter(outputs.values()))]

    def split(self, y):
        """Group output `[b, Q, width]` -> feature -> `[b, c * width]` (one split)."""
        parts = jnp.split(y, self.piece_starts, axis=1)
        return {f.name: p.reshape(self.b, -1) for f, p in zip(self.features, parts, strict=True)}

    def join(self, grads):
        """Inverse of `split`: feature -> `[b, c * width]` gradients as one `[b, Q, width]`."""
        parts = [
            grads[f.name].reshape(self.b, -1, self.width).astype(jnp.float32) for f in self.features
        ]
        return jnp.concatenate(parts, axis=1)

    def _node_partials(self, owner_out):
        """Hierarchical return path: my partials summed inside my node, then exchanged with
        the same local rank of every node: `[N src-node, S_node, b, w]`."""
        topo = self.lowered.plan.topology
        n_nodes, local = topo.num_nodes, topo.devices_per_node
        me = routing.device_index(self.axis_names)
        to_node = jnp.take(jnp.asarray(self.owner_to_node_slot), me, axis=0)  # [S]
        # [G req, S, b, w] -> [L req-local, N req-node, S_node, b, w], summing my slots
        x = owner_out.reshape(n_nodes, local, self.slots, self.b, self.width)
        x = jnp.transpose(x, (1, 0, 2, 3, 4))
        target = jnp.where(to_node >= 0, to_node, self.node_slots)
        z = jnp.zeros((local, n_nodes, self.node_slots + 1, self.b, self.width), x.dtype)
        z = z.at[:, :, target].add(x)[:, :, : self.node_slots]
        # intra-node: gather the partials for my local rank from every device of my node
        intra = routing.exchange(z, self.axis_names[1]).sum(axis=0)  # [N req-node, S_node, b, w]
        # inter-node: exchange only with the same local rank of every node
        return routing.exchange(intra, self.axis_names[0])

    # --- owner update ------------------------------------------------------------------

    def stage(self, block, state, res, g_owner, how):
        g = g_owner.reshape(-1, self.width)
        return self.owner_stage(block, state, res.rows, res.seg, res.w, g, Combiner.SUM, how)


def _padded(rows, pad: int) -> np.ndarray:
    """`[len(rows), max length]` int32 of the index lists `rows`, short ones padded with
    `pad` (the index of a zero row appended by `_gather_sum`)."""
    width = max(len(r) for r in rows)
    out = np.full((len(rows), width), pad, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _gather_sum(x, index: np.ndarray):
    """`[Q, ...]`: row q is the sum of the rows `index[q]` of `x` (`[M, ...]`); index M
    reads zeros (padding)."""
    if index.shape[1] == 1:
        return x[index[:, 0]]
    if (index == x.shape[0]).any():
        x = jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])
    return jnp.sum(x[index], axis=1)
