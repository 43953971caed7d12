"""Raw hashed ids against a vocabulary: `train` on a Criteo TSV file twice, once with every
table vocabulary-mapped (`hex mod vocab_size`) and once with the largest tables dynamic
(keyed by the raw 64-bit value, no vocabulary); same data, seed, steps and held-out samples.

    python -m experiments.dynamic.criteo_auc                  # -> results/dynamic_criteo_auc.json
    python -m experiments.dynamic.criteo_auc --quick          # a small file, few steps

There is no network here, so the file is written first (`write_tsv`): Criteo's layout (a
label, 13 integers, 26 hex fields of 8 digits, some empty), each column's ids drawn from a
Zipf law over its own set of random 32-bit values (as many as the preset table's rows), and
labels from a hidden teacher (a fixed score per column and raw id, a weight per dense
feature). Each run is a `python -m embark_jax train` subprocess; eval AUC is on the file's
last `--eval-batches` batches, held out from training. Noise: the same two runs with
another `--seed` (data order and initialisation; the file stays).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from embark_jax.data.synthetic import zipf_ranks

NUM_DENSE, NUM_CATEGORICAL = 13, 26


def write_tsv(path, num_samples: int, vocabs, *, seed: int = 0, alpha: float = 1.05) -> None:
    """`num_samples` Criteo TSV lines (module docstring) at `path`; `vocabs`: the number
    of distinct raw ids of each of the 26 columns."""
    rng = np.random.default_rng([seed, 11])
    n = int(num_samples)
    logit = np.zeros(n)
    cols = []
    for v in vocabs:
        values = rng.choice(2**32, size=int(v), replace=False).astype(np.uint64)
        score = rng.uniform(-1.0, 1.0, size=int(v))
        rank = zipf_ranks(rng, alpha, int(v), n)
        missing = rng.random(n) < 0.05
        logit += np.where(missing, 0.0, score[rank])
        cols.append(np.where(missing, "", np.char.mod("%08x", values[rank])))
    dense = rng.integers(0, 1000, size=(n, NUM_DENSE))
    weights = rng.normal(size=NUM_DENSE) / math.sqrt(NUM_DENSE)
    logit = 3.0 * logit / math.sqrt(len(vocabs)) + (np.log1p(dense) - 3.5) @ weights * 0.5
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    with open(path, "w") as fh:
        for i in range(n):
            fields = [str(labels[i]), *map(str, dense[i]), *(c[i] for c in cols)]
            fh.write("\t".join(fields) + "\n")


def run_train(path, out, *, dynamic: str | None, args) -> dict:
    """One `train` subprocess; its metrics JSON."""
    cmd = [
        sys.executable,
        "-m",
        "embark_jax",
        "train",
        *("--data", f"criteo-tsv:{path}", "--model", args.model),
        *("--steps", str(args.steps), "--batch-size", str(args.batch_size)),
        *("--eval-batches", str(args.eval_batches), "--devices", str(args.devices)),
        *("--max-hotness", "1", "--seed", str(args.seed), "--out", str(out)),
        *("--log-every", str(max(1, args.steps // 5)), "--optimizer", "rowwise_adagrad"),
        *("--lr", str(args.lr)),
    ]
    if dynamic:
        cmd += ["--dynamic-tables", dynamic]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    metrics = json.loads(pathlib.Path(out).read_text())
    metrics["wall_s_total"] = time.perf_counter() - t0
    return metrics


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="dcnv2-mini")
    ap.add_argument("--samples", type=int, default=200_000, help="lines of the written file")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--dynamic-tables", default="13", help="as `train --dynamic-tables`")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seeds", default="0,1", help="training seeds (data order, init)")
    ap.add_argument("--workdir", default="/tmp/embark_criteo_auc")
    ap.add_argument("--quick", action="store_true", help="a small file and few steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.steps, args.batch_size, args.eval_batches = 4096, 40, 128, 4
    out = pathlib.Path(
        args.out
        or (
            "results/dynamic_criteo_auc_quick.json"
            if args.quick
            else "results/dynamic_criteo_auc.json"
        )
    )
    from embark_jax.planner import load_preset

    vocabs = [t.vocab_size for t in load_preset(args.model).tables]
    work = pathlib.Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    tsv = work / "train.tsv"
    print(f"writing {args.samples} samples to {tsv}", flush=True)
    write_tsv(tsv, args.samples, vocabs)
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        args.seed = seed
        for label, dyn in (("vocabulary", None), ("dynamic", args.dynamic_tables)):
            m = run_train(tsv, work / f"{label}_{seed}.json", dynamic=dyn, args=args)
            runs.append(
                {
                    "run": label,
                    "seed": seed,
                    "eval_auc": m["eval_auc"],
                    "eval_logloss": m["eval_logloss"],
                    "samples_per_s": m["samples_per_s"],
                    "wall_s": m["wall_s_total"],
                    "dynamic": m["dynamic"],
                }
            )
            print(
                f"seed {seed} {label:10s} eval AUC {m['eval_auc']:.4f} logloss "
                f"{m['eval_logloss']:.4f}  {m['samples_per_s']:.0f} samples/s",
                flush=True,
            )
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "workdir")},
        "runs": runs,
        "auc_difference": _differences(runs),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"dynamic - vocabulary eval AUC per seed: {result['auc_difference']}; wrote {out}")
    return result


def _differences(runs) -> list[float]:
    by = {(r["run"], r["seed"]): r["eval_auc"] for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    return [by[("dynamic", s)] - by[("vocabulary", s)] for s in seeds]


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
