"""The sharded runtime: lowering a plan to stacked buffers, routing, the DP/RB/UB clusters
and `EmbeddingCollection`, plus capacity sizing and collective-byte accounting."""
