"""The benchmark's points, the ops it times, their deterministic data and byte accounting.

Every worker process (one per library) builds its data from here, so the same point and seed
give bit-identical ids, tables and gradients in each process. Nothing here imports torch, and
nothing starts JAX (the Zipf sampler's module imports jax, which starts no thread pool).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from embark_jax.data.synthetic import zipf_ranks

LEARNING_RATE = 0.01
SEED = 0


@dataclasses.dataclass(frozen=True)
class Point:
    batch: int  # bags B
    hotness: int  # ids per bag L
    dim: int  # row width D
    vocab: int  # table rows V
    dist: str  # "uniform" or "zipf" (Zipf(1.1), hot ids hashed over the table)
    dtype: str = "float32"  # the table's (loop mode; the per-call mode has bf16 ops instead)

    @property
    def name(self) -> str:
        tail = "" if self.dtype == "float32" else f"_{DTYPE_TAG[self.dtype]}"
        return f"B{self.batch}_L{self.hotness}_D{self.dim}_V{self.vocab}_{self.dist}{tail}"

    @property
    def label(self) -> str:
        """The row label of the ratio table: `4096 × 32 × 128, 1M zipf`."""
        v = self.vocab
        vs = (
            f"{v // 1_000_000}M"
            if v % 1_000_000 == 0
            else f"{v // 1000}k"
            if v % 1000 == 0
            else str(v)
        )
        tail = "" if self.dtype == "float32" else f" {DTYPE_TAG[self.dtype]}"
        return f"{self.batch} × {self.hotness} × {self.dim}, {vs} {self.dist}{tail}"

    @property
    def num_ids(self) -> int:
        return self.batch * self.hotness

    @property
    def elem_bytes(self) -> int:
        """Bytes of one table element."""
        return 2 if self.dtype == "bfloat16" else 4

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Point:
        """Reads `to_json`'s dict; records written before `dtype` existed are float32."""
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def capped(self, batch: int | None = None, vocab: int | None = None) -> Point:
        """The same shape with at most `batch` bags and `vocab` rows (a CPU run of the
        production points)."""
        b = min(self.batch, batch) if batch else self.batch
        v = min(self.vocab, vocab) if vocab else self.vocab
        return dataclasses.replace(self, batch=b, vocab=v)


DTYPE_TAG = {"float32": "f32", "bfloat16": "bf16"}


# The four forward shapes of the per-call benchmark, then the large backward shape.
DEFAULT_POINTS = [
    Point(4096, 32, 128, 1_000_000, "uniform"),
    Point(4096, 32, 128, 1_000_000, "zipf"),
    Point(8192, 1, 128, 1_000_000, "uniform"),  # one-hot
    Point(1024, 8, 64, 100_000, "uniform"),
    Point(8192, 32, 128, 2_000_000, "zipf"),
]
QUICK_POINTS = [Point(256, 4, 16, 5000, "zipf")]
# --floor: a bag of one id on the small shape's table, then the small shape. A library's time
# on the first is its fixed price per call (dispatch, output allocation, kernel setup) with
# almost no rows; the second minus the first is what that shape's 8192 rows cost it.
FLOOR_POINTS = [Point(1, 1, 64, 100_000, "uniform"), Point(1024, 8, 64, 100_000, "uniform")]
FLOOR_OPS = ("forward", "forward_bf16")

# The ops in the order they run and print. `forward` (fp32 sum pooling) is the headline.
OPS = (
    "forward",  # lookup + sum pooling, fp32 table and output
    "forward_bf16",  # the same with a bf16 table and output
    "backward_update",  # sparse backward + SGD on the (donated) table; forward not timed
    "backward_two_op",  # ours only: lookup_pool_backward + sparse_update
    "train_step",  # forward + backward + SGD, as one training step does it
    "unique",  # dedup of the B*L ids with inverse and counts
    "segment_sum",  # [B*L, D] fp32 values summed into B sorted segments
)
# Loop mode (`loop.py`): the production shapes. Batch 65,536 (the paper's per-step
# batches are 55,296-135,168), dim 128, hotness 1 (one-hot), 20 (DCNv2) and 80 (T180), tables
# of 40M rows (DCNv2's largest; 20 GB in float32) and 10M, float32 and bfloat16, uniform and
# Zipf ids. On a CPU the runner caps batch and rows (`Point.capped`).
PROD_BATCH, PROD_DIM, PROD_ROWS = 65_536, 128, 40_000_000
LOOP_OPS = (
    "forward",  # lookup + sum pooling, output in the table's dtype
    "backward_rowwise_adagrad",  # fused backward + row-wise Adagrad, table and slot in place
    "unique",  # dedup of the B*L ids with inverse and counts
    "segment_sum",  # [B*L, D] float32 values summed into B sorted segments
)
HEADLINE_OPS = LOOP_OPS[:2]
DEDUP_OPS = LOOP_OPS[2:]  # they read no table: measured on the float32 points only


def production(hotness: int, dist: str, dtype: str = "float32", vocab: int = PROD_ROWS) -> Point:
    return Point(PROD_BATCH, hotness, PROD_DIM, vocab, dist, dtype)


