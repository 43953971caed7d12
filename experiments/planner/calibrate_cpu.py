"""CPU calibration of the cost model: measured embedding step times on 8 fake CPU devices vs
the planner's prediction, with the `local` topology as `calibrate_local` measures it and
with constants fitted to the measurements.

    python -m experiments.planner.calibrate_cpu [--quick] [--repeats 15]
        [--out results/calibrate_cpu.json]

Each configuration (one table of each cluster kind, and the planner's plans for slices of
the -mini presets) compiles one step: the lookup plus the two-phase backward and SGD update
(`lookup_fn` + `apply_gradients_fn`, the embedding part of a train step). After two warm-up
steps it is timed `--repeats` times (the step only; batches are placed beforehand); the
median is reported with the interquartile range.

What the cost model does not see: the compiled step copies every group buffer a device
holds (the whole stacked `[rows_per_device, width]` buffer) on its way into the fused
update and back out (XLA's copy insertion around the aliased FFI update), so a CPU step
grows with the resident table bytes per device. The fit has a term for it
(`buffer_bytes`), reported as `buffer_copy_bw`.

Predictions: the planner's `Evaluation.embedding_s` (per-shard prices, busiest device) and
the padded one (busiest device's compute + `plan_traffic`, the bytes the runtime's padded
group buffers move, on every device). Fitted: the step time as
`overhead + compute_bytes / memory_bw + link_bytes / link_bw + buffer_bytes / buffer_copy_bw`
(non-negative least squares
over the configurations; `link_bw` for intra and inter alike, fake devices share memory),
whose constants are printed and written, never cached. On 8 fake devices sharing a few
cores the devices' work runs largely one after another, so the fitted bandwidths are
per-machine rates divided among the devices, and a fixed per-step overhead (dispatch,
XLA's per-op costs) is part of every step.
"""

import argparse
import dataclasses
import json
import os
import statistics
import time

import numpy as np

B, REPEATS = 1024, 15


def _spec_for(name, kind, vocab, dim, hot):
    from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
    from embark_jax.planner.model import ModelSpec

    config = EmbeddingConfig.create(
        [TableConfig(name="t", vocab_size=vocab, dim=dim)],
        [FeatureConfig(name="f", table="t", max_hotness=hot)],
    )
    return ModelSpec.from_config(config, slot_footprint=(0, 0), name=name), config


def configurations(quick: bool):
    """(name, spec, config, plan) of every configuration."""
    from embark_jax.core.plan import Plan, TablePlan, Topology
    from embark_jax.planner import get_hardware, load_preset, plan

    topo = Topology(num_nodes=1, devices_per_node=8)
    singles = [  # name, cluster, vocab, dim, hotness, row shards
        ("dp-dense", "dp", 500, 32, 4, 1),
        ("dp-sparse", "dp", 200_000, 32, 1, 1),
        ("rb-tw", "rb", 100_000, 64, 8, 1),
        ("rb-rw", "rb", 100_000, 64, 8, 8),
        ("ub-rw", "ub", 100_000, 64, 1, 8),
        ("rb-rw-hot", "rb", 100_000, 32, 32, 8),
    ]
    out = []
    for name, cl, vocab, dim, hot, r in singles[: 3 if quick else None]:
        spec, config = _spec_for(name, cl, vocab, dim, hot)
        devices = (tuple(range(8)),) if cl == "dp" else (tuple(range(r)),)
        tp = TablePlan(name="t", cluster=cl, row_shards=r, column_shards=1, devices=devices)
        out.append((name, spec, config, Plan(topology=topo, batch_size=B, tables=(tp,))))
    hw = get_hardware("dgx-h100", 1, 8)  # plans chosen on fixed constants: reproducible
    for preset, every in (("dcnv2-mini", 2), ("t200-mini", 10))[: 1 if quick else None]:
        full = load_preset(preset)
        tables = tuple(
            dataclasses.replace(t, vocab_size=min(t.vocab_size, 20_000), hotness=min(t.hotness, 8))
            for t in full.tables[::every]
        )
        spec = dataclasses.replace(full, tables=tables, slot_footprint=(0, 0))
        out.append((preset, spec, spec.embedding_config(), plan(spec, B, hw).plan))
    return out


