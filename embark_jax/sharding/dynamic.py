"""Dynamic tables sharded over a mesh: unique-based routing of 64-bit ids to the shard that
owns them (`core.dynamic.shard_of`), `find_or_insert` there, vectors back, pooling on the
requester (docs/design.md §11, "Sharded").

Every device holds one shard of every dynamic table (the stacked form: each leaf of a
`DynamicTableState` with a leading `[G]` axis, sharded over all mesh axes). Per table and
device, in one `shard_map`:

  route    the table's ids of the local batch (every feature that looks it up) are
           deduplicated (a sort of the two id words), each unique id goes to its owner's
           bucket of fixed capacity (`routing.bucket`), one all-to-all carries the words;
  owner    `find_or_insert` (training) or `find` (evaluation) maps the received ids to
           slots, inserting the admitted new ones; one row per received slot is read
           straight into the return buffer;
  combine  one all-to-all brings the rows back; each feature pools its ids' rows through
           the inverse index (sum, mean or sqrtn).

The backward is two-phase, as for the fixed tables: the VJP of the linear `combine` maps the
output gradients to one gradient row per received slot (duplicates merged by the pooling's
VJP), and the owner stages the fused sparse update of those slots
(`ops.stage_backward_update`, duplicates across sources merged); `commit` writes the staged
rows in place once the step's verdict is known.

A table in `DynamicConfig.replicated` is held whole on every device instead (data-parallel,
for small tables): each device's unique ids are all-gathered, every device runs
`find_or_insert` on all of them in device order (the same ids in the same order: the
replicas stay identical) and reads its own ids' rows locally. A device sends at most
`capacity` unique ids (more cannot all hold a slot; the rest count as `overflow`), so a
small table moves little whatever the batch; the backward all-gathers the
gradient rows and every device stages the same update. No all-to-all, no routing capacity.

Membership is not transactional: the keys, scores, admission candidates and the fresh rows
of inserted ids change in the lookup, before the verdict (they depend on the ids alone, and
a step retried with the same ids finds them again); the values and optimizer slots of
existing rows change only with a committed update. Counts per table and step (summed over
devices), in `COUNT_NAMES` order: the hash table's found, inserted, evicted, expired,
refused and dropped ids (unique ids per device), and `overflow`, id occurrences whose unique
id did not fit its routing bucket (they read zeros, like refused ids).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embark_jax import ops
from embark_jax.core.capacity_rule import binomial_capacity
from embark_jax.core.dynamic import DynamicConfig, DynamicTableConfig
from embark_jax.core.specs import Combiner
from embark_jax.ops import abi, hash_table
from embark_jax.ops.hash_reference import shard_of
from embark_jax.ops.hash_table import DynamicTableState
from embark_jax.ops.optimizers import SparseOptimizer
from embark_jax.sharding import routing
from embark_jax.sharding.clusters.base import ClusterBase

__all__ = [
    "COUNT_NAMES",
    "DynamicLookup",
    "DynamicResiduals",
    "DynamicShards",
    "count_dict",
]

EMPTY = jnp.uint32(hash_table.EMPTY)  # both words of the padding id
COUNT_NAMES = (*tuple(c.name.lower() for c in abi.HashCount), "overflow")


class DynamicResiduals(NamedTuple):
    """One table's routing on one device (what its update needs)."""

    slots: jax.Array  # [G * capacity] owner: slot of each received id, -1: none
    send: jax.Array  # [n] requester: flat send slot of each unique id, -1: dropped or none
    # (replicated: slots [G * k] of every device's first k = min(n, capacity) unique ids;
    # send [n]: 0..k-1, then -1)
    inv: dict[str, jax.Array]  # feature -> [b * H] unique index of each id, -1: padding
    seg: dict[str, jax.Array]  # feature -> [b * H] sample of each id
    marker: jax.Array  # int32 [k]: the lookup's read marker (the commit waits for it)


