"""Input data: the sparse batch (`SparseFeatures`), the training batch (`Batch`) and the
datasets that produce batches (synthetic Zipf data, Criteo TSV and multi-hot readers)."""

from embark_jax.core.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Batch": "batch",
        "CriteoMultiHot": "criteo",
        "CriteoTSV": "criteo",
        "DataError": "batch",
        "Prefetcher": "prefetch",
        "SparseFeatures": "sparse",
        "SyntheticDataset": "synthetic",
    },
)
