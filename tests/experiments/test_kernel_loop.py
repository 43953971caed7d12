"""The kernel benchmark's loop mode (experiments/kernels/loop.py, loop_cases.py) at tiny
shapes on the CPU: the production point set, K from the bytes, each loop computing exactly
what K calls of the op compute (the dependency between iterations changes no value), the
op staying inside the loop with no copy of its state, the device-time reader on a fake GPU
trace, and a run end to end with its JSON, checks, ratios, bars and time budget."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.profiler import ProfileData

from embark_jax import ops
from embark_jax.ops import optimizers as O
from embark_jax.sharding import hlo_scan
from experiments.kernels import loop, report
from experiments.kernels import loop_cases as LC
from experiments.kernels import points as P
from experiments.kernels.cases_jax import ffi_forward, xla_forward
from experiments.kernels.main import main as kernels_main

pytestmark = pytest.mark.smoke


def test_production_points_are_the_issues_shapes_most_valuable_first():
    quick = P.LOOP_QUICK
    pts = [p for p, _ in quick]
    assert {(p.batch, p.dim, p.vocab) for p in pts} == {(65_536, 128, 40_000_000)}
    assert {p.hotness for p in pts} == {1, 20, 80}
    assert {p.dtype for p in pts} == {"float32", "bfloat16"}
    assert {p.dist for p in pts} == {"uniform", "zipf"}
    assert {o for _, ops_ in quick for o in ops_} == set(P.LOOP_OPS)
    # first: the points with a bar, float32 forward and backward at hotness 20 and 80
    first = {(p.hotness, p.dist, p.dtype) for p, _ in quick[:4]}
    assert first == {(h, d, "float32") for h in (20, 80) for d in ("uniform", "zipf")}
    assert all(o == P.HEADLINE_OPS for _, o in quick[:4])
    # the full run adds 10M-row tables in both dtypes
    assert quick == P.LOOP_FULL[: len(quick)]
    assert {(p.vocab, p.dtype) for p, _ in P.LOOP_FULL} >= {
        (10_000_000, "float32"),
        (10_000_000, "bfloat16"),
    }
    p = pts[0]
    assert p.name == "B65536_L20_D128_V40000000_uniform"
    bf = P.production(80, "zipf", "bfloat16")
    assert bf.name.endswith("_zipf_bf16") and bf.label.endswith("zipf bf16")
    assert P.Point.from_json(bf.to_json()) == bf
    old = {k: v for k, v in p.to_json().items() if k != "dtype"}  # written before dtype
    assert P.Point.from_json(old) == p
    small = bf.capped(1024, 100_000)
    assert (small.batch, small.vocab, small.hotness, small.dtype) == (1024, 100_000, 80, bf.dtype)


def test_bytes_of_the_loop_ops():
    p, u = P.Point(64, 20, 128, 4096, "uniform"), 1000
    n = 64 * 20
    assert P.op_bytes("forward", p, u) == (n * 128 + 64 * 128) * 4
    bwd = (64 * 128 + n * 128) * 4 + 2 * u * 128 * 4
    assert P.op_bytes("backward_rowwise_adagrad", p, u) == bwd + 2 * u * 4
    assert P.op_bytes("backward_rowwise_adagrad", p, u) - P.op_bytes("backward_update", p, u) == (
        2 * u * 4
    )
    bf = P.Point(64, 20, 128, 4096, "uniform", "bfloat16")
    assert P.op_bytes("forward", bf, u) == (n * 128 + 64 * 128) * 2
    assert P.op_bytes("backward_rowwise_adagrad", bf, u) == (
        (64 * 128 + n * 128) * 4 + 2 * u * 128 * 2 + 2 * u * 4
    )


def test_iterations_follow_the_bytes_within_bounds():
    s = loop.Settings(target_bytes=1e6, k_min=2, k_max=100)
    assert loop.iters_for(1e4, s) == 100  # capped
    assert loop.iters_for(1e5, s) == 10
    assert loop.iters_for(1e9, s) == 2
    assert loop.iters_for(1e4, s, "unique") == loop.K_MAX_OP["unique"]
    gpu, cpu = loop.Settings().resolved("gpu"), loop.Settings().resolved("cpu")
    assert gpu.max_batch is None and cpu.max_batch == 1024 and gpu.target_bytes == 16e9
    assert loop.Settings(target_bytes=5.0).resolved("gpu").target_bytes == 5.0


def _expected(op, lib, d, k, rotate):
    """K plain calls of the op, in Python: what the loop must end with."""
    p = d.point
    ids0 = np.asarray(d.ids)

    def ids_at(i):
        if rotate:
            return jnp.asarray(LC.rotated_ids(ids0, i, p.vocab, k).astype(np.int32))
        return d.ids

    if op == "forward":
        pool = ffi_forward if lib == "embark" else xla_forward
        return [pool(d.table(), ids_at(k - 1), d.seg, p.batch)]
    if op == "backward_rowwise_adagrad":
        opt = O.RowWiseAdagrad(learning_rate=P.LEARNING_RATE)
        table, acc, g = d.fresh_table(), jnp.zeros((p.vocab,)), d.grads()
        for i in range(k):
            seed = jnp.uint32(i) if p.dtype == "bfloat16" else None
            state = O.RowWiseAdagradState(acc)
            table, state, _ = ops.lookup_pool_backward_update(
                table, state, g, ids_at(i), d.seg, optimizer=opt, seed=seed
            )
            acc = state.accumulator
        return [table, acc]
    if op == "unique":
        uniq, inverse, counts, _ = ops.unique(d.ids, d.capacity)
        return [uniq, inverse, counts]
    return [ops.segment_sum(d.values(), d.seg, p.batch)]


@pytest.mark.parametrize(
    "op, rotate",
    [(op, False) for op in P.LOOP_OPS] + [(op, True) for op in P.HEADLINE_OPS],
)
def test_each_loop_computes_what_k_calls_compute(op, rotate):
    """The dependency between iterations adds 0 (or rotates the ids as the host would), so
    after K iterations ours is K calls of our kernel and XLA's agrees with it (unique and
    segment_sum do not rotate: they run on hotness 20 and 80 only)."""
    dtype = "bfloat16" if op == "backward_rowwise_adagrad" and rotate else "float32"
    d = LC.PointData(P.Point(16, 3, 8, 300, "zipf", dtype))
    k = 3
    want = _expected(op, "embark", d, k, rotate)
    tol = 1e-2 if dtype == "bfloat16" else 1e-5
    for lib in LC.LIBS:
        case = LC.BUILDERS[op](lib, d, k, rotate)
        state = case.fn(case.init(), *case.aux)
        got = {
            "forward": lambda s: [s[1]],
            "backward_rowwise_adagrad": lambda s: [s[0], s[1]],
            "unique": lambda s: list(s[1:]),
            "segment_sum": lambda s: [s[1]],
        }[op](state)
        for g, w in zip(got, want, strict=True):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            if op == "unique":  # XLA pads with -1, ours with its own fill: the used part
                m = d.unique_rows if w.shape[0] == d.capacity else w.shape[0]
                g, w = g[:m], w[:m]
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"{lib} {op}")
        # the sample the run compares is the same rows for both libraries
        assert case.sample(state).shape == LC.BUILDERS[op]("xla", d, k, rotate).sample(state).shape


def _while_bodies(text: str) -> list[str]:
    """The text of each while loop's body, with the computations it calls (fusions)."""
    comps = hlo_scan.parse(text)

    def with_callees(name, seen):
        seen.add(name)
        lines = [i.line for i in comps[name]]
        for line in lines:
            for key in ("calls=", "to_apply="):
                if key in line:
                    callee = line.split(key)[1].split(",")[0].split("}")[0].lstrip("%")
                    if callee in comps and callee not in seen:
                        lines += with_callees(callee, seen)
        return lines

    bodies = [
        i.line.split("body=")[1].split(",")[0].lstrip("%")
        for instrs in comps.values()
        for i in instrs
        if i.opcode == "while"
    ]
    return ["\n".join(with_callees(b, set())) for b in bodies]


