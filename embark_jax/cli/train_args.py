"""The flags of `python -m embark_jax train` and their parsers (`embark_jax.cli.train`
runs the job)."""

from __future__ import annotations

import argparse
import os

from embark_jax.cli.errors import (
    model_name,
    models_help,
    nonneg_int,
    positive_float,
    positive_int,
    topology_name,
)
from embark_jax.cli.flags import add_batch_size, add_choice, add_counts
from embark_jax.cli.train_dynamic import add_dynamic_args
from embark_jax.core.options import OverflowPolicy

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
DEFAULT_BATCH = 1024


def lr_schedule(text: str):
    """`--lr-schedule`'s value (`training.schedules.WarmupDecay.parse`)."""
    from embark_jax.training.schedules import WarmupDecay

    try:
        return WarmupDecay.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_name, default="dcnv2-mini", help=models_help())
    p.add_argument(
        "--plan",
        default=None,
        help="plan JSON file from `plan --out` (default: the planner's plan for this run)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        choices=("tw", "rw", "trw", "dp"),
        help="use a baseline plan instead of the planner's (default: the planner's plan)",
    )
    p.add_argument(
        "--plan-out", default=None, help="write the plan used as JSON here (default: not written)"
    )
    p.add_argument(
        "--data",
        type=data_source,
        default="synthetic",
        help="training data: synthetic (Zipf ids), criteo-tsv:PATH (Kaggle/Terabyte TSV "
        "file) or criteo-multihot:DIR (MLPerf DLRMv2 day_X_{labels,dense}.npy + "
        "day_X_sparse_multi_hot.npz); Criteo needs a 26-table preset (default: synthetic)",
    )
    add_counts(p, {"--steps": (200, "training steps")})
    add_batch_size(p, f"the --plan file's batch, else {DEFAULT_BATCH}")
    _add_model_args(p)
    add_dynamic_args(p)
    _add_output_args(p)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--optimizer", default="adagrad", choices=OPTIMIZERS, help="sparse optimizer")
    p.add_argument("--lr", type=positive_float, default=0.05, help="sparse learning rate")
    p.add_argument("--dense-lr", type=positive_float, default=1e-3, help="dense Adam rate")
    p.add_argument(
        "--lr-schedule",
        type=lr_schedule,
        default=None,
        metavar="warmup=N,decay_start=N,decay_steps=N",
        help="MLPerf DLRM's schedule for --lr and --dense-lr: linear warm-up from 0, then "
        "constant, then polynomial (power 2) decay to 0; evaluated on the device every step, "
        "no recompiling (default: constant rates)",
    )
    p.add_argument("--dense-net", default="mini", choices=("mini", "paper"), help="MLP sizes")
    p.add_argument("--model-kind", default="dcnv2", choices=("dcnv2", "dlrm"), help="dense model")
    p.add_argument(
        "--mixed-precision",
        action="store_true",
        help="bf16 activations and bf16 embedding communication (tables stay fp32)",
    )
    add_counts(
        p,
        {
            "--nodes": (1, "mesh nodes (2-D mesh if > 1)"),
            "--devices": (8, "fake CPU devices when there is no GPU"),
        },
    )
    p.add_argument(
        "--topology",
        type=topology_name,
        default=None,
        help="hardware the planner prices (default: local on CPU, h200 on GPU)",
    )
    p.add_argument(
        "--max-hotness",
        type=positive_int,
        default=None,
        help="cap every feature's hotness (default: no cap)",
    )
    p.add_argument(
        "--max-vocab",
        type=positive_int,
        default=None,
        help="cap every table's vocabulary (default: no cap)",
    )
    p.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    p.add_argument("--eval-batches", type=positive_int, default=4, help="held-out batches")
    p.add_argument("--log-every", type=positive_int, default=10, help="steps per progress line")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results/train_metrics.json", help="metrics JSON")
    p.add_argument(
        "--log-dir",
        default=None,
        help="write per-step metrics here: metrics.jsonl (JSON lines) and a TensorBoard "
        "event file (`tensorboard --logdir DIR`) (default: none)",
    )
    p.add_argument(
        "--checkpoint-dir", default=None, help="save Orbax checkpoints here (default: none)"
    )
    p.add_argument(
        "--save-every",
        type=nonneg_int,
        default=0,
        help="steps between checkpoints (0: only at the end when --checkpoint-dir is set)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="restore the newest checkpoint in --checkpoint-dir (any plan or "
        "device count) and continue from its data position",
    )
    add_choice(
        p,
        "--overflow-policy",
        OverflowPolicy.COUNT,
        "what ids beyond a routing buffer's capacity do: counted, an error, or the buffers grow",
    )
    # fault injection for the multi-process tests: process P exits (code 3) before batch S
    p.add_argument("--debug-exit-at", default=None, metavar="P:S", help=argparse.SUPPRESS)
    p.add_argument(
        "--async-checkpoint",
        action="store_true",
        help="write checkpoints in the background (single process)",
    )


DATA_KINDS = ("synthetic", "criteo-tsv", "criteo-multihot")


def data_source(text: str) -> str:
    """`synthetic`, `criteo-tsv:PATH` (an existing file) or `criteo-multihot:DIR` (an
    existing directory)."""
    kind, sep, path = text.partition(":")
    if kind == "synthetic" and not sep:
        return text
    if kind not in DATA_KINDS[1:] or not path:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not synthetic, criteo-tsv:PATH or criteo-multihot:DIR"
        )
    if kind == "criteo-tsv" and not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{kind}: {path!r} is not a file")
    if kind == "criteo-multihot" and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{kind}: {path!r} is not a directory")
    return text
