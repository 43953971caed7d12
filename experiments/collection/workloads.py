"""The workloads of the whole-embedding-step benchmark, as plain data.

A workload is tables, one feature per table (fixed hotness: every bag full), one pooling
mode for every feature (one TBE has one), a batch size and the contenders that run it by
default. Nothing here imports JAX or torch: the driver and both libraries' workers read it.

- `dcnv2-mini`: the `dcnv2-mini` preset's 26 tables (`embark_jax.planner.load_preset`:
  vocabularies capped at 20,000, dim 128), each feature's hotness the preset's mean
  hotness rounded up (`ModelSpec.embedding_config`), sum pooling, batch 4096.
- `tables-100`: 100 tables from a fixed generator (`numpy.random.default_rng(100)`): rows
  log-uniform in [1e4, 1e6], dim 32 or 64, hotness 1..10, sum pooling, batch 8192 (4.2 GiB
  of float32 tables).
- `one-4m`: one 4,000,000 x 128 table (1.9 GiB), hotness 32, sum pooling, batch 4096.

`QUICK` holds one tiny workload per shape for the smoke test (one with mean pooling).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# what each contender is (docs for the JSON and the README table)
CONTENDERS = {
    "embark": "lookup_fn + apply_gradients_fn in one jax.jit, state donated; the planner's "
    "plan for one device; tables on huge pages (the default)",
    "embark_tuned": "the embark step with the kernels' opt-in process tuning "
    "(EMBARK_CPU_TUNING=on: glibc malloc thresholds, spinning workers, huge pages)",
    "embark_rb": "the same step, every table RB on device 0",
    "embark_collection": "EmbeddingCollection.lookup + apply_gradients (the planner's plan)",
    "tbe": "FBGEMM SplitTableBatchedEmbeddingBagsCodegen, all tables in one TBE, CPU, "
    "EXACT_ROWWISE_ADAGRAD, forward + backward(output grads)",
}
PEER = "tbe"


@dataclasses.dataclass(frozen=True)
class Table:
    name: str
    rows: int
    dim: int
    hotness: int  # ids per sample of its one feature (every bag full)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    tables: tuple[Table, ...]
    batch: int
    pooling: str = "sum"  # "sum" or "mean", every feature (one TBE has one pooling mode)
    contenders: tuple[str, ...] = ("embark", "tbe")
    note: str = ""

    def feature(self, table: Table) -> str:
        return f"f_{table.name}"

    @property
    def table_bytes(self) -> int:
        return sum(t.rows * t.dim * 4 for t in self.tables)

    @property
    def ids_per_batch(self) -> int:
        return self.batch * sum(t.hotness for t in self.tables)

    @property
    def output_dim(self) -> int:
        return sum(t.dim for t in self.tables)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Workload:
        d = dict(d)
        d["tables"] = tuple(Table(**t) for t in d["tables"])
        d["contenders"] = tuple(d["contenders"])
        return cls(**d)

    def summary(self) -> str:
        return (
            f"{self.name}: {len(self.tables)} tables, {self.table_bytes / 2**30:.2f} GiB, "
            f"batch {self.batch}, {self.ids_per_batch:,} ids/batch, {self.pooling} pooling"
        )


def dcnv2_mini(batch: int = 4096, num_tables: int | None = None, max_rows: int | None = None):
    """The preset's tables and hotness (`ModelSpec.embedding_config`: max hotness = the
    mean hotness rounded up); `num_tables`/`max_rows` shrink it for the quick setting."""
    from embark_jax.planner import load_preset

    config = load_preset("dcnv2-mini").embedding_config()
    hot = {f.table: f.max_hotness for f in config.features}
    tables = tuple(
        Table(t.name, min(t.vocab_size, max_rows or t.vocab_size), t.dim, hot[t.name])
        for t in config.tables[:num_tables]
    )
    return tables, batch


def generated(num: int, rows: tuple[float, float], dims, hotness: tuple[int, int], seed: int):
    """`num` tables: rows log-uniform in `rows`, dim drawn from `dims`, hotness uniform in
    `hotness` (inclusive), from `numpy.random.default_rng(seed)`."""
    rng = np.random.default_rng(seed)
    lo, hi = math.log10(rows[0]), math.log10(rows[1])
    n_rows = np.round(10 ** rng.uniform(lo, hi, num)).astype(int)
    n_dims = rng.choice(np.asarray(dims), num)
    n_hot = rng.integers(hotness[0], hotness[1] + 1, num)
    return tuple(
        Table(f"t{i}", int(r), int(d), int(h))
        for i, (r, d, h) in enumerate(zip(n_rows, n_dims, n_hot, strict=True))
    )


def full() -> list[Workload]:
    tables, batch = dcnv2_mini()
    return [
        Workload(
            "dcnv2-mini",
            tables,
            batch,
            contenders=("embark", "embark_tuned", "embark_rb", "embark_collection", "tbe"),
            note="the dcnv2-mini preset's 26 tables",
        ),
        Workload(
            "tables-100",
            generated(100, (1e4, 1e6), (32, 64), (1, 10), seed=100),
            8192,
            contenders=("embark", "embark_tuned", "tbe"),
            note="100 tables of 1e4..1e6 rows, dims 32/64, hotness 1..10",
        ),
        Workload(
            "one-4m",
            (Table("big", 4_000_000, 128, 32),),
            4096,
            contenders=("embark", "embark_tuned", "embark_rb", "tbe"),
            note="one 4M x 128 table, hotness 32",
        ),
    ]


def quick() -> list[Workload]:
    tables, batch = dcnv2_mini(batch=64, num_tables=6, max_rows=1000)
    return [
        Workload(
            "dcnv2-mini-quick",
            tables,
            batch,
            contenders=("embark", "embark_tuned", "embark_rb", "embark_collection", "tbe"),
        ),
        Workload(
            "tables-quick",
            generated(6, (100, 2000), (8, 16), (1, 4), seed=100),
            128,
            pooling="mean",
        ),
        Workload("one-table-quick", (Table("big", 5000, 32, 8),), 64),
    ]
