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
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax import ops
from embark_jax.core.specs import Combiner
from embark_jax.sharding import routing
from embark_jax.sharding.capacity import group_capacity
from embark_jax.sharding.clusters.base import ClusterBase, feature_inputs

__all__ = ["RBCluster", "RBResiduals"]


class RBResiduals(NamedTuple):
    """What the owner received, flat over `[G sources, capacity]`, and the requester's
    pooling divisors."""

    rows: jax.Array  # buffer row of each received request, -1 for empty slots
    seg: jax.Array  # owner bag `(src * S + slot) * b + sample`, -1 for empty slots
    w: jax.Array  # weight of each received request (0 for empty slots)
    denom: dict[str, jax.Array]  # feature -> [b] divisor of a mean / sqrtn combiner


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
        self.capacity = group_capacity(self.lowered, self.group, self.b, self.hotness, self.options)
        topo = self.lowered.plan.topology
        self.hier = self.options.hierarchical and topo.num_nodes > 1
        if self.hier:
            self._init_hierarchical(topo.num_nodes, topo.devices_per_node)

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

    # --- routing ---------------------------------------------------------------------

    def route(self, batch):
        dsts, rows, bags, ws, spans = [], [], [], [], []
        denom = {}
        for name, fi in feature_inputs(self.lowered, self.group, batch).items():
            f = self.lowered.config.feature_by_name[name]
            req = self.shard_requests(f.table, fi.ids)
            slot = self.slot_table[name]
            spans.append((self.table_index(f.table), slot.shape[0], fi.ids.shape[0]))
            for k in range(slot.shape[0]):
                dsts.append(req.dst[k])
                rows.append(req.row[k])
                bags.append(jnp.asarray(slot[k])[req.j] * self.b + fi.seg)
                ws.append(fi.weights)
            denom[name] = self.denominator(fi, self.b, f.combiner)
        dst = jnp.concatenate(dsts)
        payloads = {"row": (jnp.concatenate(rows), -1), "bag": (jnp.concatenate(bags), 0)}
        if any(f.weighted for f in self.features):  # weights travel only when there are any
            payloads["w"] = (jnp.concatenate(ws), 0.0)
        send, _, dropped = routing.bucket(dst, self.num_devices, self.capacity, payloads)
        recv = {k: routing.exchange(v, self.axis_names) for k, v in send.items()}
        src = jnp.arange(self.num_devices, dtype=jnp.int32)[:, None]
        valid = recv["row"] >= 0
        seg = jnp.where(valid, src * (self.slots * self.b) + recv["bag"], -1)
        w = recv["w"] if "w" in recv else valid.astype(jnp.float32)
        res = RBResiduals(recv["row"].reshape(-1), seg.reshape(-1), w.reshape(-1), denom)
        return res, self._lost_per_table(dropped, spans)

    def _lost_per_table(self, dropped, spans):
        """Overflow per table: id occurrences with at least one column slice dropped (a
        request per column slice was sent; the occurrence counts once)."""
        lost = jnp.zeros((len(self.table_names),), jnp.int32)
        start = 0
        for t, c, n in spans:
            per_slice = dropped[start : start + c * n].reshape(c, n)
            lost = lost.at[t].add(jnp.sum(jnp.any(per_slice, axis=0), dtype=jnp.int32))
            start += c * n
        return lost

    # --- owner: pool per (source, slot, sample) -----------------------------------------

    def owner(self, buffer, res):
        n_seg = self.num_devices * self.slots * self.b
        pooled = ops.lookup_pool(buffer, res.rows, res.seg, n_seg, res.w, "sum")
        pooled = self.options.to_wire(pooled)
        return pooled.reshape(self.num_devices, self.slots, self.b, self.width)

    # --- return path ---------------------------------------------------------------------

    def combine(self, owner_out, res):
        if self.hier:
            return self._combine_hierarchical(owner_out, res)
        recv = routing.exchange(owner_out, self.axis_names)  # [G src, S, b, w]
        out = {}
        for f in self.features:
            dev, _ = self.placement(f.table)
            cols = []
            for k in range(dev.shape[0]):
                cols.append(jnp.sum(recv[dev[k], self.slot_table[f.name][k]], axis=0))
            out[f.name] = self._finish(f, cols, res)
        return out

    def _combine_hierarchical(self, owner_out, res):
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
        recv = routing.exchange(intra, self.axis_names[0])  # [N src-node, S_node, b, w]
        out = {}
        for f in self.features:
            dev, _ = self.placement(f.table)
            cols = []
            for k in range(dev.shape[0]):
                nodes = sorted({int(d) // local for d in dev[k]})
                idx_s = np.array([self.node_served[n].index((f.name, k)) for n in nodes])
                cols.append(jnp.sum(recv[np.array(nodes), idx_s], axis=0))
            out[f.name] = self._finish(f, cols, res)
        return out

    def _finish(self, f, cols, res):
        pooled = jnp.concatenate(cols, axis=-1).astype(jnp.float32)
        if f.combiner in (Combiner.MEAN, Combiner.SQRTN):
            pooled = self.apply_denominator(pooled, res.denom[f.name])
        return pooled

    # --- owner update ------------------------------------------------------------------

    def stage(self, buffer, state, res, g_owner, optimizer, step, seed=None):
        g = g_owner.reshape(-1, self.width)
        return self.owner_stage(
            buffer, state, res.rows, res.seg, res.w, g, optimizer, Combiner.SUM, step, seed
        )
