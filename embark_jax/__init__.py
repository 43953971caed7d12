"""embark_jax: EMBark-style embedding training for JAX.

The package is layered (see `docs/design.md`, "Package layout"); importing it is cheap: the
names below are loaded on first use (PEP 562), and the native kernels register when the first
kernel is traced. `import embark_jax.planner` plans without loading JAX kernels at all.
Each subpackage exports its own public names the same way (`embark_jax.training.StepRunner`).
"""

from __future__ import annotations

from embark_jax.core.exports import lazy_exports

__version__ = "0.1.0"

_all, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        # the data model
        "Combiner": "core.specs",
        "TableConfig": "core.specs",
        "FeatureConfig": "core.specs",
        "EmbeddingConfig": "core.specs",
        "Cluster": "core.plan",
        "Plan": "core.plan",
        "PlanError": "core.plan",
        "TablePlan": "core.plan",
        "Topology": "core.plan",
        "RuntimeOptions": "core.options",
        "SparseFeatures": "data.sparse",
        # the sharded runtime
        "EmbeddingCollection": "sharding.collection",
        "CapacityOverflowError": "sharding.checks",
        # training
        "TrainState": "training.state",
        "train_step": "training.step",
        # native build facts
        "build_info": "ops.native",
        "registered_targets": "ops.native",
        # subpackages and modules reachable as attributes (`ej.optimizers.Adagrad`)
        "ops": "embark_jax.ops",
        "optimizers": "embark_jax.ops.optimizers",
        "planner": "embark_jax.planner",
        "training": "embark_jax.training",
        "checkpoint": "embark_jax.training.checkpoint",
    },
)
__all__ = [*_all, "__version__"]
