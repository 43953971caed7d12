"""What every cluster shares: the per-device view of a group, feature requests, and the
generic forward / two-phase backward built from a cluster's route, owner, combine and update.

A cluster runs per device inside `shard_map` over all mesh axes:

  route(batch)                 -> residuals (the cluster's typed `NamedTuple` of routing
                                  arrays, a pytree), overflow per table
  owner(buffer, residuals)     -> what this device computes from its shards (differentiable)
  combine(owner_out, res)      -> per-feature outputs; includes the collectives; linear
  stage(block, state, res, g_owner, how) -> the owner's
                               fused sparse update of its block [1, rows, width], in place
                               and undoable (`ops.StagedUpdate`; seed: stochastic rounding
                               of a bfloat16 group, or None)

The forward is `combine(owner(buffer))`; `jax.grad` flows through it. The two-phase
backward maps output gradients to `g_owner` with the VJP of the linear `combine` and hands
them to `stage`, so no dense `[V, d]` gradient is ever built for sharded tables; once the
step has decided, `ops.commit_update` keeps the update or writes the saved rows back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax import ops
from embark_jax.core.layout import ShardLayout
from embark_jax.core.options import RuntimeOptions
from embark_jax.core.specs import Combiner, FeatureConfig
from embark_jax.ops.optimizers import SparseOptimizer
from embark_jax.sharding.bounds import CheckedBatch
from embark_jax.sharding.lowering import Group, Lowered

__all__ = ["ClusterBase", "FeatureInput", "GroupInput", "group_input", "slot_features"]


@dataclasses.dataclass(frozen=True)
class FeatureInput:
    """One feature's local ids as flat arrays (`SparseFeatures.flat` on the local batch)."""

    ids: jax.Array  # [b * H]
    seg: jax.Array  # [b * H], sample of each slot (sorted)
    weights: jax.Array  # [b * H] float32 (ones when unweighted)


def feature_inputs(lowered: Lowered, group: Group, batch: CheckedBatch) -> dict[str, FeatureInput]:
    out = {}
    for f in lowered.features_of(group):
        ids, seg, w = batch.features.flat(f.name)
        w = jnp.ones(ids.shape, jnp.float32) if w is None else w.astype(jnp.float32)
        out[f.name] = FeatureInput(ids, seg, jnp.where(ids >= 0, w, 0.0))
    return out


@dataclasses.dataclass(frozen=True)
class GroupInput:
    """The local ids of all of a group's features, one feature after the other (each one's
    `SparseFeatures.flat`), with each slot's feature and sample as arrays: what differs
    between features enters as array operands indexed by `feature`, so the operations built
    on it do not grow with the number of features."""

    ids: jax.Array  # [N]
    weights: jax.Array  # [N] float32 (0 for padding, 1 when unweighted)
    feature: np.ndarray  # [N] int32 index of each slot's feature in the group's features
    sample: np.ndarray  # [N] int32 sample of each slot
    sizes: tuple[int, ...]  # slots of each feature (b * its hotness)


def slot_features(sizes) -> np.ndarray:
    """`[sum(sizes)]` int32: slot i's index in `sizes` (feature k has `sizes[k]` slots).

    Static per-slot arrays are numpy, computed once at trace time and given to XLA as
    constants: computed in the program from static sizes, XLA would fold them itself, slowly
    (its evaluator took seconds per million slots, most of a step's compile time)."""
    return np.repeat(np.arange(len(sizes), dtype=np.int32), np.asarray(sizes, np.int64))


