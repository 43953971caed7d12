"""The RB cluster (`sharding.clusters.rb`): which owner slots each device serves, the
node-level slots of the hierarchical path, overflow per table, and the inter-node bytes
the hierarchical exchange saves."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Topology
from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.sparse import SparseFeatures
from embark_jax.sharding.clusters.base import GroupInput
from embark_jax.sharding.collection import EmbeddingCollection
from tests.sharding.helpers import B, float_bytes, make_cluster, one_table


def test_hierarchical_rb_cuts_inter_node_bytes():
    topo = Topology(num_nodes=2, devices_per_node=4)
    # row shards inside node 0 (devices 0-3): partial vectors are summed before crossing
    tables, features, plan = one_table("rb", 4096, 8, topo=topo, row_shards=4)
    batch = SparseFeatures.from_dense({"f": np.random.default_rng(2).integers(0, 4096, (B, 8))})
    links = {}
    for hier in (False, True):
        coll = EmbeddingCollection(
            EmbeddingConfig.create(tables, features),
            plan,
            plan.make_mesh(),
            rngs=nnx.Rngs(0),
            options=RuntimeOptions(hierarchical=hier),
        )
        by_axis, links[hier] = float_bytes(coll, batch)
        # unweighted: only embedding vectors are floats, and they take the hierarchical path
        assert {axis for (_, axis) in by_axis} == ({"local", "node"} if hier else {"all"})
    assert links[True]["inter"] * 2 <= links[False]["inter"], links
    jax.clear_caches()


def test_owner_slots_by_hand():
    """4 row shards on devices 0-3 of one node: each serves one slot, ('f', column 0)."""
    rb = make_cluster("rb", 100, 3, row_shards=4)
    assert rb.served == [[("f", 0)]] * 4 + [[]] * 4 and rb.slots == 1
    np.testing.assert_array_equal(rb.slot_table["f"], [[0, 0, 0, 0]])
    assert not rb.hier  # one node: the flat exchange


def test_node_slots_of_the_hierarchical_path():
    """2 nodes x 4: row shards on devices 2 (node 0) and 5 (node 1); each node serves the
    one slot, and only those devices map an owner slot to it."""
    topo = Topology(num_nodes=2, devices_per_node=4)
    rb = make_cluster("rb", 100, 3, topo=topo, row_shards=2, devices=((2, 5),))
    assert rb.hier and rb.node_served == [[("f", 0)], [("f", 0)]] and rb.node_slots == 1
    want = np.full((8, 1), -1)
    want[[2, 5]] = 0
    np.testing.assert_array_equal(rb.owner_to_node_slot, want)
    flat = make_cluster(
        "rb",
        100,
        3,
        topo=topo,
        row_shards=2,
        devices=((2, 5),),
        options=RuntimeOptions(hierarchical=False),
    )
    assert not flat.hier


def test_an_occurrence_counts_once_however_many_column_slices_it_lost():
    """3 ids, 2 column slices: id 0 lost slice 0 and 1, id 1 slice 1: 2 occurrences lost."""
    rb = make_cluster("rb", 100, 3, row_shards=4)
    gi = GroupInput(
        jnp.array([5, 6, 7]), jnp.ones(3), jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32), (3,)
    )
    dropped = jnp.array([True, False, False, True, True, False])  # [slice 0 | slice 1]
    slot = jnp.array([0, 1, 2, 0, 1, 2])  # the id slot of each request
    assert rb._lost_per_table(gi, dropped, slot).tolist() == [2]
