"""The main job's train step on the devices at hand: throughput, the embedding share of the
step, peak memory against the planner's prediction, and the whole tables the compiled step
touches outside the in-place update.

    python -m experiments.training.gpu_step --batch 65536 --out results/gpu_step.json   # 1 GPU
    python -m experiments.training.gpu_step --batch 64 --max-vocab 500 --max-hotness 2   # CPU

The model is `python -m embark_jax train`'s (its defaults: DLRM-DCNv2-mini, the mini dense
net, the sparse optimizer and learning rates, the planner's plan for these devices at this
batch), built through `embark_jax.training.state.create` and jitted by
`compile_train_step(setup, donate=True)`: the in-place step `StepRunner` runs, without its
metrics and host checks, so the timer covers the device step only.

What it measures, in order (the JSON is rewritten after each phase, so a run stopped by a
time limit keeps the phases it finished):

1. plan: the planner's plan and its prediction, priced with the dense net that runs (as
   `experiments/training/main.py` does): step, embedding and dense time, and the predicted
   per-device memory (`planner.memory.plan_memory`: the stacked tables and slots, the batch,
   the staged updates and the exchange buffers; plus the dense parameters, their Adam
   moments and three parameter-sized temporaries: gradient, all-reduced gradient, update).
2. compile: lowering and compile seconds; `memory_analysis()` of the compiled step
   (arguments + outputs - aliased + temporaries = its peak estimate per device); the
   optimized HLO scanned for every op that produces a whole table or slot other than
   parameters, bitcasts and the row kernels (`embark_jax.sharding.hlo_scan`).
3. step: the first step (after compile: autotuning, first-touch allocations), then
   `steps` steps, each timed until the new state (committed in place) is ready, on batches generated and placed on the devices beforehand.
   samples/s = batch / median step time.
4. memory: the devices' `memory_stats()` (peak bytes in use; None on CPU) against the
   planner's predicted per-device memory.
5. embedding_only: the same step with a minimal dense net (no cross layers, one output
   unit: the embedding outputs still get their gradients); its median time over the full
   step's is the measured embedding share of the step. Skipped (and named in `skipped`)
   when more than half of `--budget-s` is spent before it, since it compiles again.

JSON (schema "embark_jax.gpu_step/1"): schema, backend, devices, device_kind, jax, model,
batch, optimizer, phases (done, in order), plan {name, clusters, tables}, predicted
{step_ms, embedding_ms, dense_ms, embedding_share, device_memory_bytes (per device),
step_memory {state, batch, staged, exchange, backward, total}},
compile {lower_s, compile_s}, memory_analysis {argument, output, alias, temp, peak_estimate}
(bytes per device), hlo {buffers, count, copies, copied_buffers, ops: [...]}, step {first_s,
times_s, median_s, min_s, samples_per_s}, memory {device: {peak_bytes_in_use, bytes_in_use,
bytes_limit} | null, peak_vs_predicted, estimate_vs_predicted}, embedding_only {dense,
times_s, median_s, min_s, share}, skipped {phase: why}, elapsed_s.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

import jax

SCHEMA = "embark_jax.gpu_step/1"
# The dense net of the embedding-only step: the embedding outputs still reach a loss.
MINIMAL_DENSE = {"bottom": (1,), "top": (1,), "cross_layers": 0, "cross_rank": 1}


def train_defaults(**overrides) -> argparse.Namespace:
    """`python -m embark_jax train`'s defaults (its own parser), with `overrides`."""
    from embark_jax.cli.train_args import add_train_args

    p = argparse.ArgumentParser()
    add_train_args(p)
    args = p.parse_args([])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def sparse_optimizer(name: str, lr: float):
    from embark_jax.ops import optimizers as O

    classes = {
        "sgd": O.SGD,
        "adagrad": O.Adagrad,
        "rowwise_adagrad": O.RowWiseAdagrad,
        "adam": O.Adam,
    }
    return classes[name](learning_rate=lr)


def model_spec(args, optimizer):
    """The preset, capped as asked, priced with the optimizer's slots."""
    from embark_jax.planner import load_preset

    spec = load_preset(args.model)
    tables = tuple(
        dataclasses.replace(
            t,
            vocab_size=min(t.vocab_size, args.max_vocab) if args.max_vocab else t.vocab_size,
            hotness=min(t.hotness, args.max_hotness) if args.max_hotness else t.hotness,
        )
        for t in spec.tables
    )
    return dataclasses.replace(spec, tables=tables, slot_footprint=optimizer.slot_footprint)


def memory_analysis(compiled) -> dict | None:
    try:
        m = compiled.memory_analysis()
    except Exception:  # not every backend reports it
        return None
    if m is None:
        return None
    got = {
        k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
        for k in ("argument", "output", "alias", "temp", "generated_code")
    }
    got["peak_estimate"] = got["argument"] + got["output"] - got["alias"] + got["temp"]
    return got


