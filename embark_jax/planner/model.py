"""What the planner plans for: tables with their average hotness, the optimizer's slot
footprint, and the paper's models.

The optimizer enters only as numbers (`ModelSpec.slot_footprint`), so that planning never
loads the kernels' optimizer classes (nor JAX): callers pass `opt.slot_footprint`.
`ModelSpec` presets come from `data/paper_models.json` (the paper's DLRM-DCNv2, T180, T200,
T510 and T7). The `-mini` variants keep every table's hotness and dim and scale the
vocabularies down so that they train on a CPU machine.

One vocabulary of model names everywhere (`canonical_preset`): the canonical names of
`preset_names()` and the aliases of `preset_aliases()` (`dlrm_dcnv2`, `dlrm-dcnv2` for
`dcnv2`), in any case, with `_` and `-` equivalent, each with a `-mini` variant.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from embark_jax.core.specs import (
    Combiner,
    EmbeddingConfig,
    FeatureConfig,
    TableConfig,
    as_dtype,
)

__all__ = [
    "SLOT_FOOTPRINTS",
    "ModelSpec",
    "PlannerTable",
    "canonical_preset",
    "load_preset",
    "preset_aliases",
    "preset_names",
]

_DATA = os.path.join(os.path.dirname(__file__), "data", "paper_models.json")
MINI_MAX_VOCAB = 20_000

# float32 optimizer slots (per table element, per row) of the sparse optimizers, as their
# `slot_footprint` reports them
SLOT_FOOTPRINTS = {"sgd": (0, 0), "adagrad": (1, 0), "rowwise_adagrad": (0, 1), "adam": (2, 0)}
ADAGRAD = SLOT_FOOTPRINTS["adagrad"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannerTable:
    """One table as the cost model sees it. `hotness`: ids per sample (summed over the
    features that look it up); `unique_ratio`: distinct ids / ids in a device's batch
    (measured, or None to estimate from the Zipf law)."""

    name: str
    vocab_size: int
    dim: int
    hotness: float
    combiner: Combiner = Combiner.SUM
    dtype_bytes: int = 4
    unique_ratio: float | None = None
    alpha: float = 1.1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The tables, the sparse optimizer's `slot_footprint` = (float32 slots per table
    element, float32 slots per row): SGD (0, 0), Adagrad (1, 0), row-wise Adagrad (0, 1),
    Adam (2, 0); and the dense net's forward FLOPs per sample and parameter count."""

    name: str
    tables: tuple[PlannerTable, ...]
    slot_footprint: tuple[int, int] = ADAGRAD
    dense_flops_per_sample: float = 0.0
    dense_params: int = 0
    default_batch: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        fp = self.slot_footprint
        if not (
            isinstance(fp, tuple)
            and len(fp) == 2
            and all(isinstance(x, int) and x >= 0 for x in fp)
        ):
            raise TypeError(
                f"slot_footprint must be (slots per element, slots per row), two ints >= 0, "
                f"e.g. an optimizer's `.slot_footprint`; got {fp!r}"
            )

    def table(self, name: str) -> PlannerTable:
        return next(t for t in self.tables if t.name == name)

    def embedding_config(self) -> EmbeddingConfig:
        """One feature per table, max_hotness = the table's hotness (rounded up)."""
        tables = [TableConfig(name=t.name, vocab_size=t.vocab_size, dim=t.dim) for t in self.tables]
        feats = [
            FeatureConfig(
                name=f"f_{t.name}",
                table=t.name,
                max_hotness=max(1, math.ceil(t.hotness)),
                combiner=t.combiner,
            )
            for t in self.tables
        ]
        return EmbeddingConfig.create(tables, feats)

    @classmethod
    def from_config(
        cls,
        config: EmbeddingConfig,
        slot_footprint: tuple[int, int] = ADAGRAD,
        name: str = "custom",
    ) -> ModelSpec:
        tables = []
        for t in config.tables:
            feats = [f for f in config.features if f.table == t.name]
            combiner = (
                Combiner.NONE
                if any(f.combiner is Combiner.NONE for f in feats)
                else feats[0].combiner
            )
            tables.append(
                PlannerTable(
                    name=t.name,
                    vocab_size=t.vocab_size,
                    dim=t.dim,
                    hotness=float(sum(f.max_hotness for f in feats)),
                    combiner=combiner,
                    dtype_bytes=as_dtype(t.dtype).itemsize,
                )
            )
        return cls(name=name, tables=tuple(tables), slot_footprint=slot_footprint)


