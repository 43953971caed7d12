"""`train --dynamic-tables`: a preset's tables turned into dynamic (hash) tables.

A dynamic table has no vocabulary: its feature's raw ids are its keys (Criteo TSV: the
64-bit value of the hex field, no `mod vocab_size`; synthetic data and the preprocessed
multi-hot files: the ids as they are). The rest of the preset stays fixed-vocabulary and is
planned as usual, and the dynamic tables by `planner.dynamic.plan_dynamic`: each one sharded
(routed by hash) or, when that is predicted faster and small enough, replicated on every
device; capacity for its preset vocabulary's worth of distinct ids at load 0.5. Their
choices, memory and predicted time are printed beside the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from embark_jax.cli.errors import CLIError, nonneg_int, positive_int
from embark_jax.cli.flags import add_choice
from embark_jax.core.dynamic import Eviction

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
        type=nonneg_int,
        default=None,
        metavar="ROWS",
        help="hold a dynamic table whole on every device (data-parallel: no all-to-all) when "
        "its preset vocabulary is below ROWS, else shard it; 0: shard all (default: the "
        "planner chooses by predicted time, replicating only small tables)",
    )
    p.add_argument(
        "--admission",
        type=positive_int,
        default=1,
        help="an id gets a row at its K-th sighting; before that it reads zeros (default: 1)",
    )
    add_choice(
        p,
        "--eviction",
        Eviction.LRU,
        "what a full bucket does for a newcomer: replace its least recently (lru) or least "
        "often (lfu) seen entry, or drop the newcomer (none) (default: lru)",
    )


def _capacity(text: str) -> int:
    n = positive_int(text)
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


def split(args, spec, hw):
    """(the preset's fixed part, the `DynamicConfig` or None, the Criteo column order: the
    preset's feature names, the planner's `DynamicChoice`s)."""
    from embark_jax.core.dynamic import DynamicConfig, DynamicFeatureConfig, DynamicTableConfig
    from embark_jax.planner.dynamic import plan_dynamic

    columns = [f.name for f in spec.embedding_config().features]
    names = chosen(args, spec)
    if not names:
        return spec, None, columns, ()
    specs = [_planner_table(t, spec) for t in spec.tables if t.name in names]
    choices = _override(
        args, plan_dynamic(specs, args.batch_size, hw, spec.slot_footprint), spec, hw
    )
    tables, features, replicated = [], [], []
    for t, choice in zip((t for t in spec.tables if t.name in names), choices, strict=True):
        if choice.replicated:
            replicated.append(t.name)
        cap = args.dynamic_capacity or choice.capacity
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
    dynamic = DynamicConfig(tuple(tables), tuple(features), tuple(replicated))
    return fixed, dynamic, columns, choices


def _planner_table(t, spec):
    """The planner's view of preset table `t` made dynamic: as many distinct ids as rows."""
    from embark_jax.planner.dynamic import DynamicTableSpec

    feature = next(f for f in spec.embedding_config().features if f.table == t.name)
    return DynamicTableSpec(
        name=t.name,
        dim=t.dim,
        hotness=t.hotness,
        max_hotness=feature.max_hotness,
        distinct_ids=t.vocab_size,
        alpha=t.alpha,
        dtype_bytes=t.dtype_bytes,
        bucket_size=BUCKET_SIZE,
    )


def _override(args, choices, spec, hw):
    """`--dynamic-replicate-below ROWS`: the placement by vocabulary instead of the
    planner's (priced the same way)."""
    from embark_jax.planner.dynamic import dynamic_capacity, replicated_cost, sharded_cost

    if args.dynamic_replicate_below is None:
        return choices
    out = []
    for c in choices:
        t = _planner_table(spec.table(c.name), spec)
        whole = hw.num_devices > 1 and t.distinct_ids < args.dynamic_replicate_below
        cap = dynamic_capacity(t, hw.num_devices, whole)
        price = replicated_cost if whole else sharded_cost
        reason = f"--dynamic-replicate-below {args.dynamic_replicate_below}"
        out.append(
            dataclasses.replace(
                c,
                replicated=whole,
                capacity=cap,
                cost=price(t, args.batch_size, hw, spec.slot_footprint, cap),
                reason=("replicated: " if whole else "sharded: ") + reason,
            )
        )
    return tuple(out)


def describe(dynamic, choices, num_devices: int) -> list[str]:
    """Lines for the plan summary: the dynamic tables' total, then one a table."""
    memory = sum(c.cost.memory for c in choices)
    step = sum(c.seconds for c in choices)
    t = dynamic.tables[0]
    lines = [
        f"dynamic tables: {len(choices)} on each of {num_devices} devices, predicted "
        f"{step * 1e3:.3f} ms a step beside the fixed tables', {memory / 2**20:.1f} MiB a "
        f"device (rows, slots, keys, buffers); {t.eviction.value} eviction, admission at "
        f"{t.admission_threshold} sighting(s)"
    ]
    for c, t in zip(choices, dynamic.tables, strict=True):
        where = "replicated" if c.replicated else "sharded"
        lines.append(f"  {t.name}: {where}, {t.capacity} rows/device -- {c.reason}")
    return lines
