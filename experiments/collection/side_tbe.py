"""FBGEMM's TBE, the peer (imported only in a tbe worker; torch + fbgemm-gpu-cpu, the
`bench` extra).

All tables in one `SplitTableBatchedEmbeddingBagsCodegen` (`EmbeddingLocation.HOST`,
`ComputeDevice.CPU`), `EmbOptimType.EXACT_ROWWISE_ADAGRAD` with the same learning rate and
eps, the workload's pooling mode, the bounds check left at TBE's default (`WARNING`: bad ids
are counted and zeroed; ours drops and counts them too). The initial weights are copied in
from the inputs. A step is `out = tbe(indices, offsets)` then `out.backward(grad)`, which
applies the optimizer to the weights in place (TBE's fused backward). Ids are given as
`index_dtype` (int32 by default: the inputs' type; TBE takes int32 or int64) in TBE's layout:
feature-major `indices` with `offsets` of length `T * B + 1`.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from experiments.collection.data import Inputs

COPY_ROWS = 1 << 20


def _fbgemm():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return (
        EmbOptimType,
        EmbeddingLocation,
        PoolingMode,
        ComputeDevice,
        (SplitTableBatchedEmbeddingBagsCodegen),
    )


def available() -> None:
    """Raises ImportError when fbgemm_gpu (or its TBE) cannot be imported."""
    try:
        _fbgemm()
    except ImportError:
        raise
    except Exception as e:  # a broken install (e.g. missing ops library) is unavailable too
        raise ImportError(f"fbgemm_gpu: {type(e).__name__}: {e}") from e


class TBEContender:
    kind = "tbe"

    def __init__(self, inp: Inputs, index_dtype: str = "int32"):
        opt_type, location, pooling, compute, tbe_cls = _fbgemm()
        self.inp = inp
        w = inp.workload
        mode = {"sum": pooling.SUM, "mean": pooling.MEAN}[w.pooling]
        specs = [(t.rows, t.dim, location.HOST, compute.CPU) for t in w.tables]
        self.tbe = tbe_cls(
            specs,
            optimizer=opt_type.EXACT_ROWWISE_ADAGRAD,
            learning_rate=inp.learning_rate,
            eps=inp.eps,
            pooling_mode=mode,
        )
        with torch.no_grad():
            for i, weight in enumerate(self.tbe.split_embedding_weights()):
                src = inp.table(i)
                for lo in range(0, src.shape[0], COPY_ROWS):
                    chunk = np.array(src[lo : lo + COPY_ROWS])  # a writable copy
                    weight[lo : lo + len(chunk)].copy_(torch.from_numpy(chunk))
        dtype = {"int32": torch.int32, "int64": torch.int64}[index_dtype]
        self.index_dtype = index_dtype
        self.batches = [self._tbe_batch(k, dtype) for k in range(inp.batches)]
        self.grad = torch.from_numpy(
            np.concatenate([inp.grad(i) for i in range(len(w.tables))], axis=1)
        )
        self.i = 0

    def _tbe_batch(self, k: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Feature-major indices and offsets of batch k (every bag full: hotness ids)."""
        w = self.inp.workload
        ids = [self.inp.batch_ids(k, i) for i in range(len(w.tables))]
        lengths = np.concatenate([np.full(w.batch, x.shape[1]) for x in ids])
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        indices = np.concatenate([x.reshape(-1) for x in ids])
        return torch.from_numpy(indices).to(dtype), torch.from_numpy(offsets).to(dtype)

    def one(self) -> torch.Tensor:
        indices, offsets = self.batches[self.i % len(self.batches)]
        self.i += 1
        out = self.tbe(indices, offsets)
        out.backward(self.grad)
        return out

    def sync(self) -> None:  # CPU: every call has finished when it returns
        pass

    def check(self, out_dir: str) -> dict:
        w = self.inp.workload
        t0 = time.perf_counter()
        out = self.one().detach().numpy()
        first_step_s = time.perf_counter() - t0
        col = 0
        for i, t in enumerate(w.tables):
            np.save(os.path.join(out_dir, f"out_{i}.npy"), out[:, col : col + t.dim])
            col += t.dim
        for i, weight in enumerate(self.tbe.split_embedding_weights()):
            rows = torch.from_numpy(self.inp.sample_rows(i))
            np.save(os.path.join(out_dir, f"rows_{i}.npy"), weight.detach()[rows].numpy())
        return {"index_dtype": self.index_dtype, "first_step_s": first_step_s}

    def settle(self) -> None:
        """TBE leaves no work running in the background."""
        return None

    def info(self) -> dict:
        import fbgemm_gpu

        return {
            "torch": torch.__version__,
            "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "unknown"),
            "num_threads": torch.get_num_threads(),
        }
