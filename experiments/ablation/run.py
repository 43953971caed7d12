"""EMBark's incremental breakdown on 8 fake CPU devices, predicted and measured (the code of
`ablation.ipynb` beside this file).

Five stages, each adding one idea to the previous one, all on a 2 x 4 mesh (two "nodes" of
four fake CPU devices, so that hierarchical RB has nodes to reduce inside):

  trw       the paper's baseline: table i row-split over the devices of node i mod 2
  clusters  each table in its cheapest cluster (DP, RB or UB) by the cost model, one shard
            per table (`plan(..., targeted=False, max_rounds=0, max_moves=0)`: no splits
            beyond what memory forces, no moves)
  3d        the planner's full plan: row and column splits, placement, rebalancing
  hier      + hierarchical RB: partial vectors summed inside a node before crossing nodes
  bf16      + embedding vectors and their gradients travel as bfloat16

Stages trw..3d run RB flat (`RuntimeOptions(hierarchical=False)`); the planner always prices
hierarchical RB on several nodes, so `predict` re-prices each plan with the cost model's
own functions (`embark_jax.planner.cost`) with the flag and the wire dtype of the stage.

Measured: every stage is compiled and warmed up, then the stages take turns one step each
(a slow phase of the shared machine hits all alike); median step time and its spread. Bytes
per device and step from the step's HLO, in the planner's convention (`link_bytes`): the
embedding collectives as JAX lowers the step (in their wire dtype; XLA's CPU backend later
widens bf16 collectives to f32 and its partitioner adds the dense net's gradient all-reduce),
and every collective of the compiled step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from unittest import mock

import numpy as np

from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Cluster
from embark_jax.planner import baseline, evaluate, get_hardware, load_preset, plan
from embark_jax.planner import cost as C

STAGES = ("trw", "clusters", "3d", "hier", "bf16")
LABELS = {
    "trw": "TRW",
    "clusters": "+ clusters by cost",
    "3d": "+ 3D splits",
    "hier": "+ hierarchical RB",
    "bf16": "+ bf16 comm",
}


def capped_spec(preset: str, max_vocab: int, max_hot: int | None, tables: int | None = None):
    """The preset with vocabularies capped at `max_vocab`, hotness at `max_hot`, the first
    `tables` tables only (None: all), priced with SGD (no optimizer slots), as trained."""
    spec = load_preset(preset)
    ts = tuple(
        dataclasses.replace(
            t,
            vocab_size=min(t.vocab_size, max_vocab),
            hotness=min(t.hotness, max_hot) if max_hot else t.hotness,
        )
        for t in spec.tables[:tables]
    )
    return dataclasses.replace(spec, tables=ts, slot_footprint=(0, 0))


def stage_plans(spec, batch: int, hw) -> dict[str, tuple]:
    """`{stage: (plan, RuntimeOptions)}`."""
    trw = baseline(spec, batch, hw, "trw").plan
    clusters = plan(
        spec, batch, hw, targeted=False, max_rounds=0, max_moves=0, compare_baselines=False
    ).plan
    full = plan(spec, batch, hw, compare_baselines=False).plan
    flat = RuntimeOptions(hierarchical=False)
    return {
        "trw": (trw, flat),
        "clusters": (clusters, flat),
        "3d": (full, flat),
        "hier": (full, RuntimeOptions(hierarchical=True)),
        "bf16": (full, RuntimeOptions(hierarchical=True, comm_dtype="bfloat16")),
    }


@contextlib.contextmanager
def runtime_variant(*, hierarchical: bool = True, wire_bytes: int | None = None):
    """Inside the block the cost model prices RB flat (`hierarchical=False`) and/or the
    embedding vectors of RB and UB on the wire in `wire_bytes` bytes per element (their
    compute and memory unchanged). The planner itself always prices hierarchical RB on
    several nodes and vectors in the table's dtype; this wraps the same cost functions
    (`embark_jax.planner.cost.rb_shard_cost`, `ub_shard_cost`) rather than copying them."""
    rb, ub = C.rb_shard_cost, C.ub_shard_cost

    def variant(fn, flat):
        def priced(t, *args, **kwargs):
            if flat:
                kwargs["hierarchical"] = False
            c = fn(t, *args, **kwargs)
            if wire_bytes is None:
                return c
            w = fn(dataclasses.replace(t, dtype_bytes=wire_bytes), *args, **kwargs)
            return dataclasses.replace(c, intra=w.intra, inter=w.inter)

        return priced

    with (
        mock.patch.object(C, "rb_shard_cost", variant(rb, not hierarchical)),
        mock.patch.object(C, "ub_shard_cost", variant(ub, False)),
    ):
        yield


def predict(spec, plan_, hw, *, hierarchical: bool = True, wire_bytes: int | None = None):
    """The cost model's prediction for `plan_` run with hierarchical RB on or off and
    embedding vectors on the wire in `wire_bytes` bytes per element (None: the table's):
    step and embedding seconds (busiest device), and the link bytes per step of the device
    that moves the most (intra / inter node)."""
    with runtime_variant(hierarchical=hierarchical, wire_bytes=wire_bytes):
        ev = evaluate(spec, plan_, hw)
    intra = ev.device_intra * hw.intra_bw  # seconds on the links -> bytes
    inter = ev.device_inter * hw.inter_bw
    d = int(np.argmax(intra + inter))
    return {
        "step_s": ev.step_s,
        "embedding_s": ev.embedding_s,
        "comm_bytes": float(intra[d] + inter[d]),
        "intra_bytes": float(intra[d]),
        "inter_bytes": float(inter[d]),
    }


def build(spec, plan_, options, batch: int, seed: int = 0):
    """Setup and state of one stage: the mini DCNv2 dense net, SGD on the tables, Adam on
    the dense net."""
    import optax

    from embark_jax.ops import optimizers as O
    from embark_jax.training.models import DenseConfig
    from embark_jax.training.state import create

    return create(
        spec.embedding_config(),
        plan_,
        dense=DenseConfig.mini(),
        sparse_optimizer=O.SGD(learning_rate=0.05),
        dense_optimizer=optax.adam(1e-3),
        options=options,
        seed=seed,
    )


def link_bytes(hlo, mesh) -> dict[str, float]:
    """Intra- and inter-node bytes a device sends per step in the collectives of `hlo`
    (compiled, or HLO text), in the planner's convention (`hlo_bytes.wire_bytes`: the own
    slice of an all-to-all stays, an all-reduce is priced as a ring)."""
    from embark_jax.sharding import hlo_bytes

    shape = tuple(mesh.shape.values())
    if hasattr(hlo_bytes, "wire_bytes"):
        return hlo_bytes.wire_bytes(hlo, shape, mesh.axis_names)
    return hlo_bytes.link_bytes(hlo_bytes.collective_bytes(hlo, shape, mesh.axis_names), shape)


def measure(spec, stages: dict[str, tuple], batch: int, steps: int, n_batches: int = 3):
    """Median and spread of the step time of every stage (taking turns, batches placed on
    the devices before the timer), and the collective bytes per device of its compiled
    step (total, intra / inter node); one row per stage."""
    import jax

    from embark_jax.data.synthetic import SyntheticDataset
    from embark_jax.training.step import compile_train_step

    ds = SyntheticDataset(spec.embedding_config(), batch_size=batch, seed=0)
    host = [ds.batch(i) for i in range(n_batches)]
    runs = {}
    for name, (plan_, options) in stages.items():
        t0 = time.perf_counter()
        setup, state = build(spec, plan_, options, batch)
        placed = [jax.device_put(b, setup.table_sharding) for b in host]
        lowered = compile_train_step(setup).lower(state, placed[0])
        step = lowered.compile()
        mesh = setup.mesh
        links = {  # the program's own collectives (before XLA), and all of the compiled step
            "embedding": link_bytes(lowered.as_text(dialect="hlo"), mesh),
            "compiled": link_bytes(step, mesh),
        }
        params = int(sum(x.size for x in jax.tree.leaves(state.dense_params)))
        state, out = step(state, placed[0])  # warm up
        jax.block_until_ready(out["loss"])
        runs[name] = {
            "state": state,
            "step": step,
            "placed": placed,
            "links": links,
            "compile_s": time.perf_counter() - t0,
            "dense_params": params,
        }
    times = {k: [] for k in runs}
    for i in range(steps):
        for k, r in runs.items():
            b = r["placed"][(i + 1) % len(r["placed"])]
            t0 = time.perf_counter()
            r["state"], out = r["step"](r["state"], b)
            jax.block_until_ready(out["loss"])
            times[k].append(time.perf_counter() - t0)
    rows = []
    for k, r in runs.items():
        ms = sorted(t * 1e3 for t in times[k])
        q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
        emb, comp = r["links"]["embedding"], r["links"]["compiled"]
        rows.append(
            {
                "stage": k,
                "dense_params": r["dense_params"],
                "step_ms": statistics.median(ms),
                "step_ms_iqr": q[2] - q[0],
                "steps_per_s": 1e3 / statistics.median(ms),
                "embedding_bytes": emb["intra"] + emb["inter"],
                "embedding_inter_bytes": emb["inter"],
                "compiled_bytes": comp["intra"] + comp["inter"],
                "compile_s": r["compile_s"],
            }
        )
    return rows


def ablation(name: str, preset, max_vocab, max_hot, batch, *, steps: int, tables=None):
    """Predicted and measured rows of every stage for one model on the local 2 x 4 mesh,
    and the local topology used. The prediction prices what runs: the capped tables, SGD
    (no slots) and the mini dense net (its parameter count, one multiply-add per parameter
    and sample); `dgx_*` prices the same plans on a 2 x 4 slice of DGX-H100 nodes, where
    crossing nodes is 9x slower than NVLink (on fake CPU devices every link is memory)."""
    spec = capped_spec(preset, max_vocab, max_hot, tables)
    hw = get_hardware("local", 2, 4)
    dgx = get_hardware("dgx-h100", 2, 4)
    stages = stage_plans(spec, batch, hw)
    measured = {r["stage"]: r for r in measure(spec, stages, batch, steps)}
    params = measured["trw"]["dense_params"]
    priced = dataclasses.replace(spec, dense_params=params, dense_flops_per_sample=2.0 * params)
    rows = []
    for k, (plan_, options) in stages.items():
        how = {
            "hierarchical": options.hierarchical,
            "wire_bytes": 2 if options.comm_dtype.value == "bfloat16" else None,
        }
        pred = predict(priced, plan_, hw, **how)
        on_dgx = predict(priced, plan_, dgx, **how)  # the same 2 x 4 shape
        clusters = {
            cl.value: sum(1 for t in plan_.tables if t.cluster is cl)
            for cl in (Cluster.DP, Cluster.RB, Cluster.UB)
        }
        split = sum(1 for t in plan_.tables if t.row_shards * t.column_shards > 1)
        rows.append(
            {
                "model": name,
                "stage": k,
                "label": LABELS[k],
                "batch": batch,
                "tables": len(plan_.tables),
                "clusters": clusters,
                "split_tables": split,
                "pred_step_ms": pred["step_s"] * 1e3,
                "pred_embedding_ms": pred["embedding_s"] * 1e3,
                "pred_comm_bytes": pred["comm_bytes"],
                "pred_inter_bytes": pred["inter_bytes"],
                "dgx_step_ms": on_dgx["step_s"] * 1e3,
                "dgx_embedding_ms": on_dgx["embedding_s"] * 1e3,
                **{f"meas_{a}": b for a, b in measured[k].items() if a != "stage"},
            }
        )
    return rows, hw
