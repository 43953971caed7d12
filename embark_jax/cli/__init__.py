"""The command line (`python -m embark_jax ...`); the top layer, nothing imports it."""
