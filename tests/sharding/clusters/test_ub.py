"""The UB cluster (`sharding.clusters.ub`): overflow counted per id occurrence, not per
unique id (its capacities: tests/sharding/test_capacity.py)."""

import jax.numpy as jnp

from tests.sharding.helpers import make_cluster


def test_lost_ids_are_occurrences_of_dropped_or_undeduplicated_ids():
    """Ids 5, 5, 7, 9 and a padding id: unique 0 (id 5) lost its routing slot and id 9
    found no dedup slot (inv -1), so 3 occurrences are lost; 7 and the padding are not."""
    ub = make_cluster("ub", 100, 3, row_shards=2, devices=((0, 1),))
    assert ub.unique_capacity == {"t": 6}
    ids, inv = jnp.array([5, 5, 7, -1, 9]), jnp.array([0, 0, 1, -1, -1])
    dropped = jnp.array([True] + [False] * 5)  # one column slice x 6 unique slots
    assert ub._lost_per_table(dropped, [(ids, inv)]).tolist() == [3]
    assert ub._lost_per_table(jnp.zeros(6, bool), [(ids, inv)]).tolist() == [1]