_DISTS, _HOT = ("uniform", "zipf"), (20, 80)
# The GPU check's work, most valuable first, since a run stopped by its time budget keeps
# what it measured: (1) the points with a target bar, float32 forward and backward at
# hotness 20 and 80, then one-hot; (2) the same on bfloat16 tables; (3) unique and segment_sum.
LOOP_QUICK: list[tuple[Point, tuple[str, ...]]] = [
    *[(production(h, d), HEADLINE_OPS) for d in _DISTS for h in _HOT],
    *[(production(1, d), HEADLINE_OPS) for d in _DISTS],
    *[(production(h, d, "bfloat16"), HEADLINE_OPS) for d in _DISTS for h in _HOT],
    *[(production(h, d), DEDUP_OPS) for d in _DISTS for h in _HOT],
]
# The full loop run adds one-hot bfloat16 and the 10M-row tables.
LOOP_FULL = [
    *LOOP_QUICK,
    *[(production(1, d, "bfloat16"), HEADLINE_OPS) for d in _DISTS],
    *[
        (production(h, d, dt, 10_000_000), HEADLINE_OPS)
        for dt in ("float32", "bfloat16")
        for d in _DISTS
        for h in (1, *_HOT)
    ],
]
# `--loop --quick`: every op and both dtypes at a tiny size (the CI smoke test).
LOOP_SMOKE = [
    (Point(64, 20, PROD_DIM, 4096, "uniform"), LOOP_OPS),
    (Point(64, 1, PROD_DIM, 4096, "zipf", "bfloat16"), HEADLINE_OPS),
]

# The op whose peers an op is compared with (ours only has a two-op backward). When both run,
# the op is timed in its peer op's session, its repetitions interleaved with theirs (alone,
# its repetitions would run back to back on warm caches, unlike everyone else's).
PEER_OP = {"backward_two_op": "backward_update"}


def make_ids(p: Point, seed: int = SEED) -> np.ndarray:
    """`[B, L]` int32 ids; Zipf ranks are hashed so that hot ids are spread over the table."""
    rng = np.random.default_rng(seed)
    if p.dist == "zipf":
        ranks = zipf_ranks(rng, 1.1, p.vocab, (p.batch, p.hotness))
        return ((ranks * 2654435761) % p.vocab).astype(np.int32)
    return rng.integers(0, p.vocab, size=(p.batch, p.hotness)).astype(np.int32)


def make_table(p: Point, seed: int = SEED) -> np.ndarray:
    """`[V, D]` float32 in [-0.5, 0.5) (uniform draws: fast for a 2M-row table)."""
    rng = np.random.default_rng(seed + 1)
    t = rng.random((p.vocab, p.dim), dtype=np.float32)
    t -= 0.5
    return t


def make_output_grads(p: Point, seed: int = SEED) -> np.ndarray:
    """`[B, D]` float32: the gradient of the pooled output fed to every backward."""
    return np.random.default_rng(seed + 2).standard_normal((p.batch, p.dim), dtype=np.float32)


def make_values(p: Point, seed: int = SEED) -> np.ndarray:
    """`[B*L, D]` float32 values for `segment_sum`."""
    return np.random.default_rng(seed + 3).standard_normal((p.num_ids, p.dim), dtype=np.float32)


def segment_ids(p: Point) -> np.ndarray:
    """`[B*L]` int32 bag of each id, ascending (the `SparseFeatures.flat` layout)."""
    return np.repeat(np.arange(p.batch, dtype=np.int32), p.hotness)


def sample_rows(n: int, k: int = 32) -> np.ndarray:
    """`k` row indices spread over `[0, n)`: the rows each library's output is compared on."""
    return np.unique(np.linspace(0, n - 1, min(k, n)).astype(np.int64))


def two_op_capacity(unique_rows: int, multiple: int = 256) -> int:
    """The two-op backward's (and `unique`'s) capacity: the distinct rows rounded up, as
    planned capacities are (sized from observed batches), rather than B*L mostly-empty rows."""
    return max(multiple, -(-unique_rows // multiple) * multiple)


def op_bytes(op: str, p: Point, unique_rows: int) -> int:
    """Bytes an op moves, by FBGEMM's accounting (the same for every library).

    forward: reads B*L rows of D elements, writes B*D (element size 4, or 2 for bf16).
    backward: reads B*D output grads, reads/writes B*L*D of per-id gradient, and reads and
      writes each touched row once (2*U*D); train_step: forward + backward;
      backward_rowwise_adagrad: backward + each touched row's accumulator read and written.
    A point's `dtype` (loop mode) sets the element size of the rows read and written (2 for
    bfloat16); gradients stay float32.
    unique: reads B*L ids, writes B*L inverse slots and U unique ids and counts (4 bytes each).
    segment_sum: reads B*L*D values, writes B*D.
    """
    n, b, d, e = p.num_ids, p.batch, p.dim, p.elem_bytes
    fwd = (n * d + b * d) * e
    bwd = (b * d + n * d) * 4 + 2 * unique_rows * d * e
    return {
        "forward": fwd,
        "backward_rowwise_adagrad": bwd + 2 * unique_rows * 4,  # + the row's accumulator
        "forward_bf16": fwd // 2,
        "backward_update": bwd,
        "backward_two_op": bwd,
        "train_step": fwd + bwd,
        "unique": (2 * n + 2 * unique_rows) * 4,
        "segment_sum": (n * d + b * d) * 4,
    }[op]
