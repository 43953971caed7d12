"""embark_jax: EMBark-style embedding training for JAX.

The package is layered (see `docs/design.md`, "Package layout"); importing it is cheap: the
names below are loaded on first use (PEP 562), and the native kernels register when the first
kernel is traced. `import embark_jax.planner` plans without loading JAX kernels at all.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # the data model
    "Combiner": "embark_jax.core.specs",
    "TableConfig": "embark_jax.core.specs",
    "FeatureConfig": "embark_jax.core.specs",
    "EmbeddingConfig": "embark_jax.core.specs",
    "Cluster": "embark_jax.core.plan",
    "Plan": "embark_jax.core.plan",
    "PlanError": "embark_jax.core.plan",
    "TablePlan": "embark_jax.core.plan",
    "Topology": "embark_jax.core.plan",
    "RuntimeOptions": "embark_jax.core.options",
    "SparseFeatures": "embark_jax.data.sparse",
    # the sharded runtime
    "EmbeddingCollection": "embark_jax.sharding.collection",
    "CapacityOverflowError": "embark_jax.sharding.collection",
    # training
    "TrainState": "embark_jax.training.state",
    "train_step": "embark_jax.training.step",
    # native build facts
    "build_info": "embark_jax.ops.native",
    "registered_targets": "embark_jax.ops.native",
}
# subpackages reachable as attributes (`ej.optimizers.Adagrad`, `ej.planner.plan`)
_MODULES = {
    "ops": "embark_jax.ops",
    "optimizers": "embark_jax.ops.optimizers",
    "planner": "embark_jax.planner",
    "checkpoint": "embark_jax.training.checkpoint",
}

__all__ = [
    "CapacityOverflowError",
    "Cluster",
    "Combiner",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "FeatureConfig",
    "Plan",
    "PlanError",
    "RuntimeOptions",
    "SparseFeatures",
    "TableConfig",
    "TablePlan",
    "Topology",
    "TrainState",
    "__version__",
    "build_info",
    "checkpoint",
    "ops",
    "optimizers",
    "planner",
    "registered_targets",
    "train_step",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    else:
        raise AttributeError(f"module 'embark_jax' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from embark_jax.core.options import RuntimeOptions
    from embark_jax.core.plan import Cluster, Plan, PlanError, TablePlan, Topology
    from embark_jax.core.specs import Combiner, EmbeddingConfig, FeatureConfig, TableConfig
    from embark_jax.data.sparse import SparseFeatures
    from embark_jax.ops import optimizers
    from embark_jax.ops.native import build_info, registered_targets
    from embark_jax.sharding.collection import CapacityOverflowError, EmbeddingCollection
    from embark_jax.training.state import TrainState
    from embark_jax.training.step import train_step
