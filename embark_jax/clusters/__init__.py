"""The embedding clusters (DESIGN.md §3): DP, RB (flat and hierarchical) and UB, each a
`ClusterBase` subclass sharing the routing layer (`embark_jax.routing`)."""

from embark_jax.clusters.base import ClusterBase, Options
from embark_jax.clusters.dp import DPCluster
from embark_jax.clusters.rb import RBCluster
from embark_jax.clusters.ub import UBCluster
from embark_jax.plan import Cluster

__all__ = ["CLUSTERS", "ClusterBase", "DPCluster", "Options", "RBCluster", "UBCluster"]

CLUSTERS = {Cluster.DP: DPCluster, Cluster.RB: RBCluster, Cluster.UB: UBCluster}
