"""`EmbeddingCollection`: the public entry point, a thin Flax NNX module over a functional
core (`lookup`, `apply_gradients`) that runs each cluster under `jax.shard_map`.

Inputs are the global batch as `SparseFeatures` (sharded over the mesh by sample); outputs
are per-feature `[B, dim]` (pooled) or `[B, max_hotness, dim]` (`none`) arrays sharded the
same way. Training is two-phase (docs/design.md §3): `lookup` also returns routing residuals, the
dense model produces gradients for the outputs, and `apply_gradients` routes them to the
owners and applies the fused sparse optimizer. Plain `jax.grad` through `lookup_fn` works too.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from embark_jax import ops
from embark_jax.core.names import name_mismatch
from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Plan
from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.sparse import SparseFeatures
from embark_jax.ops.optimizers import SparseOptimizer, rounding_seed
from embark_jax.sharding.bounds import check_batch, host_batch
from embark_jax.sharding.checks import (
    CapacityOverflowError,
    InvalidIdError,
    NonFiniteUpdateError,
    check_applied,
    check_invalid,
    check_overflow,
)
from embark_jax.sharding.clusters import CLUSTERS, ClusterBase
from embark_jax.sharding.lowering import Lowered, lower

__all__ = [
    "CapacityOverflowError",
    "EmbeddingCollection",
    "EmbeddingOptState",
    "EmbeddingTable",
    "GroupResiduals",
    "InvalidIdError",
    "LookupOutputs",
    "LookupResult",
    "NonFiniteUpdateError",
    "apply_gradients_fn",
    "check_invalid",
    "check_overflow",
    "init_staging",
    "lookup_fn",
    "per_table_optimizers",
]


class LookupOutputs(NamedTuple):
    """What `lookup_fn(..., with_invalid=True)` returns.

    outputs: feature -> `[B, d]` (pooled) or `[B, H, d]` (`none`), sharded by sample.
    residuals: group -> `GroupResiduals` (routing and read marker, leading device axis).
    overflow: `[num_tables]` int32, plan order, summed over devices: id occurrences whose
      vector (any column slice of it) was lost to a routing or dedup capacity.
    invalid: `[num_tables]` int32, plan order, summed over devices: ids `< -1` or
      `>= vocab_size` of their table, dropped like padding (`embark_jax.sharding.bounds`).
    """

    outputs: dict[str, jax.Array]
    residuals: Any
    overflow: jax.Array
    invalid: jax.Array


class GroupResiduals(NamedTuple):
    """What a group's lookup leaves for its update: the cluster's routing (`DPResiduals`,
    `RBResiduals`, `UBResiduals`) and the read marker its commit waits for
    (`ops.read_marker`), each with a leading device axis."""

    routing: Any
    marker: jax.Array


class EmbeddingTable(nnx.Variable):
    """A stacked `[G, rows_per_device, width]` buffer of embedding shards. Its own variable
    type, not an `nnx.Param`: the sparse optimizer updates it in place, so a dense optimizer
    built with `wrt=nnx.Param` (the usual Flax line) never sees the tables."""


class EmbeddingOptState(nnx.Variable):
    """Sparse optimizer slots of one stacked buffer (leading device axis)."""


class RoundingCounter(nnx.Variable):
    """uint32 `[key words..., updates applied]`: the stochastic-rounding seed of the next
    `apply_gradients` is `rounding_seed(key words, updates applied)`, and the sparse
    optimizers' step counter (learning-rate schedules) is the updates applied."""


@functools.lru_cache(maxsize=64)
def _clusters(
    lowered: Lowered,
    local_batch: int,
    hotness: tuple[tuple[str, int], ...],
    options: RuntimeOptions,
) -> dict[str, ClusterBase]:
    hot = dict(hotness)
    return {
        g.name: CLUSTERS[g.cluster](lowered, g, local_batch, hot, options) for g in lowered.groups
    }


