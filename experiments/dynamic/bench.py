"""The dynamic-table benchmark's logic (experiments/dynamic/main.py runs it).

For each load factor: a table of `capacity` slots (buckets of `bucket_size`, rows of `dim`
float32, LRU, `zeros` initializer) is filled with random 64-bit ids until exactly that
fraction of its slots holds one. One batch of `batch` distinct ids, half of them held by the
table and half new, in random order, is then timed through

- `find`: `ops.hash_table.find` (the slot of each id, -1 for the new ones), and
- `find_or_insert`: `ops.hash_table.find_or_insert` at the next step (the held ids found, the
  new ones inserted with zeroed rows of `dim` floats; at high load some replace the
  least-recently-seen entry of a full bucket),

each call on a fresh copy of the filled table made before its timer starts (donated, so the
op runs in place as in training), and through a C++ `std::unordered_map<uint64_t, int32_t>`
baseline doing the same (`baseline.cc`, built here with the system g++ at run time, one
thread): `find`, and `try_emplace` plus zeroing a new row of `dim` floats.

Reported per op: min and median seconds of `repeats` timed calls, million keys per second
(batch / time), and the baseline's time over ours (> 1: ours faster); for find_or_insert
also our kernel alone (`ops.hash_table.find_or_insert_slots`: the index, no row written),
and the per-call counts. The run checks that both found the same number of held ids and
that the baseline holds as many as our table (RuntimeError otherwise).

JSON schema `embark_jax.dynamic_bench/1`: {schema, config: {capacity, bucket_size, dim,
batch, repeats, threads_ours, threads_baseline, compiler}, points: [{load_factor,
load_reached, op, ours_s: [..], baseline_s: [..], ours_min_s, ours_median_s,
baseline_min_s, baseline_median_s, ours_mkeys_s, baseline_mkeys_s (at the min),
ours_mkeys_s_median, baseline_mkeys_s_median, ratio_min, ratio_median, counts, and for
find_or_insert ours_index_only_s: [..], ours_index_only_min_s, ours_index_only_median_s}]}.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np

SCHEMA = "embark_jax.dynamic_bench/1"
HERE = pathlib.Path(__file__).resolve().parent
PAD = np.uint64(2**64 - 1)


def build_baseline(workdir: pathlib.Path) -> tuple[pathlib.Path, str]:
    """Compiles baseline.cc with the system g++; returns (binary, compiler version line)."""
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("the baseline needs a C++ compiler (g++) on PATH")
    exe = workdir / "baseline"
    subprocess.run(
        [cxx, "-O3", "-std=c++17", "-o", str(exe), str(HERE / "baseline.cc")],
        check=True,
        capture_output=True,
        text=True,
    )
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return exe, version.splitlines()[0] if version else cxx


def _new_ids(rng, n: int, taken: set) -> np.ndarray:
    """n distinct random 64-bit ids, none in `taken` (nor padding); added to `taken`."""
    out: list[int] = []
    while len(out) < n:
        for x in rng.integers(0, 2**64 - 1, n - len(out), dtype=np.uint64).tolist():
            if x not in taken:
                taken.add(x)
                out.append(x)
    return np.array(out, np.uint64)


def _timed(prepare, run, repeats: int) -> list[float]:
    """Seconds of `repeats` calls of run(*prepare()), prepare() outside the timer."""
    times = []
    for _ in range(repeats):
        args = prepare()
        t0 = time.perf_counter()
        run(*args)
        times.append(time.perf_counter() - t0)
    return times


def _index_args(st):
    return st.keys, st.scores, st.cand_keys, st.cand_scores


def _time_ours(jax, ops, st, words, repeats: int) -> dict[str, list[float]]:
    find, insert, index, copy = ops
    jax.block_until_ready(find(st, words))  # compile and warm up
    jax.block_until_ready(insert(copy(st), words))
    jax.block_until_ready(index(*copy(_index_args(st)), words))
    return {
        "find": _timed(lambda: (), lambda: jax.block_until_ready(find(st, words)), repeats),
        "find_or_insert": _timed(
            lambda: (jax.block_until_ready(copy(st)),),
            lambda s: jax.block_until_ready(insert(s, words)),
            repeats,
        ),
        "index_only": _timed(
            lambda: jax.block_until_ready(copy(_index_args(st))),
            lambda *a: jax.block_until_ready(index(*a, words)),
            repeats,
        ),
    }


def measure(
    *,
    capacity: int,
    bucket_size: int,
    dim: int,
    batch: int,
    load_factors: tuple[float, ...],
    repeats: int,
    seed: int = 0,
) -> dict:
    import jax
    import jax.numpy as jnp

    from embark_jax.core.dynamic import DynamicTableConfig, join_key_words, key_words
    from embark_jax.ops import hash_table as H
    from embark_jax.ops import native

    config = DynamicTableConfig(
        name="bench",
        dim=dim,
        capacity=capacity,
        bucket_size=bucket_size,
        eviction="lru",
        initializer="zeros",
    )
    fill = jax.jit(lambda st, w: H.find_or_insert(st, w, 0, config=config), donate_argnums=(0,))
    find = jax.jit(lambda st, w: H.find(st, w, config=config))
    insert = jax.jit(lambda st, w: H.find_or_insert(st, w, 1, config=config), donate_argnums=(0,))
    index = jax.jit(  # the kernel alone: no rows initialised
        lambda k, s, ck, cs, w: H.find_or_insert_slots(k, s, ck, cs, w, 1, bucket_size=bucket_size),
        donate_argnums=(0, 1, 2, 3),
    )
    copy = jax.jit(lambda st: jax.tree.map(jnp.copy, st))
    rng = np.random.default_rng(seed)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="embark_dynamic_bench_"))
    try:
        exe, compiler = build_baseline(workdir)
        points = []
        for lf in load_factors:
            target = round(lf * capacity)
            taken: set = set()
            st = H.init(config)
            held = 0
            while held < target:  # step 0: full buckets drop newcomers, nothing is evicted
                fresh = _new_ids(rng, min(batch, target - held), taken)
                ids = np.full(batch, PAD, np.uint64)
                ids[: len(fresh)] = fresh
                st, res = fill(st, jnp.asarray(key_words(ids)))
                held += H.count_dict(res.counts)["inserted"]
            keys = np.asarray(st.keys)
            present = join_key_words(keys[~(keys == 0xFFFFFFFF).all(axis=1)]).view(np.uint64)
            assert len(present) == target, (len(present), target)
            half = batch // 2
            query = np.concatenate(
                [rng.choice(present, half, replace=False), _new_ids(rng, batch - half, taken)]
            )
            rng.shuffle(query)
            words = jnp.asarray(key_words(query))
            st = jax.block_until_ready(st)

            ours = _time_ours(jax, (find, insert, index, copy), st, words, repeats)
            ours_hits = int(np.sum(np.asarray(find(st, words)) >= 0))
            _, res = insert(copy(st), words)
            counts = H.count_dict(res.counts)

            present.tofile(workdir / "present.u64")
            query.tofile(workdir / "batch.u64")
            out = subprocess.run(
                [
                    str(exe),
                    str(workdir / "present.u64"),
                    str(workdir / "batch.u64"),
                    str(capacity),
                    str(dim),
                    str(repeats),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            base = json.loads(out.stdout)
            if base["hits"] != ours_hits or base["size"] != target:
                raise RuntimeError(
                    f"load {lf}: the baseline found {base['hits']} held ids of {base['size']}, "
                    f"ours {ours_hits} of {target}"
                )
            points.append(
                _point(lf, target / capacity, "find", ours["find"], base["find_s"], batch)
            )
            p = _point(
                lf,
                target / capacity,
                "find_or_insert",
                ours["find_or_insert"],
                base["find_or_insert_s"],
                batch,
            )
            p["counts"] = counts
            p["ours_index_only_s"] = ours["index_only"]
            p["ours_index_only_min_s"] = min(ours["index_only"])
            p["ours_index_only_median_s"] = statistics.median(ours["index_only"])
            points[-1]["counts"] = {"found": ours_hits}
            points.append(p)
        return {
            "schema": SCHEMA,
            "config": {
                "capacity": capacity,
                "bucket_size": bucket_size,
                "dim": dim,
                "batch": batch,
                "repeats": repeats,
                "threads_ours": native.cpu_threads(),
                "threads_baseline": 1,
                "compiler": compiler,
            },
            "points": points,
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _point(lf, reached, op, ours, base, batch) -> dict:
    o_min, o_med = min(ours), statistics.median(ours)
    b_min, b_med = min(base), statistics.median(base)
    return {
        "load_factor": lf,
        "load_reached": reached,
        "op": op,
        "ours_s": ours,
        "baseline_s": base,
        "ours_min_s": o_min,
        "ours_median_s": o_med,
        "baseline_min_s": b_min,
        "baseline_median_s": b_med,
        "ours_mkeys_s": batch / o_min / 1e6,
        "baseline_mkeys_s": batch / b_min / 1e6,
        "ours_mkeys_s_median": batch / o_med / 1e6,
        "baseline_mkeys_s_median": batch / b_med / 1e6,
        "ratio_min": b_min / o_min,
        "ratio_median": b_med / o_med,
    }


def table(result: dict) -> str:
    """The result as a Markdown table (the README's)."""
    c = result["config"]
    lines = [
        f"capacity {c['capacity']} slots (buckets of {c['bucket_size']}), dim {c['dim']}, "
        f"batch {c['batch']} ids (half held, half new), {c['repeats']} repeats; ours on "
        f"{c['threads_ours']} thread(s), std::unordered_map on {c['threads_baseline']}",
        "",
        "| load | op | ours min / median (ms) | ours Mkeys/s (min / median) "
        "| unordered_map min / median (ms) | unordered_map Mkeys/s | ratio (min / median) "
        "| ours, index only (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        lines.append(
            f"| {p['load_factor']:.1f} | {p['op']} "
            f"| {1e3 * p['ours_min_s']:.2f} / {1e3 * p['ours_median_s']:.2f} "
            f"| {p['ours_mkeys_s']:.1f} / {p['ours_mkeys_s_median']:.1f} "
            f"| {1e3 * p['baseline_min_s']:.2f} / {1e3 * p['baseline_median_s']:.2f} "
            f"| {p['baseline_mkeys_s']:.1f} / {p['baseline_mkeys_s_median']:.1f} "
            f"| {p['ratio_min']:.2f}x / {p['ratio_median']:.2f}x "
            + (
                f"| {1e3 * p['ours_index_only_min_s']:.2f} / "
                f"{1e3 * p['ours_index_only_median_s']:.2f} |"
                if "ours_index_only_s" in p
                else "| - |"
            )
        )
    return "\n".join(lines)
