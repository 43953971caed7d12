"""The data model: table and feature specs, the sharding plan, the shard layout rule and the
run-time options. Plain Python and numpy; importing it never loads JAX."""

from embark_jax.core.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Cluster": "plan",
        "Combiner": "specs",
        "CommDtype": "options",
        "DPGradients": "options",
        "DynamicTableConfig": "dynamic",
        "EmbeddingConfig": "specs",
        "FeatureConfig": "specs",
        "OverflowPolicy": "options",
        "Plan": "plan",
        "PlanError": "plan",
        "RuntimeOptions": "options",
        "ShardLayout": "layout",
        "TableConfig": "specs",
        "TablePlan": "plan",
        "Topology": "plan",
    },
)