class DynamicLookup(NamedTuple):
    """What `DynamicShards.lookup` returns."""

    outputs: dict[str, jax.Array]  # feature -> [B, dim] float32, sharded by sample
    states: dict[str, DynamicTableState]  # after the lookup's inserts (training)
    residuals: dict[str, DynamicResiduals]  # leading device axis
    counts: jax.Array  # [num_tables, len(COUNT_NAMES)] int32, summed over devices


def count_dict(config: DynamicConfig, counts: Any) -> dict[str, dict[str, int]]:
    """`DynamicLookup.counts` by table and name."""
    rows = jax.device_get(counts)
    return {
        t.name: {n: int(v) for n, v in zip(COUNT_NAMES, row, strict=True)}
        for t, row in zip(config.tables, rows, strict=True)
    }


def unique_words(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(uniq [n, 2], inv [n])` of id words `[n, 2]` uint32: the distinct ids in ascending
    (high, low) order, padding (all ones) after them, and each id's index in `uniq` (-1 for
    padding). No capacity: a sort of the two words."""
    n = words.shape[0]
    pad = (words[:, 0] == EMPTY) & (words[:, 1] == EMPTY)
    hi, lo, order = jax.lax.sort(
        (words[:, 1], words[:, 0], jnp.arange(n, dtype=jnp.int32)), num_keys=2
    )
    new = jnp.concatenate([jnp.ones((1,), bool), (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])])
    rank = (jnp.cumsum(new) - 1).astype(jnp.int32)
    target = jnp.where(new, rank, n)  # each distinct id written once
    uniq = jnp.full((n, 2), EMPTY, jnp.uint32).at[target].set(jnp.stack([lo, hi], 1), mode="drop")
    inv = jnp.zeros((n,), jnp.int32).at[order].set(rank)
    return uniq, jnp.where(pad, -1, inv)


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicShards:
    """The dynamic tables of `config`, one shard per device of `mesh` (all its axes,
    flattened node-major), each table trained by its `SparseOptimizer`.

    Capacities: a device sends at most `binomial_capacity(n, G)` unique ids to one owner
    (n: the table's id slots per device and batch), the least that overflows with
    probability below 1e-6 when distinct ids hash uniformly; a batch of G = 1 never
    overflows. `route_scale[table]` multiplies it (at most n: then nothing overflows);
    `grown` doubles it for some tables (the runner's `overflow="grow"`).
    """

    config: DynamicConfig
    mesh: jax.sharding.Mesh
    optimizers: Mapping[str, SparseOptimizer]
    route_scale: Mapping[str, int] = dataclasses.field(default_factory=dict)
    _cache: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        missing = sorted({t.name for t in self.config.tables} - set(self.optimizers))
        if missing:
            raise ValueError(f"DynamicShards: no optimizer for dynamic tables {missing}")

    def _jitted(self, key, make):
        """`jax.jit(make())`, made once per key: called eagerly, a step compiles once
        (inside a caller's jit it is inlined)."""
        if key not in self._cache:
            self._cache[key] = jax.jit(make())
        return self._cache[key]

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    @property
    def num_shards(self) -> int:
        return self.mesh.size

    @property
    def spec(self) -> P:
        return P(self.axis_names)

    # --- state ---------------------------------------------------------------------------

    def init(self) -> dict[str, DynamicTableState]:
        """Empty shards of every table, made on their devices (no host copy). Arrays of no
        elements (the candidates without admission) are replicated, as a compiled step
        returns them, so that the first step's state matches the next one's (one compile)."""
        sharded, replicated = NamedSharding(self.mesh, self.spec), NamedSharding(self.mesh, P())

        def make():
            out = {}
            for t in self.config.tables:
                one = hash_table.init(t, optimizer=self.optimizers[t.name])
                out[t.name] = jax.tree.map(
                    lambda x: jnp.broadcast_to(x, (self.num_shards, *x.shape)), one
                )
            return out

        shapes = jax.eval_shape(make)
        shardings = jax.tree.map(lambda x: sharded if x.size else replicated, shapes)
        return jax.jit(make, out_shardings=shardings)()

    def place(self, host: DynamicTableState) -> DynamicTableState:
        """Stacked host shards (numpy, every leaf `[G, ...]`, e.g. a restored checkpoint's)
        on the mesh, sharded as `init` makes them; in several processes each one passes
        the same arrays and places only its devices' shards."""

        def put(x):
            x = np.asarray(x)
            spec = self.spec if x.size else P()
            sharding = NamedSharding(self.mesh, spec)
            return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

        return jax.tree.map(put, host)

    # --- lookup --------------------------------------------------------------------------

    def lookup(self, states, ids: Mapping[str, jax.Array], step, *, train: bool = True):
        """Looks up every dynamic feature: `ids[feature]` is `[B, H, 2]` uint32 id words
        (all ones: padding), sharded by sample. `train`: `find_or_insert` at `step`
        (int32, never decreasing), else `find` (nothing changes). Returns `DynamicLookup`."""
        self._check_ids(ids)
        b_local = next(iter(ids.values())).shape[0] // self.num_shards
        step = jnp.asarray(step, jnp.int32)

        def body(sts, local_ids, step):
            outputs, new_states, residuals, counts = {}, {}, {}, []
            for t in self.config.tables:
                # the [1, ...] block as it is: updated in place (a reshape would copy it)
                out, state, res, cnt = self._table_forward(
                    t, sts[t.name], local_ids, b_local, step, train
                )
                outputs.update(out)
                new_states[t.name] = state
                residuals[t.name] = jax.tree.map(lambda x: x[None], res)
                counts.append(cnt)
            return outputs, new_states, residuals, jax.lax.psum(jnp.stack(counts), self.axis_names)

        spec = self.spec
        run = self._jitted(
            ("lookup", b_local, train),
            lambda: jax.shard_map(
                body, mesh=self.mesh, in_specs=(spec, spec, P()), out_specs=(spec, spec, spec, P())
            ),
        )
        return DynamicLookup(*run(dict(states), dict(ids), step))

    def _check_ids(self, ids: Mapping[str, jax.Array]) -> None:
        want = {f.name for f in self.config.features}
        if set(ids) != want:
            raise ValueError(
                f"dynamic ids: features {sorted(set(ids))} given, {sorted(want)} expected"
            )
        batch = {x.shape[0] for x in ids.values()}
        for f in self.config.features:
            x = ids[f.name]
            if x.ndim != 3 or x.shape[1:] != (f.max_hotness, 2) or x.dtype != jnp.uint32:
                raise ValueError(
                    f"dynamic feature {f.name!r}: ids must be uint32 [B, {f.max_hotness}, 2] "
                    f"(id words), got {x.dtype}{list(x.shape)}"
                )
        if len(batch) != 1 or next(iter(batch)) % self.num_shards:
            raise ValueError(
                f"dynamic ids: batch sizes {sorted(batch)} must be one size divisible by the "
                f"{self.num_shards} devices"
            )

    def capacity(self, table: DynamicTableConfig, b_local: int) -> int:
        """Unique-id slots one device sends one owner (class docstring)."""
        n = b_local * sum(f.max_hotness for f in self.config.features_of(table.name))
        scale = self.route_scale.get(table.name, 1)
        return min(n, binomial_capacity(n, self.num_shards) * scale)

    def grown(self, tables) -> DynamicShards:
        """The same tables with twice the routing capacity of `tables` (state unchanged)."""
        scale = dict(self.route_scale)
        for name in tables:
            scale[name] = 2 * scale.get(name, 1)
        return DynamicShards(self.config, self.mesh, self.optimizers, scale)

    def _route(self, t, uniq, b):
        """(the ids this device serves `[m, 2]`, each unique id's place in the returned rows
        `[n]` (-1: none), which unique ids were dropped `[n]`)."""
        valid = ~((uniq[:, 0] == EMPTY) & (uniq[:, 1] == EMPTY))
        if self.config.is_replicated(t.name):  # every device serves every device's ids
            n = uniq.shape[0]
            k = min(n, t.capacity)  # more distinct ids than slots cannot all be held
            gathered = jax.lax.all_gather(uniq[:k], self.axis_names, tiled=True)
            index = jnp.arange(n, dtype=jnp.int32)
            return gathered, jnp.where(index < k, index, -1), valid & (index >= k)
        dst = jnp.where(valid, shard_of(uniq, self.num_shards), -1)
        cap = self.capacity(t, b)
        payload = {"lo": (uniq[:, 0], EMPTY), "hi": (uniq[:, 1], EMPTY)}
        send, slot, dropped = routing.bucket(dst, self.num_shards, cap, payload)
        recv = [routing.exchange(send[k], self.axis_names).reshape(-1) for k in ("lo", "hi")]
        return jnp.stack(recv, axis=1), slot, dropped

    def _first_device(self) -> jax.Array:
        """1 on the mesh's first device, 0 elsewhere (a replicated table counts once)."""
        return (jax.lax.axis_index(self.axis_names) == 0).astype(jnp.int32)

    def _table_forward(self, t, state, local_ids, b, step, train):
        feats = self.config.features_of(t.name)
        words = jnp.concatenate([local_ids[f.name].reshape(-1, 2) for f in feats])
        uniq, inv = unique_words(words)
        received, slot, dropped = self._route(t, uniq, b)
        if train:
            state, ins = hash_table.find_or_insert(
                state, received, step, config=t, optimizer=self.optimizers[t.name]
            )
            slots, hash_counts = ins.slots, ins.counts
        else:
            slots = hash_table.find(state, received, config=t)
            hash_counts = jnp.zeros((len(abi.HashCount),), jnp.int32)
        if self.config.is_replicated(t.name):
            hash_counts = hash_counts * self._first_device()
        res_inv, res_seg, start = {}, {}, 0
        for f in feats:
            n = b * f.max_hotness
            res_inv[f.name] = inv[start : start + n]
            res_seg[f.name] = jnp.repeat(jnp.arange(b, dtype=jnp.int32), f.max_hotness)
            start += n
        lost = jnp.sum((inv >= 0) & jnp.take(dropped, jnp.maximum(inv, 0)), dtype=jnp.int32)
        res = DynamicResiduals(slots, slot, res_inv, res_seg, jnp.zeros((1,), jnp.int32))
        out = self._combine(t, self._owner(t, state.values[0], res), res, b)
        res = res._replace(marker=ops.read_marker(*out.values()))
        return out, state, res, jnp.concatenate([hash_counts, lost[None]])

    def _owner(self, t, values, res):
        """One row per received slot (empty and refused slots read zeros); replicated: one
        row per unique id of this device (its part of the gathered ids)."""
        slots = res.slots
        if self.config.is_replicated(t.name):
            k = slots.shape[0] // self.num_shards
            me = jax.lax.axis_index(self.axis_names)
            slots = jax.lax.dynamic_slice_in_dim(slots, me * k, k)
            return ops.lookup_pool(values, slots, None, 0, combiner="none")
        rows = ops.lookup_pool(values, slots, None, 0, combiner="none")
        return rows.reshape(self.num_shards, -1, t.dim)

    def _combine(self, t, owner_out, res, b):
        if self.config.is_replicated(t.name):  # the rows are here already
            recv = owner_out.reshape(-1, t.dim)
        else:
            recv = routing.exchange(owner_out, self.axis_names).reshape(-1, t.dim)
        recv = recv.astype(jnp.float32)
        out = {}
        for f in self.config.features_of(t.name):
            inv, seg = res.inv[f.name], res.seg[f.name]
            rows = jnp.where(inv >= 0, jnp.take(res.send, jnp.maximum(inv, 0)), -1)
            y = ops.lookup_pool(recv, rows, seg, b, None, "sum", indices_are_sorted=True)
            if f.combiner is not Combiner.SUM:
                ids = jnp.where(inv >= 0, 0, -1)
                denom = ops.reference.pool_denominator(ids, seg, b, None, f.combiner)
                y = ClusterBase.apply_denominator(y, denom)
            out[f.name] = y
        return out

    # --- update --------------------------------------------------------------------------

    def stage(self, states, residuals, grads: Mapping[str, jax.Array], step, seed=None):
        """Applies every table's fused sparse update from the outputs' gradients
        (`grads[feature]` `[B, dim]`) in place, undoably (`ops.stage_backward_update`; donate
        the states' values and optimizer states). Returns `(staged, finite)`: per table an
        `ops.StagedUpdate` (the updated values and optimizer state, the saved rows with a
        leading device axis), and `[]` bool, every updated value on every device finite; hand
        both to `commit`."""
        b_local = next(iter(grads.values())).shape[0] // self.num_shards
        step = jnp.asarray(step, jnp.int32)
        seed = jnp.zeros((), jnp.uint32) if seed is None else jnp.asarray(seed, jnp.uint32)

        def body(sts, res, grads, step, seed):
            staged, finite = {}, jnp.bool_(True)
            for t in self.config.tables:
                r = jax.tree.map(lambda x: x[0], res[t.name])
                s = self._stage_table(t, sts[t.name], r, grads, b_local, step, seed)
                finite &= s.finite
                staged[t.name] = _with_device_axis(s)
            bad = jax.lax.psum((~finite).astype(jnp.int32), self.axis_names)
            return staged, bad == 0

        spec = self.spec
        run = self._jitted(
            ("stage", b_local),
            lambda: jax.shard_map(
                body, mesh=self.mesh, in_specs=(spec, spec, spec, P(), P()), out_specs=(spec, P())
            ),
        )
        return run(dict(states), dict(residuals), dict(grads), step, seed)

    def _stage_table(self, t, block, res, grads, b, step, seed):
        """`block`: the table's state with its leading device axis (updated where it is)."""
        replicated = self.config.is_replicated(t.name)
        k = res.slots.shape[0] // self.num_shards
        shape = (k, t.dim) if replicated else (self.num_shards, k, t.dim)
        zeros = jax.lax.pcast(jnp.zeros(shape, t.dtype), self.axis_names, to="varying")
        feats = self.config.features_of(t.name)
        _, vjp = jax.vjp(lambda o: self._combine(t, o, res, b), zeros)
        (g,) = vjp({f.name: grads[f.name].astype(jnp.float32) for f in feats})
        if replicated:  # every device applies every device's gradient rows, in one order
            g = jax.lax.all_gather(g, self.axis_names, tiled=True)
        stochastic = jnp.dtype(t.dtype) == jnp.bfloat16
        return ops.stage_backward_update(
            block.values,
            block.opt_state,
            g.reshape(-1, t.dim),
            res.slots,
            None,
            None,
            optimizer=self.optimizers[t.name],
            combiner=Combiner.NONE,
            step=step,
            seed=seed if stochastic else None,
            after=res.marker,
        )

    def commit(self, states, staged, commit):
        """Keeps the staged updates when `commit` (`[]` bool) holds; otherwise writes the
        saved rows back, so that the values and optimizer slots come back bit-identical to
        the stage's. `states`: the states the stage was given (their other fields are kept)."""

        def body(sts, staged, commit):
            out = {}
            for t in self.config.tables:
                values, opt = ops.commit_update(
                    _without_device_axis(staged[t.name]), commit, optimizer=self.optimizers[t.name]
                )
                out[t.name] = sts[t.name]._replace(values=values, opt_state=opt)
            return out

        spec = self.spec
        run = self._jitted(
            ("commit",),
            lambda: jax.shard_map(body, mesh=self.mesh, in_specs=(spec, spec, P()), out_specs=spec),
        )
        return run(dict(states), dict(staged), jnp.asarray(commit, bool))


def _with_device_axis(staged: ops.StagedUpdate) -> ops.StagedUpdate:
    """A device's staged update as a `shard_map` output: the saved rows and the verdict get a
    leading device axis (the table and state already carry theirs)."""
    lead = jax.tree.map(lambda x: x[None], staged._replace(table=None, state=None))
    return lead._replace(table=staged.table, state=staged.state)


def _without_device_axis(staged: ops.StagedUpdate) -> ops.StagedUpdate:
    """`_with_device_axis` undone, inside `shard_map`."""
    one = jax.tree.map(lambda x: x[0], staged._replace(table=None, state=None))
    return one._replace(table=staged.table, state=staged.state)