def _dense_cost(common: dict, num_tables: int, dim: int = 128) -> tuple[float, int]:
    """FLOPs per sample (forward) and parameter count of the paper's DCNv2 dense net."""
    net = common["dense_net"]
    flops, params = 0.0, 0
    prev = common["dense_features"]
    for width in net["bottom_mlp"]:
        flops += 2 * prev * width
        params += prev * width
        prev = width
    x = prev + num_tables * dim
    rank = net["dcnv2"]["low_rank"]
    for _ in range(net["dcnv2"]["layers"]):
        flops += 2 * 2 * x * rank
        params += 2 * x * rank
    prev = x
    for width in net["top_mlp"]:
        flops += 2 * prev * width
        params += prev * width
        prev = width
    return flops, params


# canonical name -> its key in paper_models.json, where they differ
_JSON_KEYS = {"dcnv2": "dlrm_dcnv2"}
# documented aliases (normalized: lower case, "-" for "_") -> canonical name
_ALIASES = {"dlrm-dcnv2": "dcnv2"}


def _models() -> dict:
    with open(_DATA) as fh:
        return json.load(fh)


def preset_names() -> list[str]:
    """Canonical model names: each paper model and its `-mini` variant."""
    keys = {v: k for k, v in _JSON_KEYS.items()}
    names = []
    for k in _models()["models"]:
        short = keys.get(k, k)
        names += [short, f"{short}-mini"]
    return names


def preset_aliases() -> dict[str, str]:
    """Documented aliases -> canonical name (with the `-mini` variants and the
    underscore spellings), e.g. for `--help` texts. Any case is accepted too."""
    out = {}
    for alias, name in sorted(_ALIASES.items()):
        for suffix in ("", "-mini"):
            out[alias + suffix] = name + suffix
            out[(alias + suffix).replace("-", "_")] = name + suffix
    return out


def _normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def canonical_preset(name: str) -> str:
    """The canonical name of a model name or alias (case-insensitive, `_` = `-`); a
    `ValueError` listing the valid names otherwise."""
    n = _normalize(name)
    mini = n.endswith("-mini")
    base = n.removesuffix("-mini")
    base = _ALIASES.get(base, base)
    canonical = f"{base}-mini" if mini else base
    if canonical not in preset_names():
        aliases = ", ".join(sorted({a for a in preset_aliases() if "_" not in a}))
        raise ValueError(
            f"unknown model {name!r}; choose from {', '.join(preset_names())} (aliases: "
            f"{aliases}; any case, '_' or '-')"
        )
    return canonical


def load_preset(name: str) -> ModelSpec:
    """A paper model by name or alias (`canonical_preset`): `dcnv2`, `t180`, `t200`, `t510`,
    `t7` and their `-mini` versions; the spec is named by its canonical name."""
    name = canonical_preset(name)
    data = _models()
    mini = name.endswith("-mini")
    base = name.removesuffix("-mini")
    key = _JSON_KEYS.get(base, base)
    m = data["models"][key]
    common = data["common"]
    tables = tuple(
        PlannerTable(
            name=t["name"],
            vocab_size=min(t["vocab_size"], MINI_MAX_VOCAB) if mini else t["vocab_size"],
            dim=t["dim"],
            hotness=float(t["hotness"]),
        )
        for t in m["tables"]
    )
    flops, params = _dense_cost(common, len(tables))
    batches = {k: v for k, v in common["mlperf_batch"].items()}
    return ModelSpec(
        name=name,
        tables=tables,
        slot_footprint=SLOT_FOOTPRINTS[m["optimizer"]],
        dense_flops_per_sample=flops,
        dense_params=params,
        default_batch=batches,
    )
