"""Step cost benchmark: does a training step cost what its batch costs, whatever the tables?

    python -m experiments.training.step_cost [--rows 1e5,3e5,1e6,2e6,4e6] [--rounds 5]
        [--steps 5] [--out results/step_cost.json]
    python -m experiments.training.step_cost --main-job --rows "" --out results/step_cost_main.json

Part 1, table size (one CPU device): one table of V x 64 float32 with row-wise Adagrad, a
batch of 4096 samples x 8 ids (Zipf), the mini DCNv2 dense net; V from 1e5 to 4e6 at the
same batch. For each V two contenders take turns, round after round (the machine is shared
and noisy, so a slow phase hits every contender alike):

- `bare`: the jitted, donated `train_step` (`compile_train_step`), called back to back;
- `runner`: `StepRunner.step` on the same batches (its metrics, one-step-late checks and
  batch placement included), the way `fit` calls it.

Each round runs `--steps` steps of a contender and waits for the last one: time per step is
the round's wall time over its steps (steady state: the host never waits for a step in the
middle). The first step, which compiles, is timed apart. Reported per V: median and min over
rounds, the ratio to the smallest V (a step whose cost grew with the table would show it),
the runner's overhead over the bare step, and the compiled step's `memory_analysis()` (bytes
aliased, temporaries) with the whole-table operations found in its HLO (none expected).

Part 2, the main job (`--main-job`): `python -m embark_jax train`'s model and plan on 8 fake
devices, bare step vs runner, the same alternating rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from embark_jax.training.distributed import initialize_from_env

DIM, HOT, BATCH = 64, 8, 4096


def _setup_one_table(vocab: int):
    import embark_jax as ej
    from embark_jax.ops import optimizers as O
    from embark_jax.training import state as train_state
    from embark_jax.training.models import DenseConfig

    config = ej.EmbeddingConfig.create(
        [ej.TableConfig(name="t", vocab_size=vocab, dim=DIM)],
        [ej.FeatureConfig(name="f", table="t", max_hotness=HOT)],
    )
    plan = ej.Plan(
        topology=ej.Topology(num_nodes=1, devices_per_node=1),
        batch_size=BATCH,
        tables=(
            ej.TablePlan(name="t", cluster="rb", row_shards=1, column_shards=1, devices=((0,),)),
        ),
    )
    opt = O.RowWiseAdagrad(learning_rate=0.01)
    return config, lambda: train_state.create(
        config, plan, dense=DenseConfig.mini(), sparse_optimizer=opt
    )


class Contender:
    """One way of running steps on its own state: `bare` or `runner`."""

    def __init__(self, kind: str, make, host_batches):
        import jax

        from embark_jax.training.runner import StepRunner
        from embark_jax.training.step import compile_train_step

        self.kind = kind
        self.setup, self.state = make()
        self.runner = StepRunner(self.setup)
        self.step_fn = compile_train_step(self.setup)
        self.placed = [jax.device_put(b, self.setup.table_sharding) for b in host_batches]
        self.host = host_batches
        self.i = 0

    def one(self):
        batch = self.placed[self.i % len(self.placed)]
        self.i += 1
        if self.kind == "bare":
            self.state, out = self.step_fn(self.state, batch)
            return out["loss"]
        self.state, result = self.runner.step(self.state, batch, position=self.i)
        return result.loss

    def timed(self, steps: int) -> float:
        """Seconds per step of `steps` steps run back to back (waits for the last one)."""
        import jax

        t0 = time.perf_counter()
        for _ in range(steps):
            loss = self.one()
        jax.block_until_ready((loss, self.state))
        if self.kind == "runner":
            self.runner.sync()
        return (time.perf_counter() - t0) / steps

    def compiled(self):
        if self.kind == "bare":
            return self.step_fn.lower(self.state, self.placed[0]).compile()
        return self.runner.compiled_step(self.state, self.placed[0])


def _memory(c: Contender, num_devices: int) -> dict:
    from embark_jax.training.step_cost import memory_summary, whole_table_ops

    compiled = c.compiled()
    return {
        **memory_summary(compiled, c.state),
        "whole_table_ops": [f["name"] for f in whole_table_ops(compiled, c.state, num_devices)],
    }


def _stats(seconds: list[float]) -> dict:
    ms = [s * 1e3 for s in seconds]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "rounds_ms": ms}


def alternate(contenders: dict[str, Contender], rounds: int, steps: int) -> dict:
    """First steps (compile) timed apart, one warm-up round, then `rounds` rounds in turn."""
    import jax

    first = {}
    for name, c in contenders.items():
        t0 = time.perf_counter()
        jax.block_until_ready(c.one())
        first[name] = time.perf_counter() - t0
        c.timed(steps)  # warm-up
    times = {name: [] for name in contenders}
    for r in range(rounds):
        for name, c in contenders.items():
            times[name].append(c.timed(steps))
        print(f"  round {r + 1}/{rounds} done", flush=True)
    return {name: {"first_step_s": first[name], **_stats(times[name])} for name in contenders}


def bench_rows(rows: list[int], rounds: int, steps: int) -> list[dict]:
    import gc

    from embark_jax.data.synthetic import SyntheticDataset

    contenders, memory = {}, {}
    for vocab in rows:
        config, make = _setup_one_table(vocab)
        host = [SyntheticDataset(config, batch_size=BATCH, seed=0).batch(i) for i in range(4)]
        for kind in ("bare", "runner"):
            c = Contender(kind, make, host)
            contenders[(vocab, kind)] = c
            memory[(vocab, kind)] = _memory(c, 1)
        print(f"V={vocab:,}: built and compiled", flush=True)
    timed = alternate({f"{v}/{k}": c for (v, k), c in contenders.items()}, rounds, steps)
    out = []
    base = timed[f"{rows[0]}/runner"]["median_ms"]  # the smallest table: rows come sorted
    base_bare = timed[f"{rows[0]}/bare"]["median_ms"]
    for vocab in rows:
        r, b = timed[f"{vocab}/runner"], timed[f"{vocab}/bare"]
        row = {
            "rows": vocab,
            "table_mib": vocab * DIM * 4 / 2**20,
            "runner": r,
            "bare": b,
            "runner_vs_smallest": r["median_ms"] / base,
            "bare_vs_smallest": b["median_ms"] / base_bare,
            "runner_over_bare": r["median_ms"] / b["median_ms"],
            "memory_runner": memory[(vocab, "runner")],
            "memory_bare": memory[(vocab, "bare")],
        }
        out.append(row)
        mem = row["memory_runner"]
        print(
            f"V={vocab:>9,} ({row['table_mib']:7.1f} MiB): runner {r['median_ms']:7.2f} ms "
            f"(min {r['min_ms']:.2f}; {row['runner_vs_smallest']:.2f}x the smallest), bare "
            f"{b['median_ms']:7.2f} ms, runner/bare {row['runner_over_bare']:.3f}; temp "
            f"{mem['temp_bytes'] / 2**20:.1f} MiB ({mem['temp_fraction']:.1%} of the table), "
            f"aliased {mem['alias_bytes'] / 2**20:.1f} MiB, whole-table ops "
            f"{len(mem['whole_table_ops'])}",
            flush=True,
        )
    del contenders
    gc.collect()
    return out


def bench_main_job(rounds: int, steps: int) -> dict:
    """`train`'s defaults (dcnv2-mini, its planner plan, batch 1024) on the devices here."""
    import jax

    from embark_jax.cli.main import build_parser
    from embark_jax.cli.train import DEFAULT_BATCH, _build, _model_spec
    from embark_jax.data.synthetic import SyntheticDataset
    from embark_jax.planner import get_hardware, plan

    args = build_parser().parse_args(["train"])
    args.batch_size = args.batch_size or DEFAULT_BATCH
    spec = _model_spec(args)
    config = spec.embedding_config()
    hw = get_hardware("local", 1, len(jax.devices()))
    ev = plan(spec, args.batch_size, hw)
    ds = SyntheticDataset(config, batch_size=args.batch_size, seed=0)
    host = [ds.batch(i) for i in range(4)]

    def make():
        runner, state = _build(args, config, ev.plan)
        return runner.setup, state

    contenders = {kind: Contender(kind, make, host) for kind in ("bare", "runner")}
    timed = alternate(contenders, rounds, steps)
    ratio = timed["runner"]["median_ms"] / timed["bare"]["median_ms"]
    print(
        f"main job ({len(jax.devices())} devices, batch {args.batch_size}): runner "
        f"{timed['runner']['median_ms']:.1f} ms, bare {timed['bare']['median_ms']:.1f} ms, "
        f"runner/bare {ratio:.3f}",
        flush=True,
    )
    return {
        "devices": len(jax.devices()),
        "batch": args.batch_size,
        **timed,
        "runner_over_bare": ratio,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1e5,3e5,1e6,2e6,4e6", help="table rows, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=5, help="steps per contender per round")
    ap.add_argument("--main-job", action="store_true", help="also the main job, 8 devices")
    ap.add_argument("--out", default="results/step_cost.json")
    args = ap.parse_args(argv)
    rows = sorted(int(float(x)) for x in args.rows.split(",") if x)
    # part 1 on one device; the main job on `train`'s 8 (run the parts apart: --rows "")
    initialize_from_env(default_cpu_devices=8 if args.main_job else 1)
    result = {"rows": bench_rows(rows, args.rounds, args.steps) if rows else []}
    if args.main_job:
        result["main_job"] = bench_main_job(args.rounds, args.steps)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
