"""Dense recommendation models in Flax NNX that consume the embedding collection's outputs.

Both take `dense` `[B, num_dense]` and `embeddings` (feature name -> `[B, d]`, or
`[B, H, d]` for sequence features, which are summed over H here) and return logits `[B]`.

- `DLRM`: bottom MLP on the dense features, pairwise dot interaction of the bottom output and
  every embedding (all of dim = bottom output), top MLP.
- `DCNv2`: bottom MLP, concatenation with every embedding, low-rank cross layers
  `x_{l+1} = x0 * (U_l V_l x_l + b_l) + x_l`, top MLP. The paper's default:
  bottom 512-256-128, 3 cross layers of rank 512, top 1024-1024-512-256-1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["DLRM", "MLP", "DCNv2", "DenseConfig", "make_model"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseConfig:
    """Sizes of the dense net. `dtype` is the activation dtype (bf16 for mixed precision;
    parameters stay float32)."""

    kind: str = "dcnv2"  # "dcnv2" or "dlrm"
    bottom: tuple[int, ...] = (512, 256, 128)
    top: tuple[int, ...] = (1024, 1024, 512, 256, 1)
    cross_layers: int = 3
    cross_rank: int = 512
    dtype: str = "float32"

    @classmethod
    def mini(cls, kind: str = "dcnv2") -> DenseConfig:
        """A small net for CPU runs of the -mini presets."""
        return cls(kind=kind, bottom=(64, 32), top=(128, 64, 1), cross_layers=2, cross_rank=64)


class MLP(nnx.Module):
    def __init__(
        self,
        sizes: Sequence[int],
        in_features: int,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        final_activation: bool = True,
    ):
        layers, prev = [], in_features
        for s in sizes:
            layers.append(nnx.Linear(prev, s, dtype=dtype, param_dtype=jnp.float32, rngs=rngs))
            prev = s
        self.layers = nnx.List(layers)
        self.final_activation = final_activation

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers) or self.final_activation:
                x = jax.nn.relu(x)
        return x


def _embedding_list(embeddings: Mapping[str, jax.Array], order: Sequence[str], dtype):
    out = []
    for name in order:
        e = embeddings[name]
        if e.ndim == 3:  # sequence feature: sum over its ids
            e = e.sum(axis=1)
        out.append(e.astype(dtype))
    return out


class DLRM(nnx.Module):
    def __init__(
        self, num_dense: int, embedding_dims: Mapping[str, int], cfg: DenseConfig, *, rngs: nnx.Rngs
    ):
        dims = set(embedding_dims.values())
        d = cfg.bottom[-1]
        if dims != {d}:
            raise ValueError(
                f"DLRM's dot interaction needs every embedding of dim {d} (the "
                f"bottom MLP's output); got dims {sorted(dims)}. Use DCNv2."
            )
        self.order = tuple(sorted(embedding_dims))
        self.dtype = jnp.dtype(cfg.dtype)
        self.bottom = MLP(cfg.bottom, num_dense, rngs=rngs, dtype=self.dtype)
        n = len(self.order) + 1
        self.top = MLP(
            cfg.top, d + n * (n - 1) // 2, rngs=rngs, dtype=self.dtype, final_activation=False
        )

    def __call__(self, dense, embeddings):
        x = self.bottom(dense.astype(self.dtype))
        feats = jnp.stack([x, *_embedding_list(embeddings, self.order, self.dtype)], axis=1)
        z = jnp.einsum("bnd,bmd->bnm", feats, feats)
        iu, ju = jnp.triu_indices(feats.shape[1], k=1)
        inter = z[:, iu, ju]
        return self.top(jnp.concatenate([x, inter], axis=1))[:, 0].astype(jnp.float32)


class DCNv2(nnx.Module):
    def __init__(
        self, num_dense: int, embedding_dims: Mapping[str, int], cfg: DenseConfig, *, rngs: nnx.Rngs
    ):
        self.order = tuple(sorted(embedding_dims))
        self.dtype = jnp.dtype(cfg.dtype)
        self.bottom = MLP(cfg.bottom, num_dense, rngs=rngs, dtype=self.dtype)
        width = cfg.bottom[-1] + sum(embedding_dims.values())
        self.v = nnx.List(
            [
                nnx.Linear(width, cfg.cross_rank, use_bias=False, dtype=self.dtype, rngs=rngs)
                for _ in range(cfg.cross_layers)
            ]
        )
        self.u = nnx.List(
            [
                nnx.Linear(cfg.cross_rank, width, dtype=self.dtype, rngs=rngs)
                for _ in range(cfg.cross_layers)
            ]
        )
        self.top = MLP(cfg.top, width, rngs=rngs, dtype=self.dtype, final_activation=False)

    def __call__(self, dense, embeddings):
        x = self.bottom(dense.astype(self.dtype))
        x0 = jnp.concatenate([x, *_embedding_list(embeddings, self.order, self.dtype)], axis=1)
        xl = x0
        for v, u in zip(self.v, self.u, strict=True):
            xl = x0 * u(v(xl)) + xl
        return self.top(xl)[:, 0].astype(jnp.float32)


def make_model(
    cfg: DenseConfig, num_dense: int, embedding_dims: Mapping[str, int], *, rngs: nnx.Rngs
) -> nnx.Module:
    cls = {"dcnv2": DCNv2, "dlrm": DLRM}.get(cfg.kind)
    if cls is None:
        raise ValueError(f"unknown model kind {cfg.kind!r}; expected dcnv2 or dlrm")
    return cls(num_dense, embedding_dims, cfg, rngs=rngs)