def _clusters_for(lowered: Lowered, batch: SparseFeatures, options: RuntimeOptions):
    _check_batch(lowered, batch)
    hot = tuple(sorted((n, batch.hotness(n)) for n in batch.feature_names))
    return _clusters(lowered, batch.batch_size // lowered.num_devices, hot, options)


def _check_batch(lowered: Lowered, batch: SparseFeatures) -> None:
    """The batch's features are the collection's, in the layout, and split over the plan's
    devices (host arrays or tracers: shapes only)."""
    batch.check_layout(lowered.config)
    g, b = lowered.num_devices, batch.batch_size
    if b % g:
        raise ValueError(f"batch size {b} is not divisible by the {g} devices of the plan")


def _host(lowered: Lowered, batch: SparseFeatures) -> SparseFeatures:
    """A batch given to a method, its host ids converted (`bounds.host_batch`) and the batch
    checked before any device sees it."""
    batch = host_batch(batch)
    _check_batch(lowered, batch)
    return batch


def lookup_fn(
    lowered: Lowered,
    mesh: jax.sharding.Mesh,
    options: RuntimeOptions,
    buffers: Mapping[str, jax.Array],
    batch: SparseFeatures,
    *,
    with_invalid: bool = False,
):
    """Functional lookup: `(outputs, residuals, overflow)`, or with `with_invalid=True` a
    `LookupOutputs` `(outputs, residuals, overflow, invalid)`.

    `outputs[feature]` is `[B, d]` or `[B, H, d]`; `residuals` are the routing arrays the
    backward needs (per device); `overflow` and `invalid` are `[num_tables]` int32, summed
    over devices, in `lowered.plan.tables` order (see `LookupOutputs`). Ids outside their
    table are always dropped like padding (never read or update another table's rows);
    `with_invalid` only decides whether their count is returned. Differentiable wrt
    `buffers`.
    """
    clusters = _clusters_for(lowered, batch, options)
    spec = lowered.spec
    names = [t.name for t in lowered.plan.tables]

    def body(bufs, local_batch):
        # every group's features side by side in the checked ids: a group takes one slice
        order = [f.name for g in lowered.groups for f in lowered.features_of(g)]
        local_batch, invalid = check_batch(lowered.config, names, local_batch, order)
        outputs, residuals = {}, {}
        overflow = jnp.zeros((len(names),), jnp.int32)
        for gname, cl in clusters.items():
            out, res, ov, marker = cl.forward(bufs[gname][0], local_batch)
            outputs.update(out)
            routed = GroupResiduals(res, marker)
            residuals[gname] = jax.tree.map(lambda x: x[None], routed)
            idx = np.array([names.index(t) for t in cl.table_names])
            overflow = overflow.at[idx].add(ov)
        counts = jax.lax.psum(jnp.stack([overflow, invalid]), lowered.axis_names)
        return outputs, residuals, counts[0], counts[1]

    out_specs = (spec, spec, P(), P())
    run = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=out_specs)
    result = LookupOutputs(*run(dict(buffers), batch))
    return result if with_invalid else tuple(result[:3])


def apply_gradients_fn(
    lowered: Lowered,
    mesh: jax.sharding.Mesh,
    options: RuntimeOptions,
    buffers,
    states,
    residuals,
    output_grads,
    optimizers: Mapping[str, SparseOptimizer],
    batch_like: SparseFeatures,
    seed: jax.Array | None = None,
    *,
    step: jax.Array | int | None = None,
    allow: jax.Array | bool = True,
    staging: Mapping[str, ops.Staging] | None = None,
):
    """Functional two-phase backward, in place and transactional: returns the
    `(buffers, states, applied)` after the update, and with `staging` given
    `(buffers, states, applied, staging)`.

    Every group's update is applied in place first, undoably (`ops.stage_backward_update`:
    the rows the batch touches are updated where they lie and their previous values saved,
    O(ids)). The update is kept, on every device at once, only if `allow` (a bool scalar the
    caller decides, e.g. a finite loss) holds and every updated value on every device is
    finite; otherwise the saved rows are written back and the buffers and states come back
    bit-identical. `applied` (`[]` bool, replicated) says which happened. Donate `buffers`
    and `states`: they are updated in place.

    `optimizers` maps each group (buffer) name to its sparse optimizer; `step` is their step
    counter (a learning-rate schedule is evaluated at it; required for scheduled rates).
    `seed` (uint32 scalar, a new one every step: `optimizers.rounding_seed(key, step)`)
    drives the stochastic rounding of bfloat16 tables with `stochastic_rounding`; it is
    required when there are such tables.

    `staging` (from `init_staging`, donated with the buffers): the memory each group's update
    saves the previous rows into, returned for the next step; without it every step saves
    into fresh memory, whose page faults cost about as much as the update. A group whose staging does not
    fit this batch (another batch shape or dtype than it was made for) stages into fresh memory
    and hands its staging back untouched; a group missing from `staging` stages into fresh
    memory and is missing from the returned staging too."""
    stochastic = [g.name for g in lowered.groups if g.stochastic_rounding]
    if seed is None and stochastic:
        raise ValueError(
            f"apply_gradients_fn: groups {stochastic} round bfloat16 updates stochastically "
            "(TableConfig.stochastic_rounding) and need a new seed every step: pass "
            "seed=rounding_seed(key, step)"
        )
    seed = jnp.zeros((), jnp.uint32) if seed is None else jnp.asarray(seed).astype(jnp.uint32)
    step = jnp.zeros((), jnp.int32) if step is None else jnp.asarray(step, jnp.int32)
    if staging is not None:
        staging = _checked_staging(lowered, staging)
    args = (buffers, states, residuals, output_grads, optimizers, batch_like, seed, step, allow)
    return _apply(lowered, mesh, options, args, staging)


