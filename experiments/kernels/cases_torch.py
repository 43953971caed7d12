"""The torch cases (FBGEMM's CPU kernels behind `EmbeddingBag`; CUDA when asked and present).

torch gets the same int32 ids as ours, with int32 bag offsets (`arange(0, B*L, L)`): with
int64 ids (torch's default index type) it is slower. Each peer gets the index type it is
fastest with: `index_add_` keeps int64 segment ids (much slower with int32). The measurements
behind both choices are in docs/benchmarks.md.

- forward: `F.embedding_bag(ids, w, offsets, mode="sum")`; bf16: the same on a bf16 table.
- backward_update: `nn.EmbeddingBag(sparse=True)` (from the same table) with
  `torch.optim.SGD`: the forward runs untimed before each repetition, then `out.backward(g)`,
  `opt.step()`, `opt.zero_grad()` are timed (the counterpart of our fused backward + SGD).
- train_step: forward + backward + step + zero_grad, all timed (as a torch training step).
- unique: `torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)`.
- segment_sum: `zeros(B, D).index_add_(0, seg, values)` (`torch`) and
  `torch.segment_reduce(values, "sum", lengths=...)` (`torch_segment_reduce`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from experiments.kernels import points as P
from experiments.kernels.cases import Box, Case, Data


class TorchCases:
    def __init__(self, data: Data, device: str):
        self.d, self.dev = data, torch.device(device)
        p = data.point
        self.ids = torch.from_numpy(data.ids).to(self.dev)  # int32, as ours get them
        offsets = np.arange(0, p.num_ids, p.hotness, dtype=np.int32)
        self.offsets = torch.from_numpy(offsets).to(self.dev)
        self.table = torch.from_numpy(data.table).to(self.dev)
        self.grads = torch.from_numpy(data.grads).to(self.dev)

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def cases(self, op: str) -> dict[str, Case]:
        build = getattr(self, f"_{op}", None)
        if build is None or op == "backward_two_op":
            return {}
        made = build()
        return made if isinstance(made, dict) else {"torch": made}

    def _rows(self, x, rows) -> np.ndarray:
        return x.detach()[torch.as_tensor(rows, device=x.device)].float().cpu().numpy()

    def _pooled(self, w) -> Case:
        box = Box()

        def run():
            box.value = F.embedding_bag(self.ids, w, self.offsets, mode="sum")
            self.sync()

        return Case(run, lambda: self._rows(box.value, self.d.out_rows).astype(np.float64))

    def _forward(self) -> Case:
        return self._pooled(self.table)

    def _forward_bf16(self) -> Case:
        return self._pooled(self.table.to(torch.bfloat16))

    def _bag(self):
        bag = torch.nn.EmbeddingBag.from_pretrained(
            self.table.clone(), freeze=False, mode="sum", sparse=True
        )
        return bag, torch.optim.SGD(bag.parameters(), lr=P.LEARNING_RATE)

    def _sample_table(self, bag) -> np.ndarray:
        return self._rows(bag.weight, self.d.table_rows).astype(np.float64)

    def _backward_update(self) -> Case:
        bag, opt = self._bag()
        box = Box()

        def prepare():
            box.value = bag(self.ids, self.offsets)
            self.sync()

        def run():
            box.value.backward(self.grads)
            opt.step()
            opt.zero_grad()
            self.sync()

        return Case(run, lambda: self._sample_table(bag), prepare)

    def _train_step(self) -> Case:
        bag, opt = self._bag()

        def run():
            bag(self.ids, self.offsets).backward(self.grads)
            opt.step()
            opt.zero_grad()
            self.sync()

        return Case(run, lambda: self._sample_table(bag))

    def _unique(self) -> Case:
        box = Box()

        def run():
            box.value = torch.unique(self.ids, sorted=True, return_inverse=True, return_counts=True)
            self.sync()

        def sample():
            uniq, inverse, counts = (x.cpu().numpy() for x in box.value)
            return self.d.unique_sample(uniq, inverse, counts)

        return Case(run, sample)

    def _segment_sum(self) -> dict[str, Case]:
        p = self.d.point
        values = torch.from_numpy(self.d.values).to(self.dev)
        # int64 here: index_add_ is much slower with int32 segment ids
        seg = torch.from_numpy(self.d.seg.astype(np.int64)).to(self.dev)
        lengths = torch.full((p.batch,), p.hotness, dtype=torch.int64, device=self.dev)
        out, box = torch.empty((p.batch, p.dim), device=self.dev), Box()

        def index_add():
            out.zero_()
            box.value = out.index_add_(0, seg, values)
            self.sync()

        def reduce():
            box.value = torch.segment_reduce(values, "sum", lengths=lengths)
            self.sync()

        def sample():
            return self._rows(box.value, self.d.out_rows).astype(np.float64)

        return {"torch": Case(index_add, sample), "torch_segment_reduce": Case(reduce, sample)}


def info(device: str) -> dict:
    return {
        "torch": torch.__version__,
        "device": device,
        "num_threads": torch.get_num_threads(),
        "parallel_backend": _parallel_backend(),
        "cuda": torch.cuda.get_device_name(0) if device == "cuda" else None,
    }


def _parallel_backend() -> str:
    for line in torch.__config__.parallel_info().splitlines():
        if "parallel backend" in line:
            return line.split(":", 1)[1].strip()
    return "unknown"