def device_memory(devices) -> dict | None:
    """The largest of each `memory_stats()` counter over `devices` (None on CPU)."""
    stats = [d.memory_stats() for d in devices]
    stats = [s for s in stats if s]
    if not stats:
        return None
    keys = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")
    return {k: max(int(s.get(k, 0)) for s in stats) for k in keys}


class Job:
    """Builds and times one step function on pre-placed batches."""

    def __init__(self, args, config, plan, dense, placed_batches_of):
        import optax

        from embark_jax.core.options import RuntimeOptions
        from embark_jax.training import state as train_state

        opt = sparse_optimizer(args.optimizer, args.lr)
        options = RuntimeOptions(overflow=args.overflow_policy)
        self.setup, self.state = train_state.create(
            config,
            plan,
            dense=dense,
            sparse_optimizer=opt,
            dense_optimizer=optax.adam(args.dense_lr),
            seed=args.seed,
            options=options,
        )
        self.batches = placed_batches_of(self.setup)

    def compile(self):
        from embark_jax.training.step import compile_train_step

        step = compile_train_step(self.setup, donate=True)
        t0 = time.perf_counter()
        lowered = step.lower(self.state, self.batches[0])
        t1 = time.perf_counter()
        self.compiled = lowered.compile()
        return t1 - t0, time.perf_counter() - t1

    def run(self, i: int) -> float:
        t0 = time.perf_counter()
        self.state, out = self.compiled(self.state, self.batches[i % len(self.batches)])
        jax.block_until_ready((self.state, out))  # the committed tables: the whole step
        return time.perf_counter() - t0

    def timed(self, steps: int, warmup: int) -> list[float]:
        for i in range(warmup):
            self.run(i)
        return [self.run(warmup + i) for i in range(steps)]

    def close(self):
        self.state = self.compiled = self.batches = None
        gc.collect()


def _times(times: list[float]) -> dict:
    return {"times_s": times, "median_s": statistics.median(times), "min_s": min(times)}


