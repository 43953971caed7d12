"""The training state, one pytree with one owner, and the static setup it is trained under.

`TrainState` holds every array that changes during training: the step counter, the dense
parameters and their optax state, the embedding buffers (one stacked `[G, rows, width]`
buffer per lowered group) and their sparse-optimizer slots, and an RNG key. Whoever holds
a `TrainState` owns it; functions take one and return a new one (an in-place step runner
donates the old one; the default, transactional one leaves it valid). Nothing else keeps
a copy.

`TrainSetup` holds what does not change: the configs, the lowered plan, the mesh, the
run-time options, the optimizers and the dense model's graph. It is immutable; a new
plan (e.g. grown capacities) is a new setup, over the same state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embark_jax.core.dynamic import DynamicConfig
from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Plan
from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.sparse import SparseFeatures
from embark_jax.ops.optimizers import SparseOptimizer
from embark_jax.sharding.collection import init_staging as sharding_init_staging
from embark_jax.sharding.collection import per_table_optimizers
from embark_jax.sharding.dynamic import DynamicShards
from embark_jax.sharding.lowering import Lowered, lower
from embark_jax.training.models import DenseConfig, make_model

__all__ = ["TrainSetup", "TrainState", "create", "full_tables", "init_staging", "with_plan"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything that training changes (a pytree; see the module docstring).

    Attributes:
      step: `[]` int32, steps applied.
      dense_params: the dense model's `nnx.Param` state.
      dense_opt: the optax state of the dense parameters.
      tables: group name -> `[G, rows_per_device, width]` embedding buffer.
      slots: group name -> the sparse optimizer's state (a NamedTuple of slot arrays).
      rng: a PRNG key (raw uint32), for anything random in the step.
      dynamic: dynamic table name -> its shards, stacked (`DynamicTableState`, leading
        device axis; empty without dynamic tables).
      staging: group name -> the memory its sparse update is staged into
        (`sharding.init_staging`; O(ids) a device, never checkpointed: its contents are the
        last step's staged rows, never read). Empty: every step stages into fresh memory.
    """

    step: jax.Array
    dense_params: Any
    dense_opt: Any
    tables: dict[str, jax.Array]
    slots: dict[str, Any]
    rng: jax.Array
    dynamic: dict[str, Any] = dataclasses.field(default_factory=dict)
    staging: dict[str, Any] = dataclasses.field(default_factory=dict)

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, eq=False)
class TrainSetup:
    """The static side of training (see the module docstring). Build it with `create`.

    Attributes:
      config: tables and features. lowered: the plan lowered to stacked buffers.
      mesh: the plan's device mesh. options: `RuntimeOptions`.
      optimizers: group name -> its `SparseOptimizer` (fixed at construction).
      graphdef: the dense model's NNX graph (merged with `TrainState.dense_params`).
      tx: the dense optax transformation. num_dense: dense features per sample.
      dense_template: shapes, dtypes and shardings of `{"params", "opt", "rng"}` (what a
        checkpoint restore builds the dense part of a new state into).
      dynamic: the dynamic tables (`DynamicShards`: config, mesh, optimizers), or None.
    """

    config: EmbeddingConfig
    lowered: Lowered
    mesh: jax.sharding.Mesh
    options: RuntimeOptions
    optimizers: Mapping[str, SparseOptimizer]
    graphdef: Any
    tx: optax.GradientTransformation
    num_dense: int
    dense_template: Any
    dynamic: DynamicShards | None = None

    @property
    def plan(self) -> Plan:
        return self.lowered.plan

    @property
    def table_sharding(self) -> NamedSharding:
        """Sharding of the embedding buffers and of batches (axis 0 over every mesh axis)."""
        return self.lowered.sharding(self.mesh)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def dense_model(self, params) -> nnx.Module:
        return nnx.merge(self.graphdef, params)


