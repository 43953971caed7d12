"""The embedding clusters (`docs/design.md`, "Clusters"): DP, RB (flat and hierarchical) and
UB, each a `ClusterBase` subclass sharing the routing layer (`embark_jax.sharding.routing`)
and capacity sizing (`embark_jax.sharding.capacity`). Each cluster's `route` returns its
residuals as a typed `NamedTuple` (`DPResiduals`, `RBResiduals`, `UBResiduals`)."""

from embark_jax.core.plan import Cluster
from embark_jax.sharding.clusters.base import ClusterBase
from embark_jax.sharding.clusters.dp import DPCluster, DPResiduals
from embark_jax.sharding.clusters.rb import RBCluster, RBResiduals
from embark_jax.sharding.clusters.ub import UBCluster, UBResiduals

__all__ = [
    "CLUSTERS",
    "ClusterBase",
    "DPCluster",
    "DPResiduals",
    "RBCluster",
    "RBResiduals",
    "UBCluster",
    "UBResiduals",
]

CLUSTERS = {Cluster.DP: DPCluster, Cluster.RB: RBCluster, Cluster.UB: UBCluster}