def _apply(lowered, mesh, options, args: tuple, staging, discover: bool = False):
    """`apply_gradients_fn` after its checks, `args` its arguments `(buffers, states,
    residuals, output_grads, optimizers, batch_like, seed, step, allow)`; `discover`: return
    every group's staged memory, also of the groups `staging` lacks (`init_staging` reads
    its shapes)."""
    buffers, states, residuals, output_grads, optimizers, batch_like, seed, step, allow = args
    clusters = _clusters_for(lowered, batch_like, options)
    spec = lowered.spec

    def body(bufs, sts, res, grads, stg, seed, step, allow):
        staged, finite = {}, jnp.bool_(True)
        for gname, cl in clusters.items():
            r, marker = jax.tree.map(lambda x: x[0], res[gname])
            staged[gname] = cl.backward_stage(
                bufs[gname],
                sts[gname],
                r,
                grads,
                optimizers[gname],
                step,
                seed,
                stg.get(gname),
                after=marker,
            )
            finite &= staged[gname].finite
        bad = jax.lax.psum((~finite).astype(jnp.int32), lowered.axis_names)
        commit = allow & (bad == 0)
        new_b, new_s, new_stg = {}, {}, {}
        for gname in clusters:
            new_b[gname], new_s[gname] = ops.commit_update(
                staged[gname], commit, optimizer=optimizers[gname]
            )
        for gname in clusters:
            fresh = ops.Staging.of(staged[gname])
            old = stg.get(gname)
            if old is not None:
                fits = all(
                    a.shape == b.shape and a.dtype == b.dtype
                    for a, b in zip(old, fresh, strict=True)
                )
                new_stg[gname] = fresh if fits else old
            elif discover:
                new_stg[gname] = fresh
        return new_b, new_s, commit, new_stg

    in_specs = (spec, spec, spec, spec, spec, P(), P(), P())
    run = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(spec, spec, P(), spec))
    allow = jnp.asarray(allow, bool)
    stg = dict(staging or {})
    out = run(dict(buffers), dict(states), residuals, dict(output_grads), stg, seed, step, allow)
    return out if staging is not None else out[:3]


def _checked_staging(lowered: Lowered, staging) -> dict[str, ops.Staging]:
    """`staging` as `{group: ops.Staging}`; a one-line error for another type or an unknown
    group name."""
    if not isinstance(staging, Mapping):
        raise ValueError(
            "apply_gradients_fn: staging must map group names to ops.Staging (init_staging), "
            f"got {type(staging).__name__}"
        )
    names = [g.name for g in lowered.groups]
    out = {}
    for name, value in staging.items():
        if name not in names:
            raise ValueError(
                f"apply_gradients_fn: staging has unknown group {name!r}; groups: {names}"
            )
        if not (isinstance(value, tuple | list) and len(value) == 3) or not all(
            hasattr(x, "shape") for x in value
        ):
            raise ValueError(
                f"apply_gradients_fn: staging[{name!r}] must be an ops.Staging of 3 arrays "
                f"(init_staging), got {type(value).__name__}"
            )
        out[name] = ops.Staging(*value)
    return out


