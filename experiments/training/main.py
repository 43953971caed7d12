"""Training benchmark on 8 fake CPU devices: step time and collective bytes per step of the
planner's plan vs TRW vs row-wise everywhere, for scaled-down T180, T200 and DCNv2-mini,
measured in the same run, with the planner's prediction for exactly what runs next to it.

    python -m experiments.training.main [--quick] [--steps 20] [--out results/training.json]

How it measures (machines here are shared and noisy):
- every plan of a model is compiled and warmed up first; then the plans take turns, one step
  each, round after round, so a slow phase of the machine hits every plan alike;
- batches are generated and placed on the devices before the timer starts: the timer covers
  exactly one compiled train step (until its loss is ready);
- each plan reports the median step time, the min and the interquartile range.

"Scaled-down": the presets' -mini vocabularies, capped further, with every feature's hotness
capped (T180's 200-hot tables would make a CPU step take seconds); the shape of the model
(many tables, skewed hotness and dims) is kept. The planner prices the model that runs: the
capped tables, SGD's optimizer slots (none), the mini dense net's parameters, on the local
topology whose constants are recorded in the JSON next to the results.
"""

import argparse
import dataclasses
import json
import os
import statistics
import time

from embark_jax.training.distributed import initialize_from_env

MODELS = {  # preset, max vocab, max hotness, batch
    "t180-mini": ("t180-mini", 2000, 8, 512),
    "t200-mini": ("t200-mini", 2000, 8, 512),
    "dcnv2-mini": ("dcnv2-mini", 20000, None, 1024),
}
PLANS = ("embark", "trw", "rw")


def capped_spec(preset, max_vocab, max_hot):
    from embark_jax.planner import load_preset

    spec = load_preset(preset)
    tables = tuple(
        dataclasses.replace(
            t,
            vocab_size=min(t.vocab_size, max_vocab),
            hotness=min(t.hotness, max_hot) if max_hot else t.hotness,
        )
        for t in spec.tables
    )
    return dataclasses.replace(spec, tables=tables)


def _dense_params(state) -> int:
    import jax

    return int(sum(x.size for x in jax.tree.leaves(state.dense_params)))


def _contender(config, spec, ev, hw, batch):
    """Setup, state, compiled step and the planner's prediction for one plan."""
    import optax

    from embark_jax.ops import optimizers as O
    from embark_jax.planner import evaluate
    from embark_jax.training.models import DenseConfig
    from embark_jax.training.state import create
    from embark_jax.training.step import compile_train_step

    opt = O.SGD(learning_rate=0.05)
    setup, state = create(
        config,
        ev.plan,
        dense=DenseConfig.mini(),
        sparse_optimizer=opt,
        dense_optimizer=optax.adam(1e-3),
    )
    params = _dense_params(state)
    priced = dataclasses.replace(
        spec,
        slot_footprint=opt.slot_footprint,
        dense_params=params,
        dense_flops_per_sample=2.0 * params,  # MLP-like: one multiply-add per parameter
    )
    return {
        "setup": setup,
        "state": state,
        "step": compile_train_step(setup),
        "predicted": evaluate(priced, ev.plan, hw),
        "name": ev.name,
    }


def _time_round_robin(contenders, steps):
    """Warm-up, then `steps` rounds of one timed step per plan; returns seconds per plan."""
    import jax

    times = {k: [] for k in contenders}
    for c in contenders.values():  # compile + warm up
        c["state"], out = c["step"](c["state"], c["placed"][0])
        jax.block_until_ready(out["loss"])
    for i in range(steps):
        for k, c in contenders.items():
            placed = c["placed"][(i + 1) % len(c["placed"])]
            t0 = time.perf_counter()
            c["state"], out = c["step"](c["state"], placed)
            jax.block_until_ready(out["loss"])
            times[k].append(time.perf_counter() - t0)
    return times


