"""Input data: the sparse batch (`SparseFeatures`) and datasets that produce batches."""
