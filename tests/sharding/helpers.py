"""Small single-table setups shared by the sharding tests: a one-table plan, a cluster
built from it, and the float bytes its compiled lookup moves per mesh axis and link."""

from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.sharding import hlo_bytes as comm
from embark_jax.sharding.bounds import check_batch
from embark_jax.sharding.clusters import CLUSTERS
from embark_jax.sharding.collection import _jit_lookup
from embark_jax.sharding.lowering import lower

G, B = 8, 64


def float_bytes(coll, batch):
    compiled = (
        _jit_lookup(coll.lowered, coll.mesh, coll.options)
        .lower(coll.buffer_values(), coll.shard_batch(batch))
        .compile()
    )
    mesh_shape = tuple(coll.mesh.shape.values())
    by_axis = comm.collective_bytes(compiled, mesh_shape, coll.mesh.axis_names, floats_only=True)
    return by_axis, comm.link_bytes(by_axis, mesh_shape)


def one_table(cluster, vocab, hot, topo=None, row_shards=4, devices=None, batch_size=B, **extra):
    topo = topo or Topology(num_nodes=1, devices_per_node=G)
    tables = [TableConfig(name="t", vocab_size=vocab, dim=16)]
    features = [FeatureConfig(name="f", table="t", max_hotness=hot)]
    devices = devices or (tuple(range(row_shards)),)
    plan = Plan(
        topology=topo,
        batch_size=batch_size,
        tables=(
            TablePlan(
                name="t",
                cluster=cluster,
                row_shards=row_shards,
                column_shards=1,
                devices=devices,
                **extra,
            ),
        ),
    )
    return tables, features, plan


def make_cluster(cluster, vocab, hot, local_batch=2, options=None, **kwargs):
    """The cluster of `one_table(cluster, vocab, hot, **kwargs)`'s only group, for a local
    batch of `local_batch` samples."""
    tables, features, plan = one_table(cluster, vocab, hot, **kwargs)
    lowered = lower(plan, EmbeddingConfig.create(tables, features))
    (group,) = lowered.groups
    opts = options or RuntimeOptions()
    return CLUSTERS[group.cluster](lowered, group, local_batch, {"f": hot}, opts)


def checked(cluster, batch):
    """`batch` bounds-checked against `cluster`'s config: what its `route` takes."""
    tables = [t.name for t in cluster.lowered.plan.tables]
    return check_batch(cluster.lowered.config, tables, batch)[0]