def create(
    config: EmbeddingConfig,
    plan: Plan,
    *,
    dense: DenseConfig,
    sparse_optimizer: SparseOptimizer | Mapping[str, SparseOptimizer],
    dense_optimizer: optax.GradientTransformation | None = None,
    num_dense: int = 13,
    seed: int = 0,
    options: RuntimeOptions | None = None,
    mesh: jax.sharding.Mesh | None = None,
    dynamic: DynamicConfig | None = None,
) -> tuple[TrainSetup, TrainState]:
    """The setup and a freshly initialised state for training `config` sharded by `plan`.

    `sparse_optimizer` is one optimizer for every table or a mapping table -> optimizer
    (dynamic tables included); `dense_optimizer` defaults to Adam(1e-3). Tables are
    initialised shard by shard on their devices (no host holds a whole table). `dynamic`:
    dynamic tables and their features, one shard per device of the mesh, empty at first.
    """
    lowered = lower(plan, config, per_table_optimizers(config, sparse_optimizer))
    mesh = plan.make_mesh() if mesh is None else mesh
    rngs = nnx.Rngs(seed)
    key = rngs.params()
    tables = {g.name: lowered.init_buffer(g, key, lowered.sharding(mesh)) for g in lowered.groups}
    dims = {f.name: config.table_of(f).dim for f in config.features}
    shards = _dynamic_shards(config, dynamic, mesh, sparse_optimizer)
    if shards is not None:
        dims |= {f.name: dynamic.table(f.table).dim for f in dynamic.features}
    graphdef, params = nnx.split(make_model(dense, num_dense, dims, rngs=rngs), nnx.Param)
    tx = dense_optimizer or optax.adam(1e-3)
    rep = NamedSharding(mesh, P())
    params = jax.device_put(params, rep)
    dense_part = {
        "params": params,
        "opt": jax.device_put(tx.init(params), rep),
        "rng": jax.device_put(jax.random.key_data(jax.random.key(seed)), rep),
    }
    setup = TrainSetup(
        config=config,
        lowered=lowered,
        mesh=mesh,
        options=options or RuntimeOptions(),
        optimizers={g.name: g.optimizer for g in lowered.groups},
        graphdef=graphdef,
        tx=tx,
        num_dense=num_dense,
        dense_template=jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), dense_part
        ),
        dynamic=shards,
    )
    slots = init_slots(setup, tables)
    state = TrainState(
        step=jax.device_put(jnp.zeros((), jnp.int32), rep),
        dense_params=dense_part["params"],
        dense_opt=dense_part["opt"],
        tables=tables,
        slots=slots,
        rng=dense_part["rng"],
        dynamic={} if shards is None else shards.init(),
        staging=init_staging(setup, tables, slots),
    )
    return setup, state


def _dynamic_shards(config, dynamic, mesh, sparse_optimizer) -> DynamicShards | None:
    """The dynamic tables' `DynamicShards`, their names checked against the fixed ones."""
    if dynamic is None or not dynamic.tables:
        return None
    if not isinstance(dynamic, DynamicConfig):
        raise ValueError(f"create: dynamic must be a DynamicConfig, got {type(dynamic).__name__}")
    fixed = {t.name for t in config.tables} | {f.name for f in config.features}
    clash = sorted(fixed & ({t.name for t in dynamic.tables} | {f.name for f in dynamic.features}))
    if clash:
        raise ValueError(f"create: dynamic names {clash} are also fixed tables or features")
    if isinstance(sparse_optimizer, SparseOptimizer):
        optimizers = {t.name: sparse_optimizer for t in dynamic.tables}
    else:
        missing = sorted({t.name for t in dynamic.tables} - set(sparse_optimizer))
        if missing:
            raise ValueError(f"create: sparse_optimizer has no entry for dynamic tables {missing}")
        optimizers = {t.name: sparse_optimizer[t.name] for t in dynamic.tables}
    return DynamicShards(dynamic, mesh, optimizers)


def init_staging(
    setup: TrainSetup, tables: Mapping[str, jax.Array], slots: Mapping[str, Any]
) -> dict[str, Any]:
    """Staging memory for the plan's batch size (`TrainState.staging`)."""
    batch = SparseFeatures.abstract(setup.config, setup.lowered.plan.batch_size)
    return sharding_init_staging(
        setup.lowered, setup.mesh, setup.options, tables, slots, setup.optimizers, batch
    )


def init_slots(setup: TrainSetup, tables: Mapping[str, jax.Array]) -> dict[str, Any]:
    """Fresh optimizer slots for the given group buffers, sharded like them."""
    sharding = setup.table_sharding
    out = {}
    for name, buf in tables.items():
        state = jax.jit(jax.vmap(setup.optimizers[name].init))(buf)
        out[name] = jax.device_put(state, sharding)
    return out


def with_plan(setup: TrainSetup, plan: Plan) -> TrainSetup:
    """The same setup over another plan with the same shard layout (e.g. other capacities);
    the state's buffers stay valid. A plan that moves shards needs a checkpoint restore."""
    opts = {t: g.optimizer for g in setup.lowered.groups for t in g.tables}
    lowered = lower(plan, setup.config, opts)
    if [(g.name, g.shards) for g in lowered.groups] != [
        (g.name, g.shards) for g in setup.lowered.groups
    ]:
        raise ValueError("with_plan: the new plan places shards differently; restore instead")
    return dataclasses.replace(setup, lowered=lowered)


def full_tables(setup: TrainSetup, state: TrainState) -> dict[str, np.ndarray]:
    """Table name -> numpy `[vocab_size, dim]`, gathered from the shards (small tables and
    tests; checkpoints stream table by table instead)."""
    return setup.lowered.unstack({k: np.asarray(v) for k, v in state.tables.items()})
