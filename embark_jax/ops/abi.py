"""The kernel ABI, mirrored from `xla_ffi/include/embark_abi.h`.

The header is the source of truth: it defines the combiner and optimizer ids, the layout of
the optimizers' hyper-parameter vector and the FFI target names, and generates the native
handlers' registrations from them. This module repeats those values for Python, because
Python must name them without loading the native extension; `tests/ops/test_abi.py` parses the
header and fails if a name or a value here differs. Change both together (BUILD.md, "The
kernel ABI").

Plain Python (no JAX, no native code), so reading it costs nothing beyond
`import embark_jax.ops`.
"""

from __future__ import annotations

import enum

__all__ = [
    "HASH_ROUND_KEYS",
    "HPARAM_COUNT",
    "SLOT_FOOTPRINT",
    "TARGETS",
    "CombinerId",
    "EvictionId",
    "HashCount",
    "Hparam",
    "OptimizerId",
    "Target",
]


class CombinerId(enum.IntEnum):
    """The `combiner` attribute of `embark_lookup_pool` (`EMBARK_ABI_COMBINERS`)."""

    SUM = 0
    MEAN = 1
    SQRTN = 2
    NONE = 3


class OptimizerId(enum.IntEnum):
    """The `optimizer` attribute of the update kernels (`EMBARK_ABI_OPTIMIZERS`)."""

    SGD = 0
    ADAGRAD = 1
    ROW_WISE_ADAGRAD = 2
    ADAM = 3


# (float32 slots per table element, float32 slots per row) of each optimizer: the kernels
# size and lay out their two slot operands from it (`EMBARK_ABI_OPTIMIZERS`).
SLOT_FOOTPRINT: dict[OptimizerId, tuple[int, int]] = {
    OptimizerId.SGD: (0, 0),
    OptimizerId.ADAGRAD: (1, 0),
    OptimizerId.ROW_WISE_ADAGRAD: (0, 1),
    OptimizerId.ADAM: (2, 0),
}


class Hparam(enum.IntEnum):
    """Index of each entry of the optimizers' float32 `hparams` operand
    (`EMBARK_ABI_HPARAMS`); Adam's bias corrections are folded into LR and EPS.

    ROUNDING: how a bfloat16 table's updated elements are stored, 0 to nearest even, 1
    stochastically (bits hashed from the seed, row and column; `reference.stochastic_round_bf16`
    is the same function); float32 tables ignore it. SEED_LO / SEED_HI: the low and high 16
    bits of the uint32 rounding seed, each an integer stored exactly as a float32.
    """

    LR = 0
    EPS = 1
    B1 = 2
    B2 = 3
    ROUNDING = 4
    SEED_LO = 5
    SEED_HI = 6


HPARAM_COUNT = len(Hparam)


class EvictionId(enum.IntEnum):
    """The `eviction` attribute of `embark_hash_find_or_insert` (`EMBARK_ABI_EVICTIONS`);
    the names are `core.dynamic.Eviction`'s."""

    NONE = 0
    LRU = 1
    LFU = 2


class HashCount(enum.IntEnum):
    """Index of each per-call count in `embark_hash_find_or_insert`'s int32 `counts` output
    (`EMBARK_ABI_HASH_COUNTS`). Every non-padding id is one of FOUND, INSERTED, REFUSED (by
    admission) or DROPPED (no free slot and nothing it could replace); EVICTED and EXPIRED
    count the inserts that replaced a live entry or took an expired one's slot."""

    FOUND = 0
    INSERTED = 1
    EVICTED = 2
    EXPIRED = 3
    REFUSED = 4
    DROPPED = 5


# Round keys of the dynamic tables' id hash (`EMBARK_ABI_HASH_ROUND_KEYS`, `abi::HashKey`).
HASH_ROUND_KEYS: tuple[int, ...] = (0x9E3779B9, 0x7F4A7C15, 0xF39CC060, 0x5CED1B1B)


class Target(enum.StrEnum):
    """The FFI targets, registered under these names on every platform
    (`EMBARK_ABI_TARGETS`: entry `name` is target `embark_<name>`)."""

    SEGMENT_SUM = "embark_segment_sum"
    LOOKUP_POOL = "embark_lookup_pool"
    UNIQUE = "embark_unique"
    SPARSE_GRAD = "embark_sparse_grad"
    SPARSE_UPDATE = "embark_sparse_update"
    SPARSE_GRAD_UPDATE = "embark_sparse_grad_update"
    SPARSE_GRAD_STAGE = "embark_sparse_grad_stage"
    COMMIT_ROWS = "embark_commit_rows"
    HASH_FIND = "embark_hash_find"
    HASH_FIND_OR_INSERT = "embark_hash_find_or_insert"


TARGETS: tuple[str, ...] = tuple(t.value for t in Target)
