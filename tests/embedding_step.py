"""One embedding step of a collection, compiled, for tests that read the compiled program
(its collective bytes, its memory): lookup, output gradients that are a traced multiple of
the outputs (so XLA cannot fold the backward's collectives away), backward and update."""

import jax
import jax.numpy as jnp
from flax import nnx

from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.sharding.collection import EmbeddingCollection, apply_gradients_fn, lookup_fn


def compile_embedding_step(config, plan_, options, optimizer, batch_size, *, donate=False):
    """`jax.stages.Compiled` of one step on a synthetic batch; with `donate` the tables and
    slots are donated (updated in place, as training runs)."""
    coll = EmbeddingCollection(
        config, plan_, plan_.make_mesh(), rngs=nnx.Rngs(0), optimizer=optimizer, options=options
    )
    lw, mesh, opts = coll.lowered, coll.mesh, coll.optimizers

    def step(bufs, states, batch, scale):
        out, res, overflow = lookup_fn(lw, mesh, options, bufs, batch)
        grads = jax.tree.map(lambda y: y * scale, out)
        return apply_gradients_fn(
            lw, mesh, options, bufs, states, res, grads, opts, batch
        ), overflow

    data = SyntheticDataset(config, batch_size=batch_size, seed=0).batch(0).sparse
    args = (coll.buffer_values(), coll.state_values(), coll.shard_batch(data), jnp.float32(1.0))
    jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    return jitted.lower(*args).compile()
