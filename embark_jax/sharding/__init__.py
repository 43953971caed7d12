"""The sharded runtime: lowering a plan to stacked buffers, routing, the DP/RB/UB clusters,
the functional core (`lookup_fn`, `apply_gradients_fn`) and `EmbeddingCollection`, capacity
sizing, on-device id checks, and what a compiled step sends (`hlo_bytes`, `hlo_scan`)."""

from embark_jax.core.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "CapacityOverflowError": "checks",
        "EmbeddingCollection": "collection",
        "InvalidIdError": "checks",
        "LookupResult": "collection",
        "Lowered": "lowering",
        "NonFiniteUpdateError": "checks",
        "apply_gradients_fn": "collection",
        "derive_capacities": "capacity",
        "init_staging": "collection",
        "lookup_fn": "collection",
        "lower": "lowering",
    },
)
