"""embark_jax: EMBark-style embedding training for JAX.

Importing the package registers the native XLA FFI kernels (`embark_jax.ops`).
"""

from embark_jax import _native, ops, optimizers
from embark_jax._native import build_info, registered_targets
from embark_jax.collection import CapacityOverflowError, EmbeddingCollection
from embark_jax.plan import Cluster, Plan, PlanError, TablePlan, Topology
from embark_jax.sparse import SparseFeatures
from embark_jax.specs import Combiner, EmbeddingConfig, FeatureConfig, TableConfig

__version__ = "0.1.0"

__all__ = [
    "CapacityOverflowError",
    "Cluster",
    "Combiner",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "FeatureConfig",
    "Plan",
    "PlanError",
    "SparseFeatures",
    "TableConfig",
    "TablePlan",
    "Topology",
    "__version__",
    "_native",
    "build_info",
    "ops",
    "optimizers",
    "registered_targets",
]