def group_input(features: tuple[FeatureConfig, ...], batch: CheckedBatch) -> GroupInput:
    """`GroupInput` of `features` from a device's checked batch (their ids one slice)."""
    names = [f.name for f in features]
    flat = batch.flat_ids(names)
    sizes = tuple(batch.spans[n][1] for n in names)
    hot = np.array([batch.features.ids[n].shape[1] for n in names], np.int32)
    feature = slot_features(sizes)
    start = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)
    pos = np.arange(flat.shape[0], dtype=np.int32)
    sample = ((pos - start[feature]) // np.maximum(hot, 1)[feature]).astype(np.int32)
    weights = batch.features.weights
    w = jnp.ones(flat.shape, jnp.float32)
    if any(n in weights for n in names):
        w = jnp.concatenate(
            [
                jnp.asarray(weights[n], jnp.float32).reshape(-1)
                if n in weights
                else jnp.ones((z,), jnp.float32)
                for n, z in zip(names, sizes, strict=True)
            ]
        )
    return GroupInput(flat, jnp.where(flat >= 0, w, 0.0), feature, sample, sizes)


class ShardRequests(NamedTuple):
    """Where the requests for some ids of one table go, per column slice k."""

    j: jax.Array  # [N] row shard of each id (0 for padding ids)
    dst: list[jax.Array]  # [c] x [N] device holding (k, j), -1 for padding ids
    row: list[jax.Array]  # [c] x [N] the id's row in that device's buffer


class UpdateArgs(NamedTuple):
    """How a group's sparse update runs, the same for every cluster: the keyword arguments
    of `ops.stage_backward_update` that `backward_stage` hands through `stage` to
    `owner_stage`."""

    optimizer: SparseOptimizer
    step: Any
    seed: Any = None
    staging: ops.Staging | None = None
    after: jax.Array | None = None


class ClusterBase:
    """Static per-group metadata plus the generic forward / backward."""

    def __init__(
        self,
        lowered: Lowered,
        group: Group,
        local_batch: int,
        hotness: Mapping[str, int],
        options: RuntimeOptions,
    ):
        self.lowered = lowered
        self.group = group
        self.b = local_batch
        self.hotness = dict(hotness)
        self.options = options
        self.features: tuple[FeatureConfig, ...] = lowered.features_of(group)
        self.table_names = tuple(group.tables)
        self.num_devices = lowered.num_devices
        self.axis_names = lowered.axis_names
        self.width = group.width
        self.layouts: dict[str, ShardLayout] = {t: lowered.layout(t) for t in self.table_names}

    # --- helpers -----------------------------------------------------------------------

    def placement(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """`(device [c, r], row_offset [c, r])` of a routed (RB / UB) table's shards."""
        layout = self.layouts[table]
        return self.group.placement(table, layout.column_shards, layout.row_shards)

    def table_index(self, table: str) -> int:
        return self.table_names.index(table)

    def shard_requests(self, table: str, ids: jax.Array) -> ShardRequests:
        """Destination device and buffer row of each id (< 0: padding) of `table`, in
        every column slice, by the table's `ShardLayout`."""
        layout = self.layouts[table]
        dev, off = self.placement(table)
        valid = ids >= 0
        j = jnp.where(valid, layout.row_shard(ids), 0)
        local_row = layout.local_row(ids)
        dst = [jnp.where(valid, jnp.asarray(dev[k])[j], -1) for k in range(dev.shape[0])]
        row = [jnp.asarray(off[k])[j] + local_row for k in range(dev.shape[0])]
        return ShardRequests(j, dst, row)

    def output_shape(self, f: FeatureConfig) -> tuple[int, ...]:
        d = self.lowered.table(f.table).dim
        return (self.b, self.hotness[f.name], d) if f.combiner is Combiner.NONE else (self.b, d)

    @staticmethod
    def denominator(fi: FeatureInput, b: int, combiner: Combiner) -> jax.Array:
        """Per-sample divisor of a pooled combiner (1 for sum), computed on the requester."""
        if combiner in (Combiner.SUM, Combiner.NONE):
            return jnp.ones((b,), jnp.float32)
        return ops.reference.pool_denominator(fi.ids, fi.seg, b, fi.weights, combiner)

    @staticmethod
    def apply_denominator(pooled: jax.Array, denom: jax.Array) -> jax.Array:
        """`pooled` (`[..., b, d]`) over its bags' divisors (`[..., b]`); a bag whose divisor
        is 0 (no id, or only zero weights) pools to zeros."""
        safe = jnp.where(denom > 0, denom, 1.0)
        return jnp.where((denom > 0)[..., None], pooled / safe[..., None], 0.0)

    # --- to be provided by each cluster ------------------------------------------------

    # `res` is the cluster's residuals NamedTuple (`DPResiduals`, `RBResiduals`, ...).

    def route(self, batch) -> tuple[Any, jax.Array]:
        raise NotImplementedError

    def owner(self, buffer: jax.Array, res: Any) -> Any:
        raise NotImplementedError

    def combine(self, owner_out: Any, res: Any) -> dict[str, jax.Array]:
        raise NotImplementedError

    def stage(self, block, state, res, g_owner, how: UpdateArgs) -> ops.StagedUpdate:
        raise NotImplementedError

    def combine_group(self, owner_out: Any, res: Any) -> Any:
        """The linear part of `combine` whose VJP routes the gradients back, on the
        cluster's own output layout (`join` maps per-feature gradients onto it). Default:
        `combine` itself, per feature."""
        return self.combine(owner_out, res)

    def join(self, output_grads: Mapping[str, jax.Array]) -> Any:
        """The group's per-feature output gradients in `combine_group`'s layout."""
        return {f.name: output_grads[f.name] for f in self.features}

    def owner_out_zeros(self, buffer: jax.Array, res: Any) -> Any:
        """Zeros shaped like `owner(buffer, res)` (`buffer` `[..., rows, width]`: any leading
        axes are dropped), varying over the mesh like it."""
        shape = jax.eval_shape(lambda b, r: self.owner(b.reshape(b.shape[-2:]), r), buffer, res)
        return jax.tree.map(
            lambda s: jax.lax.pcast(
                jnp.zeros(s.shape, s.dtype), tuple(self.axis_names), to="varying"
            ),
            shape,
        )

    # --- generic forward and two-phase backward ---------------------------------------

    def forward(self, buffer: jax.Array, batch):
        """`(outputs, residuals, overflow, marker)`: `marker` is `ops.read_marker` of the
        outputs that `marker_outputs` names, for the commit to wait for."""
        res, overflow = self.route(batch)
        out = self.combine(self.owner(buffer, res), res)
        return out, res, overflow, ops.read_marker(*self.marker_outputs(out))

    def marker_outputs(self, outputs: Mapping[str, jax.Array]) -> list[jax.Array]:
        """Outputs that together depend on every read of the buffer: all of them, unless a
        cluster knows fewer suffice."""
        return list(outputs.values())

    def backward_stage(
        self,
        block,
        state,
        res,
        output_grads,
        optimizer: SparseOptimizer,
        step,
        seed=None,
        staging: ops.Staging | None = None,
        after=None,
    ) -> ops.StagedUpdate:
        """Routes output gradients to the owners (VJP of the linear combine, evaluated at
        zeros: no forward recomputation is needed) and applies the fused sparse update of the
        rows they touch, undoably (`ops.stage_backward_update`). `block` `[1, rows, width]`
        is this device's block of the group's buffer and `state` its optimizer state, with
        the same leading axis: updated where they are (donate them). `step`: the optimizer's
        step counter (learning-rate schedules); `seed` (uint32, the same on every device):
        stochastic rounding of the group's bfloat16 tables when the group asks for it
        (`Group.stochastic_rounding`); `staging`: the memory to save the previous rows into,
        or None for fresh; `after`: what the update waits for (`ops.read_marker` of the
        forward's lookups of the block)."""
        zeros = self.owner_out_zeros(block, res)
        _, vjp = jax.vjp(lambda o: self.combine_group(o, res), zeros)
        (g_owner,) = vjp(self.join(output_grads))
        seed = seed if self.group.stochastic_rounding else None
        how = UpdateArgs(optimizer, step, seed, staging, after)
        return self.stage(block, state, res, g_owner, how)

    @staticmethod
    def owner_stage(block, state, rows, seg, weights, g, combiner, how: UpdateArgs):
        """The owner side: one fused backward + optimizer call over every request this
        device received (duplicates across sources are merged), undoable."""
        return ops.stage_backward_update(
            block, state, g, rows, seg, weights, combiner=combiner, **how._asdict()
        )
