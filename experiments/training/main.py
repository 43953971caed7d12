"""Training benchmark on 8 fake CPU devices: steps/s and collective bytes per step of the
planner's plan vs TRW vs row-wise everywhere, for scaled-down T180 and T200 and DCNv2-mini,
measured in the same run. Writes JSON and a PNG chart.

    python -m experiments.training.main [--quick] [--out results/training.json]

"Scaled-down": the presets' -mini vocabularies, capped further, with every feature's hotness
capped (T180's 200-hot tables would make a CPU step take seconds); the shape of the model
(many tables, skewed hotness and dims) is kept.
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


def bench_model(name, preset, max_vocab, max_hot, batch, steps, plans=("embark", "trw", "rw")):
    import jax
    import optax

    from embark_jax.data.synthetic import SyntheticDataset
    from embark_jax.ops import optimizers as O
    from embark_jax.planner import baseline, get_hardware, load_preset, plan
    from embark_jax.training.models import DenseConfig
    from embark_jax.training.runner import StepRunner
    from embark_jax.training.state import create

    spec = load_preset(preset)
    spec = dataclasses.replace(
        spec,
        tables=tuple(
            dataclasses.replace(
                t,
                vocab_size=min(t.vocab_size, max_vocab),
                hotness=min(t.hotness, max_hot) if max_hot else t.hotness,
            )
            for t in spec.tables
        ),
    )
    config = spec.embedding_config()
    hw = get_hardware("local", 1, len(jax.devices()))
    ds = SyntheticDataset(config, batch_size=batch, seed=0)
    rows = []
    for kind in plans:
        ev = plan(spec, batch, hw) if kind == "embark" else baseline(spec, batch, hw, kind)
        setup, state = create(
            config,
            ev.plan,
            dense=DenseConfig.mini(),
            sparse_optimizer=O.SGD(learning_rate=0.05),
            dense_optimizer=optax.adam(1e-3),
        )
        runner = StepRunner(setup)
        state, _ = runner.step(state, ds.batch(0))  # compile
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            state, _ = runner.step(state, ds.batch(1 + i))
            times.append(time.perf_counter() - t0)
        cb = runner.comm_bytes_per_step(state, ds.batch(0))
        med = statistics.median(times)
        rows.append(
            {
                "model": name,
                "plan": kind,
                "steps_per_s": 1 / med,
                "samples_per_s": batch / med,
                "collective_bytes": cb["total"],
                "predicted_step_ms": ev.step_s * 1e3,
                "clusters": {
                    c: sum(1 for t in ev.plan.tables if t.cluster.value == c)
                    for c in ("dp", "rb", "ub")
                },
            }
        )
        print(
            f"{name:11s} {kind:7s} {1 / med:7.2f} steps/s  {batch / med:9.0f} samples/s  "
            f"collectives {cb['total'] / 1e6:8.2f} MB/step",
            flush=True,
        )
    base = {r["plan"]: r for r in rows}
    for r in rows:
        r["speedup_vs_trw"] = r["steps_per_s"] / base["trw"]["steps_per_s"]
        r["bytes_vs_trw"] = r["collective_bytes"] / base["trw"]["collective_bytes"]
    return rows


def chart(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    models = sorted({r["model"] for r in rows})
    plans = ["embark", "trw", "rw"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(models))
    for i, p in enumerate(plans):
        sp = [
            next(r["steps_per_s"] for r in rows if r["model"] == m and r["plan"] == p)
            for m in models
        ]
        by = [
            next(r["collective_bytes"] for r in rows if r["model"] == m and r["plan"] == p) / 1e6
            for m in models
        ]
        a.bar(x + i * 0.27, sp, 0.27, label=p)
        b.bar(x + i * 0.27, by, 0.27, label=p)
    for ax, t in ((a, "steps/s (8 fake CPU devices)"), (b, "collective MB/step per device")):
        ax.set_xticks(x + 0.27, models)
        ax.set_title(t)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="results/training.json")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="dcnv2-mini only, tiny (smoke test)")
    args = ap.parse_args(argv)
    initialize_from_env(default_cpu_devices=8)
    rows = []
    if args.quick:
        rows += bench_model("dcnv2-mini", "dcnv2-mini", 500, 2, 64, 1)
    else:
        for name, (preset, v, h, b) in MODELS.items():
            rows += bench_model(name, preset, v, h, b, args.steps)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows}, fh, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    chart(rows, png)
    print(f"wrote {args.out} and {png}")
    return rows


if __name__ == "__main__":
    main()
