"""`embark_jax.training.models`: the dense nets (DLRM, DCNv2) and their factory."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embark_jax.training.models import DLRM, DCNv2, DenseConfig, make_model

SMALL = DenseConfig(kind="dcnv2", bottom=(4,), top=(4, 1), cross_layers=1, cross_rank=2)


def _inputs(dims, b=3):
    rng = np.random.default_rng(0)
    dense = jnp.asarray(rng.normal(size=(b, 5)), jnp.float32)
    emb = {k: jnp.asarray(rng.normal(size=(b, d)), jnp.float32) for k, d in dims.items()}
    return dense, emb


@pytest.mark.parametrize("kind, cls", [("dcnv2", DCNv2), ("dlrm", DLRM)])
def test_make_model_gives_one_float32_logit_per_sample(kind, cls):
    dims = {"b": 4, "a": 4}
    model = make_model(dataclasses.replace(SMALL, kind=kind), 5, dims, rngs=nnx.Rngs(0))
    assert isinstance(model, cls) and model.order == ("a", "b")
    dense, emb = _inputs(dims)
    out = model(dense, emb)
    assert out.shape == (3,) and out.dtype == jnp.float32
    seq = {**emb, "a": jnp.stack([emb["a"], jnp.zeros_like(emb["a"])], axis=1)}  # [B, 2, d]
    np.testing.assert_allclose(model(dense, seq), out, rtol=1e-6)  # a sequence is summed


def test_bf16_activations_keep_float32_parameters_and_output():
    cfg = dataclasses.replace(SMALL, dtype="bfloat16")
    model = make_model(cfg, 5, {"a": 3}, rngs=nnx.Rngs(0))
    assert model.bottom.layers[0].kernel[...].dtype == jnp.float32
    assert model(*_inputs({"a": 3})).dtype == jnp.float32


def test_dlrm_needs_embeddings_of_the_bottom_width_and_kinds_are_checked():
    with pytest.raises(ValueError, match=r"every embedding of dim 4 .* got dims \[3, 4\]"):
        make_model(dataclasses.replace(SMALL, kind="dlrm"), 5, {"a": 3, "b": 4}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown model kind 'mlp'; expected dcnv2 or dlrm"):
        make_model(dataclasses.replace(SMALL, kind="mlp"), 5, {"a": 4}, rngs=nnx.Rngs(0))