def init_staging(
    lowered: Lowered,
    mesh: jax.sharding.Mesh,
    options: RuntimeOptions,
    buffers,
    states,
    optimizers: Mapping[str, SparseOptimizer],
    batch_like: SparseFeatures,
) -> dict[str, ops.Staging]:
    """Zeroed staging memory for `apply_gradients_fn(staging=...)`: per group, what its
    update stages for batches shaped like `batch_like` (arrays or `jax.ShapeDtypeStruct`s,
    e.g. `SparseFeatures.abstract`): each array is the devices' blocks one after the other
    along its first axis (a device's block as its kernel writes it, so that nothing reshapes
    or copies it). O(ids) a device: at most one row per id the device's update receives
    (min(ids, rows))."""

    def staged(bufs, sts, batch):
        outputs, residuals, _ = lookup_fn(lowered, mesh, options, bufs, batch)
        seed, step, allow = jnp.zeros((), jnp.uint32), jnp.zeros((), jnp.int32), jnp.bool_(True)
        args = (bufs, sts, residuals, outputs, optimizers, batch, seed, step, allow)
        return _apply(lowered, mesh, options, args, {}, discover=True)[3]

    shapes = jax.eval_shape(staged, dict(buffers), dict(states), batch_like)
    sharding = lowered.sharding(mesh)
    zeros = jax.jit(  # each device makes its own block: no whole array on one device
        lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
        out_shardings=jax.tree.map(lambda _: sharding, shapes),
    )
    return zeros()


@functools.lru_cache(maxsize=32)
def _jit_lookup(lowered: Lowered, mesh, options: RuntimeOptions):
    return jax.jit(functools.partial(lookup_fn, lowered, mesh, options, with_invalid=True))


@functools.lru_cache(maxsize=32)
def _jit_apply(
    lowered: Lowered,
    mesh,
    options: RuntimeOptions,
    optimizers: tuple[tuple[str, SparseOptimizer], ...],
):
    def run(buffers, states, residuals, output_grads, batch_like, rounding):
        applied_so_far = rounding[-1]
        seed = rounding_seed(rounding[:-1], applied_so_far)
        args = (buffers, states, residuals, output_grads, dict(optimizers), batch_like, seed)
        buffers, states, applied = apply_gradients_fn(
            lowered, mesh, options, *args, step=applied_so_far.astype(jnp.int32)
        )
        return buffers, states, applied, rounding.at[-1].add(applied.astype(jnp.uint32))

    # The tables and slots are donated: the kernels update them in place.
    return jax.jit(run, donate_argnums=(0, 1))


@dataclasses.dataclass
class LookupResult:
    """`EmbeddingCollection.lookup`: outputs, residuals, and per-table counts (table name
    -> scalar) of ids lost to a capacity (`overflow`) and of ids outside their table's
    vocabulary, dropped like padding (`invalid`); `batch` is the batch looked up (what
    `apply_gradients` routes the gradients with)."""

    outputs: dict[str, jax.Array]
    residuals: Any
    overflow: dict[str, jax.Array]
    invalid: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    batch: SparseFeatures | None = None