@pytest.mark.parametrize("op", P.LOOP_OPS)
def test_the_op_stays_inside_the_loop_and_its_state_is_not_copied(op):
    d = LC.PointData(P.Point(16, 3, 8, 300, "uniform"))
    inside = {
        "forward": ("embark_lookup_pool", "gather"),
        "backward_rowwise_adagrad": ("embark_sparse_grad_update", "scatter"),
        "unique": ("embark_unique", "sort"),
        "segment_sum": ("embark_segment_sum", "scatter"),
    }[op]
    for lib, marker in zip(LC.LIBS, inside, strict=True):
        case = LC.BUILDERS[op](lib, d, 4, False)
        text = case.fn.lower(case.init(), *case.aux).compile().as_text()
        bodies = _while_bodies(text)
        assert bodies and any(marker in b for b in bodies), (lib, op)
        copied = {b for f in hlo_scan.scan(text, case.buffers) if f["copy"] for b in f["buffers"]}
        # ours copies nothing; XLA's dedup (unique, and the backward's) sorts a copy of the ids
        assert copied <= ({"ids"} if lib == "xla" else set()), (lib, op, copied)


def test_copy_reference_moves_the_bytes_in_place():
    case = LC.copy_case(8 * 1000, 3)
    state = case.fn(case.init(), *case.aux)
    assert state.shape == (1000,) and float(state.sum()) == 1000.0  # x * 1.0, three times


