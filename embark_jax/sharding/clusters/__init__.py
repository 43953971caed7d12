"""The embedding clusters (DESIGN.md §3): DP, RB (flat and hierarchical) and UB, each a
`ClusterBase` subclass sharing the routing layer (`embark_jax.sharding.routing`)."""

from embark_jax.core.plan import Cluster
from embark_jax.sharding.clusters.base import ClusterBase
from embark_jax.sharding.clusters.dp import DPCluster
from embark_jax.sharding.clusters.rb import RBCluster
from embark_jax.sharding.clusters.ub import UBCluster

__all__ = ["CLUSTERS", "ClusterBase", "DPCluster", "RBCluster", "UBCluster"]

CLUSTERS = {Cluster.DP: DPCluster, Cluster.RB: RBCluster, Cluster.UB: UBCluster}
