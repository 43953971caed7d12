"""Compile time and HLO size of the train step against the number of features.

  python -m experiments.collection.compile_scaling            # F = 10 and 100
  python -m experiments.collection.compile_scaling --features 10,40 --repeats 1

The main training path (`training.state.create`, `training.step.compile_train_step`, the
planner's plan for 8 devices of a DGX-H100 node, row-wise Adagrad) on 8 fake CPU devices.
Every workload has the same ids per sample in total (`--ids`, default 100), split evenly
over F features, one table per feature (`--vocab` rows, dim `--dim`); the batch is fixed.
For each F: the time to lower the jitted step, to compile it, and the lines and
instructions of the optimized HLO; the min of `--repeats` runs, the configurations
interleaved (the machine is shared). Writes results/compile_scaling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def workload(num_features: int, ids_per_sample: int, vocab: int, dim: int):
    """F tables of `vocab` rows, one feature each, the ids per sample split evenly."""
    from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig

    base, extra = divmod(ids_per_sample, num_features)
    tables, feats = [], []
    for i in range(num_features):
        tables.append(TableConfig(name=f"t{i}", vocab_size=vocab, dim=dim))
        hot = base + (i < extra)
        feats.append(FeatureConfig(name=f"f{i}", table=f"t{i}", max_hotness=max(1, hot)))
    return EmbeddingConfig.create(tables, feats)


def build(num_features: int, args):
    """The jitted train step, its state and a host batch for F features."""
    import jax

    from embark_jax.data.synthetic import SyntheticDataset
    from embark_jax.ops import optimizers
    from embark_jax.planner import ModelSpec, get_hardware, plan
    from embark_jax.training.models import DenseConfig
    from embark_jax.training.state import create
    from embark_jax.training.step import compile_train_step

    config = workload(num_features, args.ids, args.vocab, args.dim)
    opt = optimizers.RowWiseAdagrad(learning_rate=0.05)
    spec = ModelSpec.from_config(config, opt.slot_footprint)
    ev = plan(spec, args.batch, get_hardware("dgx-h100", 1, len(jax.devices())))
    setup, state = create(config, ev.plan, dense=DenseConfig.mini(), sparse_optimizer=opt)
    batch = SyntheticDataset(config, batch_size=args.batch, seed=0).batch(0)
    clusters = sorted({t.cluster.value for t in ev.plan.tables})
    return compile_train_step(setup), state, batch, clusters, setup


def measure(num_features: int, args) -> dict:
    """One lowering and compilation of the step for F features."""
    import jax

    step, state, batch, clusters, setup = build(num_features, args)
    batch = jax.device_put(batch, setup.table_sharding)
    t0 = time.perf_counter()
    lowered = step.lower(state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    text = compiled.as_text()
    lines = text.splitlines()
    return {
        "features": num_features,
        "clusters": clusters,
        "groups": len(setup.lowered.groups),
        "lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "hlo_lines": len(lines),
        "hlo_instructions": sum(1 for ln in lines if " = " in ln),
        "stablehlo_lines": len(lowered.as_text().splitlines()),
    }


def run(args) -> dict:
    counts = [int(x) for x in args.features.split(",")]
    runs: dict[int, list[dict]] = {f: [] for f in counts}
    for r in range(args.repeats):
        for f in counts:  # interleaved: every F once per round
            m = measure(f, args)
            runs[f].append(m)
            print(
                f"round {r} F={f:4d}: lower {m['lower_s']:.2f} s, compile {m['compile_s']:.2f} s, "
                f"{m['hlo_lines']} HLO lines ({m['hlo_instructions']} instructions), "
                f"clusters {m['clusters']}",
                flush=True,
            )
    best = {}
    for f, ms in runs.items():
        best[f] = dict(ms[0])
        for key in ("lower_s", "compile_s"):
            best[f][key] = min(m[key] for m in ms)
    lo, hi = min(counts), max(counts)
    ratio = {
        key: best[hi][key] / best[lo][key]
        for key in ("lower_s", "compile_s", "hlo_lines", "hlo_instructions", "stablehlo_lines")
    }
    return {"best": [best[f] for f in counts], "ratio": {f"{hi}/{lo}": ratio}, "runs": runs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", default="10,100", help="feature counts, comma-separated")
    ap.add_argument("--ids", type=int, default=100, help="ids per sample, all features")
    ap.add_argument("--vocab", type=int, default=10_000, help="rows of every table")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256, help="global batch")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (min taken)")
    ap.add_argument("--out", default="results/compile_scaling.json")
    args = ap.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    result = run(args)
    for key, value in result["ratio"].items():
        print(
            f"{key}: lower {value['lower_s']:.2f}x, compile {value['compile_s']:.2f}x, "
            f"HLO lines {value['hlo_lines']:.2f}x",
            flush=True,
        )
    result["setup"] = {**vars(args), "devices": len(jax.devices()), "jax": jax.__version__}
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