class EmbeddingCollection(nnx.Module):
    """Embedding tables sharded by a `Plan` over a mesh, looked up as clusters.

    The NNX entry point for interactive use: it holds the stacked buffers and optimizer
    slots as NNX variables and runs the same functional core (`lookup_fn`,
    `apply_gradients_fn`) that training uses on a `TrainState`.

    Arguments:
      config: the tables and the features that look them up (`EmbeddingConfig`).
      plan: where every shard lives (`embark_jax.core.plan.Plan`).
      mesh: from `plan.make_mesh()`; a `("node", "local")` mesh enables hierarchical RB.
      rngs: `nnx.Rngs` for the table initialisers.
      optimizer: one `SparseOptimizer` for every table, or a mapping table -> optimizer;
        None: lookups only (`apply_gradients` then raises). Fixed at construction;
        `reset_optimizer` replaces it explicitly (and re-initialises the slots).
      options: `RuntimeOptions` (hierarchical RB, capacity factor, communication dtype,
        DP gradient exchange, overflow policy: with `overflow="error"`, a lookup with ids
        outside their table's vocabulary raises `InvalidIdError`, one whose ids overflow a
        capacity `CapacityOverflowError`, when the counts are concrete, i.e. outside
        `jax.jit`; inside, call `check_invalid` / `check_overflow`). Ids outside their
        table are dropped like padding under every policy, never read from or written to
        another table's rows.
    """

    def __init__(
        self,
        config: EmbeddingConfig,
        plan: Plan,
        mesh: jax.sharding.Mesh,
        *,
        rngs: nnx.Rngs,
        optimizer: SparseOptimizer | Mapping[str, SparseOptimizer] | None = None,
        options: RuntimeOptions | None = None,
    ):
        if not isinstance(config, EmbeddingConfig):
            raise TypeError(
                "EmbeddingCollection takes an EmbeddingConfig: "
                "EmbeddingConfig.create(tables, features)"
            )
        if tuple(mesh.axis_names) != plan.axis_names:
            raise ValueError(
                f"mesh axes {mesh.axis_names} != plan axes {plan.axis_names}; "
                "build the mesh with plan.make_mesh()"
            )
        self.config = config
        self.mesh = mesh
        self.options = options or RuntimeOptions()
        self.lowered = lower(plan, config, per_table_optimizers(config, optimizer))
        sharding = self.lowered.sharding(mesh)
        key = rngs.params()
        self.buffers = nnx.Dict(
            {
                g.name: EmbeddingTable(self.lowered.init_buffer(g, key, sharding))
                for g in self.lowered.groups
            }
        )
        # the key words come from the tables' key (no draw from `rngs`), the counter from 0
        words = jax.random.key_data(jax.random.fold_in(key, 0x5352)).ravel()
        self.rounding = RoundingCounter(jnp.append(words, 0).astype(jnp.uint32))
        self.opt_state = nnx.Dict({})
        if optimizer is not None:
            self._init_states()

    # --- state -------------------------------------------------------------------------

    def buffer_values(self) -> dict[str, jax.Array]:
        return {k: v.get_value() for k, v in self.buffers.items()}

    @property
    def optimizers(self) -> dict[str, SparseOptimizer]:
        """Group (buffer) name -> its sparse optimizer (empty without one)."""
        return {g.name: g.optimizer for g in self.lowered.groups if g.optimizer is not None}

    def reset_optimizer(self, optimizer: SparseOptimizer | Mapping[str, SparseOptimizer]) -> None:
        """Replaces the sparse optimizer(s) and starts their slots afresh (explicitly)."""
        self.lowered = lower(
            self.lowered.plan, self.config, per_table_optimizers(self.config, optimizer)
        )
        self._init_states()

    def _init_states(self) -> None:
        sharding = self.lowered.sharding(self.mesh)
        for g in self.lowered.groups:
            buf = self.buffers[g.name].get_value()
            state = jax.jit(jax.vmap(g.optimizer.init))(buf)
            self.opt_state[g.name] = EmbeddingOptState(jax.device_put(state, sharding))

    def state_values(self) -> dict[str, Any]:
        return {k: v.get_value() for k, v in self.opt_state.items()}

    def full_tables(self) -> dict[str, np.ndarray]:
        """Table name -> numpy `[vocab_size, dim]`, gathered from the shards."""
        return self.lowered.unstack({k: np.asarray(v) for k, v in self.buffer_values().items()})

    # --- lookups -----------------------------------------------------------------------

    def shard_batch(self, batch: SparseFeatures) -> SparseFeatures:
        """Places a host batch on the mesh, split by sample."""
        return jax.device_put(_host(self.lowered, batch), self.lowered.sharding(self.mesh))

    def lookup(self, batch: SparseFeatures) -> LookupResult:
        """Outputs plus the routing residuals for `apply_gradients`, and overflow counts."""
        batch = _host(self.lowered, batch)
        out = _jit_lookup(self.lowered, self.mesh, self.options)(self.buffer_values(), batch)
        tables = self.lowered.plan.tables
        counts = {t.name: out.overflow[i] for i, t in enumerate(tables)}
        invalid = {t.name: out.invalid[i] for i, t in enumerate(tables)}
        if self.options.strict:
            check_invalid(invalid)
            check_overflow(counts)
        return LookupResult(out.outputs, out.residuals, counts, invalid, batch)

    def __call__(self, batch: SparseFeatures) -> dict[str, jax.Array]:
        return self.lookup(batch).outputs

    check_overflow = staticmethod(check_overflow)
    check_invalid = staticmethod(check_invalid)

    def apply_gradients(
        self,
        result: LookupResult,
        output_grads: Mapping[str, jax.Array],
        batch: SparseFeatures | None = None,
    ) -> jax.Array:
        """Routes `output_grads` (per feature, shaped like the outputs) to the owners and
        applies the fused sparse optimizer(s) in place. bfloat16 tables with
        `stochastic_rounding` get a new rounding seed each call (`RoundingCounter`).

        Transactional: an update that would write a NaN or inf (non-finite gradients, a
        diverging learning rate) is not applied on any device, and the tables and slots
        stay bit-identical; then, outside `jax.jit`, `NonFiniteUpdateError` is raised.
        Returns `applied` (`[]` bool). `batch` defaults to the batch `result` was looked up
        with; one given must hold the same ids (gradients routed with another batch's
        residuals would update the wrong rows)."""
        opts = self.optimizers
        if len(opts) != len(self.lowered.groups):
            raise ValueError(
                "this collection has no sparse optimizer: give one at construction "
                "or call reset_optimizer"
            )
        batch = _same_batch(self.lowered, result, batch)
        grads = _checked_grads(result.outputs, output_grads)
        rounding = self.rounding.get_value()
        state = (self.buffer_values(), self.state_values(), result.residuals, grads)
        new_b, new_s, applied, rounding = _jit_apply(
            self.lowered, self.mesh, self.options, tuple(sorted(opts.items()))
        )(*state, batch, rounding)
        self.rounding.set_value(rounding)
        for k in new_b:
            self.buffers[k].set_value(new_b[k])
            self.opt_state[k].set_value(new_s[k])
        check_applied(applied, "apply_gradients")
        return applied


