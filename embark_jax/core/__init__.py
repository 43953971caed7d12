"""The data model: table and feature specs, the sharding plan, the shard layout rule and the
run-time options. Plain Python and numpy; importing it never loads JAX."""