def test_union_and_device_times_from_a_gpu_trace():
    assert loop.union_ns([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    trace = """
    planes {
      id: 1 name: "/device:GPU:0"
      lines { id: 1 name: "XLA Modules" timestamp_ns: 1000
        events { metadata_id: 1 offset_ps: 0 duration_ps: 10000000 }
        events { metadata_id: 4 offset_ps: 20000000 duration_ps: 1000000 } }
      lines { id: 2 name: "Stream #1(Compute)" timestamp_ns: 1000
        events { metadata_id: 2 offset_ps: 1000000 duration_ps: 3000000 }
        events { metadata_id: 3 offset_ps: 5000000 duration_ps: 2000000 }
        events { metadata_id: 2 offset_ps: 20000000 duration_ps: 500000 } }
      lines { id: 3 name: "Stream #2(Compute)" timestamp_ns: 1000
        events { metadata_id: 2 offset_ps: 2000000 duration_ps: 3000000 } }
      event_metadata { key: 1 value { id: 1 name: "jit_loop_forward_embark(12)" } }
      event_metadata { key: 2 value { id: 2 name: "lookup_kernel" } }
      event_metadata { key: 3 value { id: 3 name: "dep_fusion" } }
      event_metadata { key: 4 value { id: 4 name: "jit_other(3)" } }
    }
    """
    got = loop.device_times(ProfileData.from_text_proto(trace), "jit_loop_forward_embark", 2)
    # kernels inside the module's window: [1, 4] and [2, 5] us overlap -> 4 us, + 2 us
    assert got["busy_s"] == pytest.approx(6e-6 / 2)
    assert got["span_s"] == pytest.approx(10e-6 / 2)
    assert got["kernels"][0] == ["lookup_kernel", pytest.approx(6e-6 / 2)]
    cpu = ProfileData.from_text_proto('planes { id: 1 name: "/host:CPU" }')
    assert loop.device_times(cpu, "jit_x", 1) is None


def test_headline_bars():
    def rec(ours, xla):
        libs = {
            "embark": report.summarize([1.0], 1e9) | {"fraction_of_copy": ours},
            "xla": report.summarize([xla], 1e9),
        }
        return report.op_record("forward", 10**9, libs)

    f32 = P.production(20, "uniform")
    one_hot = P.production(1, "uniform")
    result = {
        "points": [
            {"point": f32.to_json() | {"name": f32.name, "label": f32.label}},
            {"point": one_hot.to_json() | {"name": one_hot.name, "label": one_hot.label}},
        ]
    }
    result["points"][0]["forward"] = rec(0.7, 2.0)
    result["points"][0]["backward_rowwise_adagrad"] = rec(0.2, 0.5)
    result["points"][1]["forward"] = rec(0.1, 1.5)
    rows = {(r["point"], r["op"]): r for r in loop.headline(result)}
    fwd = rows[(f32.name, "forward")]
    assert fwd["bar"] == 0.65 and fwd["meets_bar"] and fwd["vs_xla"] == 2.0 and fwd["meets_xla"]
    bwd = rows[(f32.name, "backward_rowwise_adagrad")]
    assert bwd["bar"] == 0.30 and not bwd["meets_bar"] and not bwd["meets_xla"]
    assert rows[(one_hot.name, "forward")]["bar"] is None  # no bar on one-hot
    table = loop.headline_table(result)
    assert "| 65536 × 20 × 128, 40M uniform | forward | 70.0% | 65% met | 2.00x |" in table


def test_loop_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "loop.json"
    args = ["--loop", "--quick", "--repeats", "2", "--target-bytes", "4e6"]
    args += ["--copy-min-bytes", str(1 << 20), "--profile", "2", "--out", str(out)]
    result = kernels_main(args)
    data = json.loads(out.read_text())
    assert result["points"] == data["points"]
    assert data["schema"] == loop.SCHEMA and data["backend"] == "cpu" and data["checks_ok"]
    assert data["complete"] and not data["skipped"] and data["copy_GBps"] > 0
    assert [pt["point"]["name"] for pt in data["points"]] == [p.name for p, _ in P.LOOP_SMOKE]
    for pt, (p, op_names) in zip(data["points"], P.LOOP_SMOKE, strict=True):
        info = pt["point"]
        assert info["unique_rows"] > 0 and info["capacity"] >= info["unique_rows"]
        assert info["rotated"]  # tiny tables: under the CPU's rotation threshold
        for op in op_names:
            rec = pt[op]
            assert rec["bytes"] == P.op_bytes(op, p, info["unique_rows"]) and not rec["errors"]
            assert rec["iters"] == loop.iters_for(
                rec["bytes"], loop.Settings(target_bytes=4e6).resolved("cpu"), op
            )
            assert set(rec["libs"]) == {"embark", "xla"} and rec["check"]["embark"]["ok"]
            for r in rec["libs"].values():
                assert len(r["loop_s"]) == 2 and r["iters"] == rec["iters"]
                assert r["min_s"] == pytest.approx(min(r["loop_s"]) / rec["iters"])
                assert r["GBps"] == pytest.approx(rec["bytes"] / r["min_s"] / 1e9)
                assert r["fraction_of_copy"] == pytest.approx(r["GBps"] / rec["copy"]["GBps"])
            assert rec["copy"]["bytes"] >= max(rec["bytes"], 1 << 20)
            assert rec["speedup"] == pytest.approx(rec["ratios"]["xla"]["min"])
            assert rec["fraction_of_copy"] == rec["libs"]["embark"]["fraction_of_copy"]
    # the first 2 cases were traced: a CPU trace has no GPU plane, so no device times
    first = data["points"][0]["forward"]["libs"]
    assert first["embark"]["device"] is None and first["xla"]["device"] is None
    traced = [
        r
        for pt in data["points"]
        for op in P.LOOP_OPS
        if op in pt
        for r in pt[op]["libs"].values()
        if "device" in r or "profile_error" in r
    ]
    assert len(traced) == 2
    printed = capsys.readouterr().out
    assert "| point | op | ours % of copy | bar | ours vs XLA |" in printed


def test_a_spent_budget_skips_the_rest_and_keeps_the_json(tmp_path):
    out = tmp_path / "loop.json"
    s = loop.Settings(repeats=1, target_bytes=1e5, copy_min_bytes=1 << 16, budget_s=0.0)
    result = loop.run(P.LOOP_SMOKE, s, str(out), say=lambda *a: None)
    # The first point always runs whole (so a run has something to show); every later op is
    # listed as skipped.
    assert not result["complete"] and len(result["points"]) == 1
    first_ops = len(P.LOOP_SMOKE[0][1])
    assert len(result["skipped"]) == sum(len(o) for _, o in P.LOOP_SMOKE) - first_ops
    assert json.loads(out.read_text())["skipped"][0]["reason"] == "time budget spent"


def test_cpu_runs_cap_the_production_shapes(tmp_path):
    s = loop.Settings(repeats=1, target_bytes=1e5, copy_min_bytes=1 << 16)
    s.max_batch, s.max_vocab = 32, 2048
    tasks = [(P.production(20, "zipf", "bfloat16"), ("forward",))]
    result = loop.run(tasks, s, str(tmp_path / "l.json"), say=lambda *a: None)
    info = result["points"][0]["point"]
    assert (info["batch"], info["vocab"], info["hotness"], info["dtype"]) == (
        32,
        2048,
        20,
        "bfloat16",
    )
    assert info["requested"] == "B65536_L20_D128_V40000000_zipf_bf16"
    assert jax.default_backend() == "cpu" and result["checks_ok"]