def _same_batch(lowered: Lowered, result: LookupResult, batch) -> SparseFeatures:
    """The batch to route `result`'s gradients with: `result.batch`, or a given one after
    checking that it holds the same ids (a one-line `ValueError` naming the feature)."""
    looked_up = result.batch
    if batch is None or batch is looked_up:
        if looked_up is None:
            raise ValueError("apply_gradients: pass the batch the result was looked up with")
        return looked_up
    batch = _host(lowered, batch)
    if looked_up is None:
        return batch
    for name in looked_up.feature_names:
        a, b = looked_up.ids[name], batch.ids.get(name)
        if b is None or np.shape(a) != np.shape(b) or not np.array_equal(a, b):
            raise ValueError(
                f"apply_gradients: feature {name!r}: the batch's ids are not the ones the "
                "lookup result was computed from; pass the same batch (or none)"
            )
    return looked_up


def _checked_grads(outputs: Mapping[str, jax.Array], grads: Mapping[str, jax.Array]):
    """`grads` as a dict, one per output feature and shaped like it (else a one-line
    `ValueError` naming the feature)."""
    extra, missing = name_mismatch(grads, outputs)
    if missing or extra:
        raise ValueError(
            f"apply_gradients: gradients must be given for exactly the looked-up features; "
            f"missing {missing}, unknown {extra}"
        )
    out = {}
    for name, y in outputs.items():
        g = grads[name]
        if np.shape(g) != np.shape(y):
            raise ValueError(
                f"apply_gradients: feature {name!r}: gradient of shape {tuple(np.shape(g))} "
                f"for an output of shape {tuple(np.shape(y))}"
            )
        out[name] = g
    return out


def per_table_optimizers(
    config: EmbeddingConfig, optimizer: SparseOptimizer | Mapping[str, SparseOptimizer] | None
) -> dict[str, SparseOptimizer] | None:
    """Table name -> optimizer (None: no optimizer)."""
    if optimizer is None:
        return None
    if isinstance(optimizer, SparseOptimizer):
        return {t.name: optimizer for t in config.tables}
    missing = sorted(t.name for t in config.tables if t.name not in optimizer)
    if missing:
        raise ValueError(f"no sparse optimizer given for tables {missing}")
    return {t.name: optimizer[t.name] for t in config.tables}