def measure(
    batch: int,
    steps: int = 10,
    warmup: int = 2,
    *,
    max_vocab: int | None = None,
    max_hotness: int | None = None,
    num_devices: int | None = None,
    topology: str | None = None,
    embedding_only: bool = True,
    budget_s: float | None = None,
    out: str | None = None,
    say=print,
) -> dict:
    """Runs the phases of the module docstring; returns (and writes to `out`) the JSON."""
    import jax

    from embark_jax.data.synthetic import SyntheticDataset
    from embark_jax.planner import evaluate, get_hardware, plan
    from embark_jax.planner.memory import plan_memory
    from embark_jax.training.models import DenseConfig

    t_start = time.perf_counter()
    args = train_defaults(
        batch_size=batch, max_vocab=max_vocab, max_hotness=max_hotness, topology=topology
    )
    devices = jax.devices()[: num_devices or len(jax.devices())]
    g = len(devices)
    backend = jax.default_backend()
    opt = sparse_optimizer(args.optimizer, args.lr)
    spec = model_spec(args, opt)
    hw = get_hardware(args.topology or ("h200" if backend == "gpu" else "local"), 1, g)
    result = {
        "schema": SCHEMA,
        "backend": backend,
        "devices": g,
        "device_kind": devices[0].device_kind,
        "jax": jax.__version__,
        "model": args.model,
        "batch": batch,
        "optimizer": args.optimizer,
        "caps": {"max_vocab": max_vocab, "max_hotness": max_hotness},
        "topology": hw.name,
        "phases": [],
    }

    def done(phase: str) -> None:
        result["phases"].append(phase)
        result["elapsed_s"] = time.perf_counter() - t_start
        if out:
            with open(out, "w") as fh:
                json.dump(result, fh, indent=1)

    # 1. plan and prediction
    ev = plan(spec, batch, hw)
    config = spec.embedding_config()
    dense = DenseConfig.mini(args.model_kind)
    host = [SyntheticDataset(config, batch_size=batch, seed=args.seed).batch(i) for i in range(2)]

    def placed(setup):
        return [jax.device_put(b, setup.table_sharding) for b in host]

    job = Job(args, config, ev.plan, dense, placed)
    params = int(sum(x.size for x in jax.tree.leaves(job.state.dense_params)))
    priced = dataclasses.replace(
        spec, dense_params=params, dense_flops_per_sample=2.0 * params
    )  # what runs: the mini dense net, one multiply-add per parameter per sample
    pred = evaluate(priced, ev.plan, hw)
    step_mem = plan_memory(priced, ev.plan, hw)
    # the embedding step as the runtime lays it out, plus the dense net: its parameters and
    # Adam moments, and three parameter-sized temporaries (the gradient, its all-reduced copy,
    # the update); its activations are not modelled
    predicted_mem = step_mem.total + (3 + 3) * 4 * params
    result["plan"] = {
        "name": ev.name,
        "clusters": {
            c: sum(1 for t in ev.plan.tables if t.cluster.value == c) for c in ("dp", "rb", "ub")
        },
        "dense_params": params,
    }
    result["predicted"] = {
        "step_ms": pred.step_s * 1e3,
        "embedding_ms": pred.embedding_s * 1e3,
        "dense_ms": pred.dense_s * 1e3,
        "embedding_share": pred.embedding_s / pred.step_s if pred.step_s else None,
        "device_memory_bytes": predicted_mem,
        "step_memory": {**dataclasses.asdict(step_mem), "total": step_mem.total},
    }
    say(
        f"{args.model} batch {batch} on {g} {backend} device(s): plan {result['plan']['clusters']}"
        f", predicted step {pred.step_s * 1e3:.2f} ms, {predicted_mem / 1e6:.1f} MB/device"
    )
    done("plan")

    # 2. compile, memory analysis, whole-buffer ops
    from embark_jax.sharding import hlo_scan
    from embark_jax.training.step_cost import state_buffers

    lower_s, compile_s = job.compile()
    result["compile"] = {"lower_s": lower_s, "compile_s": compile_s}
    result["memory_analysis"] = memory_analysis(job.compiled)
    bufs = state_buffers(job.state, len(job.setup.mesh.devices.flat))
    found = hlo_scan.scan(job.compiled.as_text(), bufs)
    result["hlo"] = {"buffers": len(bufs), **hlo_scan.summary(found)}
    say(
        f"compiled in {compile_s:.1f} s; whole-table/slot ops in the step: {len(found)} "
        f"({result['hlo']['copies']} copies: {', '.join(result['hlo']['copied_buffers'])})"
    )
    done("compile")

    # 3. first and steady-state steps
    first = job.run(0)
    times = job.timed(steps, warmup)
    result["step"] = {"first_s": first, **_times(times)}
    result["step"]["samples_per_s"] = batch / result["step"]["median_s"]
    say(
        f"step: first {first * 1e3:.1f} ms, median {result['step']['median_s'] * 1e3:.2f} ms "
        f"(min {result['step']['min_s'] * 1e3:.2f}), {result['step']['samples_per_s']:.0f} "
        f"samples/s"
    )
    done("step")

    # 4. device memory against the prediction
    mem = device_memory(devices)
    est = (result["memory_analysis"] or {}).get("peak_estimate")
    result["memory"] = {
        "device": mem,
        "peak_vs_predicted": mem["peak_bytes_in_use"] / predicted_mem if mem else None,
        "estimate_vs_predicted": est / predicted_mem if est else None,
    }
    shown = f"peak {mem['peak_bytes_in_use'] / 1e9:.2f} GB" if mem else "no device counters"
    say(
        f"memory: {shown}; compiled estimate {(est or 0) / 1e9:.3f} GB; predicted "
        f"{predicted_mem / 1e9:.3f} GB"
    )
    done("memory")
    job.close()

    # 5. the embedding part alone: a second compile, about as long as the first
    spent = time.perf_counter() - t_start
    if embedding_only and budget_s is not None and spent > budget_s / 2:
        embedding_only = False
        result["skipped"] = {
            "embedding_only": f"{spent:.0f} s of the {budget_s:.0f} s budget spent"
        }
        say(f"embedding part alone: skipped ({result['skipped']['embedding_only']})")
        done("skipped")
    if embedding_only:
        small = dataclasses.replace(dense, **MINIMAL_DENSE)
        emb = Job(args, config, ev.plan, small, placed)
        emb.compile()
        emb.run(0)
        times = emb.timed(steps, warmup)
        emb.close()
        share = statistics.median(times) / result["step"]["median_s"]
        result["embedding_only"] = {"dense": MINIMAL_DENSE, **_times(times), "share": share}
        say(
            f"embedding part alone: median {statistics.median(times) * 1e3:.2f} ms, "
            f"{100 * share:.0f}% of the step (predicted "
            f"{100 * (result['predicted']['embedding_share'] or 0):.0f}%)"
        )
        done("embedding_only")
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=65536, help="global batch (default 65536)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    ap.add_argument("--max-vocab", type=int, default=None, help="cap every table's rows")
    ap.add_argument("--max-hotness", type=int, default=None, help="cap every feature's hotness")
    ap.add_argument("--devices", type=int, default=None, help="devices to use (default: all)")
    ap.add_argument(
        "--topology", default=None, help="hardware the planner prices (default: h200 on a GPU)"
    )
    ap.add_argument("--no-embedding-only", action="store_true", help="skip the minimal-dense step")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip the minimal-dense step when over half of this is spent at its start",
    )
    ap.add_argument("--out", default="results/gpu_step.json")
    a = ap.parse_args(argv)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    result = measure(
        a.batch,
        a.steps,
        a.warmup,
        max_vocab=a.max_vocab,
        max_hotness=a.max_hotness,
        num_devices=a.devices,
        topology=a.topology,
        embedding_only=not a.no_embedding_only,
        budget_s=a.budget_s,
        out=a.out,
    )
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
