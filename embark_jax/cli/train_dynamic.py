"""`train --dynamic-tables`: a preset's tables turned into dynamic (hash) tables.

A dynamic table has no vocabulary: its feature's raw ids are its keys (Criteo TSV: the
64-bit value of the hex field, no `mod vocab_size`; synthetic data and the preprocessed
multi-hot files: the ids as they are). The rest of the preset stays fixed-vocabulary and is
planned as usual; the planner does not price the dynamic tables (every device holds one
shard of each, routed by hash, or a whole copy of a small one), so their memory is printed
beside the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

from embark_jax.cli.errors import CLIError

_NAMES = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")
BUCKET_SIZE = 32


def dynamic_tables(text: str) -> str:
    """`--dynamic-tables`' value: a count N (the N largest tables) or table names, comma
    separated (checked against the preset later)."""
    if text.isdigit() and int(text) >= 1:
        return text
    if not text.isdigit() and _NAMES.fullmatch(text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither a count >= 1 (the largest tables) nor table names t0,t3,..."
    )


def add_dynamic_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dynamic-tables",
        type=dynamic_tables,
        default=None,
        metavar="N|NAME,...",
        help="make tables dynamic (hash tables keyed by the raw ids, no vocabulary): the N "
        "largest, or these names; at least one table stays fixed (default: none)",
    )
    p.add_argument(
        "--dynamic-capacity",
        type=_capacity,
        default=None,
        help=f"rows per device of each dynamic table, a multiple of {BUCKET_SIZE} (default: "
        "twice the preset's vocabulary over the devices, i.e. load 0.5 at that many ids; a "
        "replicated table's whole vocabulary, twice)",
    )
    p.add_argument(
        "--dynamic-replicate-below",
        type=_nonneg,
        default=4096,
        metavar="ROWS",
        help="a dynamic table whose preset vocabulary is below ROWS is held whole on every "
        "device (data-parallel: no all-to-all) instead of sharded; 0: none (default: 4096)",
    )
    p.add_argument(
        "--admission",
        type=_positive,
        default=1,
        help="an id gets a row at its K-th sighting; before that it reads zeros (default: 1)",
    )
    p.add_argument(
        "--eviction",
        default="lru",
        choices=("lru", "lfu", "none"),
        help="what a full bucket does for a newcomer: replace its least recently (lru) or "
        "least often (lfu) seen entry, or drop the newcomer (none) (default: lru)",
    )


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return int(text)


def _nonneg(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return int(text)


def _capacity(text: str) -> int:
    n = _positive(text)
    if n % BUCKET_SIZE:
        raise argparse.ArgumentTypeError(f"{n} is not a multiple of the bucket size {BUCKET_SIZE}")
    return n


def chosen(args, spec) -> list[str]:
    """The names of the preset's tables `--dynamic-tables` makes dynamic (one-line error for
    unknown names, or when no table would stay fixed)."""
    text = args.dynamic_tables
    if text is None:
        return []
    names = [t.name for t in spec.tables]
    if text.isdigit():
        by_size = sorted(spec.tables, key=lambda t: (-t.vocab_size, names.index(t.name)))
        picked = [t.name for t in by_size[: int(text)]]
    else:
        picked = list(dict.fromkeys(text.split(",")))
        unknown = [n for n in picked if n not in names]
        if unknown:
            raise CLIError(
                f"--dynamic-tables: {', '.join(unknown)} not in --model {args.model} "
                f"(tables {names[0]}..{names[-1]})"
            )
    if len(picked) >= len(names):
        raise CLIError(
            f"--dynamic-tables {text}: all {len(names)} tables would be dynamic; keep at least "
            "one fixed"
        )
    return picked


def split(args, spec, num_devices: int):
    """(the preset's fixed part, the `DynamicConfig` or None, the Criteo column order: the
    preset's feature names)."""
    from embark_jax.core.dynamic import DynamicConfig, DynamicFeatureConfig, DynamicTableConfig

    columns = [f.name for f in spec.embedding_config().features]
    names = chosen(args, spec)
    if not names:
        return spec, None, columns
    tables, features, replicated = [], [], []
    for t in (t for t in spec.tables if t.name in names):
        whole = t.vocab_size < args.dynamic_replicate_below
        if whole:
            replicated.append(t.name)
        share = 1 if whole else num_devices
        cap = args.dynamic_capacity or _default_capacity(t.vocab_size, share)
        tables.append(
            DynamicTableConfig(
                name=t.name,
                dim=t.dim,
                capacity=cap,
                bucket_size=BUCKET_SIZE,
                eviction=args.eviction,
                admission_threshold=args.admission,
            )
        )
        feature = next(f for f in spec.embedding_config().features if f.table == t.name)
        features.append(
            DynamicFeatureConfig(
                name=feature.name,
                table=t.name,
                max_hotness=feature.max_hotness,
                combiner="sum" if feature.combiner.value == "none" else feature.combiner,
            )
        )
    fixed = dataclasses.replace(spec, tables=tuple(t for t in spec.tables if t.name not in names))
    return fixed, DynamicConfig(tuple(tables), tuple(features), tuple(replicated)), columns


def _default_capacity(vocab: int, num_devices: int) -> int:
    """Rows per device for twice `vocab` ids over the devices, in whole buckets."""
    return max(1, math.ceil(2 * vocab / num_devices / BUCKET_SIZE)) * BUCKET_SIZE


def describe(dynamic, num_devices: int) -> str:
    """One line: the dynamic tables, their rows and memory per device."""
    import numpy as np

    parts, total = [], 0
    for t in dynamic.tables:
        total += t.capacity * t.dim * np.dtype(t.dtype).itemsize
        where = "replicated" if dynamic.is_replicated(t.name) else "sharded"
        parts.append(f"{t.name} ({t.capacity} rows/device, {where})")
    return (
        f"dynamic tables: {', '.join(parts)}; {t.eviction.value} eviction, admission at "
        f"{t.admission_threshold} sighting(s); {total / 2**20:.1f} MiB of rows per device "
        f"(+ optimizer slots), on each of {num_devices} devices, not priced by the planner"
    )