def measure(config, plan_, repeats: int) -> tuple[list[float], float]:
    """Seconds of `repeats` embedding steps (lookup + backward + SGD update), and the bytes
    of every group buffer one device holds (the compiled step copies them, see below)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from embark_jax.core.options import RuntimeOptions
    from embark_jax.data.synthetic import SyntheticDataset
    from embark_jax.ops.optimizers import SGD
    from embark_jax.sharding.collection import EmbeddingCollection, apply_gradients_fn, lookup_fn

    options = RuntimeOptions()
    coll = EmbeddingCollection(
        config, plan_, plan_.make_mesh(), rngs=nnx.Rngs(0), optimizer=SGD(learning_rate=0.01)
    )
    lw, mesh, opts = coll.lowered, coll.mesh, coll.optimizers

    def step(bufs, states, batch):
        out, res, _ = lookup_fn(lw, mesh, options, bufs, batch)
        grads = jax.tree.map(lambda y: y * 1e-3, out)
        return apply_gradients_fn(lw, mesh, options, bufs, states, res, grads, opts, batch)

    run = jax.jit(step, donate_argnums=(0, 1))
    ds = SyntheticDataset(config, batch_size=B, seed=0)
    batches = [coll.shard_batch(ds.batch(i).sparse) for i in range(4)]
    bufs, states = coll.buffer_values(), coll.state_values()
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        bufs, states = run(bufs, states, batches[i % len(batches)])
        jax.block_until_ready(bufs)
        if i >= 2:  # warm-up: compile, first run
            times.append(time.perf_counter() - t0)
    del jnp
    resident = sum(
        g.rows_per_device * g.width * np.dtype(g.dtype).itemsize for g in coll.lowered.groups
    )
    return times, float(resident)


def features(spec, plan_, hw) -> dict:
    """What the model prices for the plan on `hw`: bytes and its predictions."""
    from embark_jax.planner import evaluate
    from embark_jax.planner.traffic import plan_traffic

    ev = evaluate(spec, plan_, hw)
    d = ev.bottleneck
    compute_bytes = float(ev.device_compute[d] * hw.memory_bw)
    intra, inter = plan_traffic(spec, plan_, hw)
    padded = float(ev.device_compute.max()) + intra / hw.intra_bw + inter / hw.inter_bw
    return {
        "compute_bytes": compute_bytes,
        "link_bytes": intra + inter,
        "per_shard_s": ev.embedding_s,
        "padded_s": padded,
    }


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns: the best of every subset's fit."""
    best, best_res = np.zeros(a.shape[1]), float(b @ b)
    for mask in range(1, 1 << a.shape[1]):
        cols = [i for i in range(a.shape[1]) if mask >> i & 1]
        coef = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (coef < 0).any():
            continue
        res = float(np.sum((a[:, cols] @ coef - b) ** 2))
        if res < best_res:
            best_res, best = res, np.zeros(a.shape[1])
            best[cols] = coef
    return best


def fit(rows) -> dict:
    """Non-negative least squares of median step = overhead + compute/bw_m + link/bw_l +
    buffer/bw_b, each row weighted by 1 / measured (relative errors)."""
    y = np.array([r["measured_s"] for r in rows])
    x = np.array([[1.0, r["compute_bytes"], r["link_bytes"], r["buffer_bytes"]] for r in rows])
    over, per_m, per_l, per_b = _nnls(x / y[:, None], np.ones_like(y))
    return {
        "overhead_s": float(over),
        "memory_bw": float(1 / per_m) if per_m > 0 else float("inf"),
        "link_bw": float(1 / per_l) if per_l > 0 else float("inf"),
        "buffer_copy_bw": float(1 / per_b) if per_b > 0 else float("inf"),
        "predict": lambda r: float(
            over + r["compute_bytes"] * per_m + r["link_bytes"] * per_l + r["buffer_bytes"] * per_b
        ),
    }


def table(rows) -> str:
    head = (
        f"{'config':<12}{'measured ms':>12}{'iqr':>8}{'per-shard':>11}{'padded':>9}"
        f"{'fitted':>9}{'loo':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['config']:<12}{r['measured_s'] * 1e3:>12.2f}{r['iqr_s'] * 1e3:>8.2f}"
            f"{r['err_per_shard']:>+11.0%}{r['err_padded']:>+9.0%}{r['err_fitted']:>+9.0%}"
            f"{r['err_loo']:>+8.0%}"
        )
    lines.append("(errors: predicted / measured - 1; loo: fitted without that row)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="results/calibrate_cpu.json")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--quick", action="store_true", help="3 configurations, 3 repeats")
    args = ap.parse_args(argv)
    import jax

    from embark_jax.planner import get_hardware

    if len(jax.devices()) != 8:
        raise SystemExit("needs 8 devices: run with JAX_PLATFORMS=cpu (8 fake CPU devices)")
    hw = get_hardware("local", 1, 8)
    repeats = 3 if args.quick else args.repeats
    rows = []
    for name, spec, config, plan_ in configurations(args.quick):
        times, resident = measure(config, plan_, repeats)
        q = np.percentile(times, [25, 75])
        row = {"config": name, "measured_s": statistics.median(times), "iqr_s": q[1] - q[0]}
        row["buffer_bytes"] = resident
        row.update(features(spec, plan_, hw))
        rows.append(row)
        print(f"{name}: {row['measured_s'] * 1e3:.2f} ms", flush=True)
    f = fit(rows)
    for i, r in enumerate(rows):
        r["fitted_s"] = f["predict"](r)
        r["loo_s"] = fit(rows[:i] + rows[i + 1 :])["predict"](r)  # fitted without this row
        for k in ("per_shard", "padded", "fitted", "loo"):
            r[f"err_{k}"] = r[f"{k}_s"] / r["measured_s"] - 1
    print(table(rows))
    consts = {k: v for k, v in f.items() if k != "predict"}
    print("fitted:", ", ".join(f"{k} {v:.3g}" for k, v in consts.items()))
    med = {
        k: statistics.median(abs(r[f"err_{k}"]) for r in rows)
        for k in ("per_shard", "padded", "fitted", "loo")
    }
    print("median |error|:", ", ".join(f"{k} {v:.0%}" for k, v in med.items()))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(
            {
                "topology": dataclasses.asdict(hw),
                "batch": B,
                "repeats": repeats,
                "fitted": consts,
                "median_abs_error": med,
                "rows": rows,
            },
            fh,
            indent=1,
        )
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    main()