def bench_model(name, preset, max_vocab, max_hot, batch, steps, plans=PLANS, topology="local"):
    import jax

    from embark_jax.data.synthetic import SyntheticDataset
    from embark_jax.planner import baseline, get_hardware, plan
    from embark_jax.sharding import hlo_bytes

    spec = capped_spec(preset, max_vocab, max_hot)
    config = spec.embedding_config()
    hw = get_hardware(topology, 1, len(jax.devices()))
    ds = SyntheticDataset(config, batch_size=batch, seed=0)
    host = [ds.batch(i) for i in range(4)]
    contenders = {}
    for kind in plans:
        ev = plan(spec, batch, hw) if kind == "embark" else baseline(spec, batch, hw, kind)
        c = _contender(config, spec, ev, hw, batch)
        c["placed"] = [jax.device_put(b, c["setup"].table_sharding) for b in host]
        contenders[kind] = c
    times = _time_round_robin(contenders, steps)
    rows = []
    for kind, c in contenders.items():
        mesh = c["setup"].mesh
        shape = tuple(mesh.shape.values())
        compiled = c["step"].lower(c["state"], c["placed"][0]).compile()
        total = sum(hlo_bytes.collective_bytes(compiled, shape, mesh.axis_names).values())
        rows.append(_row(name, kind, batch, times[kind], total, c, hw))
    base = {r["plan"]: r for r in rows}
    for r in rows:
        r["speedup_vs_trw"] = base["trw"]["step_ms_median"] / r["step_ms_median"]
        r["bytes_vs_trw"] = r["collective_bytes"] / max(base["trw"]["collective_bytes"], 1)
        r["same_plan_as_trw"] = r["plan_json"] == base["trw"]["plan_json"]
    return rows


def _row(name, kind, batch, times, collective_bytes, c, hw):
    ms = sorted(t * 1e3 for t in times)
    q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    med = statistics.median(ms)
    pred = c["predicted"]
    row = {
        "model": name,
        "plan": kind,
        "batch": batch,
        "steps_timed": len(ms),
        "step_ms_median": med,
        "step_ms_min": ms[0],
        "step_ms_iqr": q[2] - q[0],
        "steps_per_s": 1e3 / med,
        "samples_per_s": batch * 1e3 / med,
        "collective_bytes": int(collective_bytes),
        "predicted_step_ms": pred.step_s * 1e3,
        "predicted_embedding_ms": pred.embedding_s * 1e3,
        "clusters": {
            cl: sum(1 for t in pred.plan.tables if t.cluster.value == cl)
            for cl in ("dp", "rb", "ub")
        },
        "plan_json": pred.plan.to_json(indent=None),
        "topology": dataclasses.asdict(hw),
    }
    print(
        f"{name:11s} {kind:7s} median {med:8.2f} ms (min {ms[0]:.2f}, IQR {row['step_ms_iqr']:.2f})"
        f"  predicted {row['predicted_step_ms']:8.2f} ms  collectives "
        f"{collective_bytes / 1e6:8.2f} MB/step",
        flush=True,
    )
    return row


def chart(rows, path) -> bool:
    """A PNG of step time and collective bytes per plan; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    models = sorted({r["model"] for r in rows})
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(models))
    for i, p in enumerate(PLANS):
        pick = [next(r for r in rows if r["model"] == m and r["plan"] == p) for m in models]
        a.bar(x + i * 0.27, [r["step_ms_median"] for r in pick], 0.27, label=p)
        b.bar(x + i * 0.27, [r["collective_bytes"] / 1e6 for r in pick], 0.27, label=p)
    titles = ("median step ms (8 fake CPU devices)", "collective MB/step per device")
    for ax, t in zip((a, b), titles, strict=True):
        ax.set_xticks(x + 0.27, models)
        ax.set_title(t)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="results/training.json")
    ap.add_argument("--steps", type=int, default=20, help="timed rounds (one step per plan)")
    ap.add_argument("--quick", action="store_true", help="dcnv2-mini only, tiny (smoke test)")
    ap.add_argument(
        "--topology",
        default="local",
        help="hardware the planner prices: 'local' (this machine, calibrated once and cached) "
        "or a preset such as dgx-h100 (machine-independent plans)",
    )
    args = ap.parse_args(argv)
    initialize_from_env(default_cpu_devices=8)
    rows = []
    if args.quick:
        rows += bench_model("dcnv2-mini", "dcnv2-mini", 500, 2, 64, 2, topology=args.topology)
    else:
        for name, (preset, v, h, b) in MODELS.items():
            rows += bench_model(name, preset, v, h, b, args.steps, topology=args.topology)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows}, fh, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    if chart(rows, png):
        print(f"wrote {args.out} and {png}")
    else:
        print(f"wrote {args.out} (matplotlib is not installed: no chart)")
    return rows


if __name__ == "__main__":
    main()
