"""The kernel benchmark: what it times (the sorted forward path, a planned two-op capacity),
its deterministic data and byte accounting, its ratios and table from fake times, and the
--quick run end to end, with torch and with torch unavailable (each library in a worker)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.kernels import bench, loop, report, worker
from experiments.kernels import points as P
from experiments.kernels.cases_jax import ffi_forward
from experiments.kernels.main import main as kernels_main

pytestmark = pytest.mark.smoke


def test_forward_takes_the_sorted_path():
    hlo = (
        jax.jit(lambda t, i, s: ffi_forward(t, i, s, 4))
        .lower(jnp.ones((10, 4)), jnp.zeros((8,), jnp.int32), jnp.zeros((8,), jnp.int32))
        .as_text()
    )
    assert "embark_lookup_pool" in hlo and "indices_are_sorted = 1" in hlo


def test_two_op_capacity_is_the_distinct_rows_rounded_up():
    assert P.two_op_capacity(1) == 256
    assert P.two_op_capacity(256) == 256
    assert P.two_op_capacity(257) == 512
    # the Zipf point B=4096, L=32: far fewer distinct rows than B*L
    p = P.Point(4096, 32, 128, 1_000_000, "zipf")
    distinct = len(np.unique(P.make_ids(p)))
    assert P.two_op_capacity(distinct) < p.batch * p.hotness // 2


def test_the_points_are_the_issues_shapes():
    shapes = {(p.batch, p.hotness, p.dim, p.vocab, p.dist) for p in P.DEFAULT_POINTS}
    assert shapes == {
        (4096, 32, 128, 1_000_000, "uniform"),
        (4096, 32, 128, 1_000_000, "zipf"),
        (8192, 1, 128, 1_000_000, "uniform"),
        (1024, 8, 64, 100_000, "uniform"),
        (8192, 32, 128, 2_000_000, "zipf"),
    }
    assert P.DEFAULT_POINTS[1].label == "4096 × 32 × 128, 1M zipf"
    assert P.Point(1024, 8, 64, 100_000, "uniform").label == "1024 × 8 × 64, 100k uniform"


@pytest.mark.parametrize("dist", ["uniform", "zipf"])
def test_same_seed_same_data(dist):
    p = P.Point(64, 8, 4, 1000, dist)
    a, b = P.make_ids(p, 3), P.make_ids(p, 3)
    assert a.dtype == np.int32 and a.shape == (64, 8) and np.array_equal(a, b)
    assert a.min() >= 0 and a.max() < 1000
    assert not np.array_equal(a, P.make_ids(p, 4))
    assert np.array_equal(P.make_table(p, 3), P.make_table(p, 3))
    assert np.array_equal(P.make_output_grads(p, 3), P.make_output_grads(p, 3))
    assert np.array_equal(P.segment_ids(p), np.repeat(np.arange(64), 8))
    if dist == "zipf":  # hot ids are hashed over the table, not the smallest ids
        assert len(np.unique(a)) < a.size // 2 and np.median(a) > 100


def test_byte_accounting_follows_fbgemm():
    p, u = P.Point(4096, 32, 128, 1_000_000, "uniform"), 1000
    fwd = 4096 * 32 * 128 * 4 + 4096 * 128 * 4  # B*L rows read, B pooled rows written
    bwd = 4096 * 128 * 4 + 4096 * 32 * 128 * 4 + 2 * u * 128 * 4
    assert P.op_bytes("forward", p, u) == fwd
    assert P.op_bytes("forward_bf16", p, u) == fwd // 2
    assert P.op_bytes("backward_update", p, u) == P.op_bytes("backward_two_op", p, u) == bwd
    assert P.op_bytes("train_step", p, u) == fwd + bwd
    assert P.op_bytes("unique", p, u) == (2 * 4096 * 32 + 2 * u) * 4
    assert P.op_bytes("segment_sum", p, u) == fwd
    assert set(bench.TOLERANCE) == set(P.OPS)


def test_summary_and_ratios_from_fake_times():
    s = report.summarize([3.0, 1.0, 2.0, 5.0], nbytes=4e9)
    assert (s["min_s"], s["median_s"], s["reps"]) == (1.0, 2.5, 4)
    assert s["GBps"] == 4.0 and s["GBps_median"] == 1.6 and s["times_s"] == [3.0, 1.0, 2.0, 5.0]
    ours = report.summarize([0.01, 0.02, 0.03], 1e9)
    xla = report.summarize([0.04, 0.06, 0.08], 1e9)
    torch = report.summarize([0.005, 0.005, 0.02], 1e9)
    rec = report.op_record(
        "forward", 10**9, {"embark": ours, "xla": xla, "torch": torch}, None, 200.0
    )
    assert rec["ratios"]["xla"] == pytest.approx({"min": 4.0, "median": 3.0})
    assert rec["ratios"]["torch"] == pytest.approx({"min": 0.5, "median": 0.25})
    assert "embark" not in rec["ratios"]
    # the flat keys older readers (gpu_check.sh, test_experiments) use, at the min
    assert rec["ffi_s"] == 0.01 and rec["xla_s"] == 0.04 and rec["torch_s"] == 0.005
    assert rec["speedup"] == pytest.approx(4.0) and rec["ffi_GBps"] == pytest.approx(100.0)
    assert rec["fraction_of_copy"] == pytest.approx(0.5)
    # ours only: compared with the peer op's libraries, ours there being "fused"
    two = report.summarize([0.02, 0.02, 0.02], 1e9)
    rec2 = report.op_record("backward_two_op", 10**9, {"embark": two}, rec["libs"])
    assert rec2["ratios"]["fused"] == pytest.approx({"min": 0.5, "median": 1.0})
    assert rec2["ratios"]["xla"]["min"] == pytest.approx(2.0) and rec2["xla_s"] == 0.04
    assert report.ratio(None, xla) is None and report.geomean([2.0, 8.0]) == pytest.approx(4.0)


def test_ratio_table_rows_geomean_and_missing_torch():
    def rec(ours, peers):
        libs = {"embark": report.summarize([ours], 1e9)}
        libs |= {k: report.summarize([v], 1e9) for k, v in peers.items()}
        return report.op_record("forward", 10**9, libs)

    rows = [("a", rec(0.01, {"xla": 0.02, "torch": 0.005})), ("b", rec(0.02, {"xla": 0.16}))]
    text = report.ratio_table("forward", rows)
    assert "| B × L × D, V | ours ms (min / median) | GB/s (min) | ours vs xla" in text
    assert "| a | 10.000 / 10.000 | 100.00 | 2.00x / 2.00x | 0.50x / 0.50x |" in text
    assert "| b | 20.000 / 20.000 | 50.00 | 8.00x / 8.00x | — |" in text
    assert "| geometric mean |  |  | 4.00x / 4.00x | 0.50x / 0.50x |" in text
    no_torch = report.ratio_table("forward", rows[1:], {"torch": "ImportError: x"})
    assert "vs torch" not in no_torch and "torch: not measured (ImportError: x)" in no_torch


def test_floor_split_is_each_librarys_call_of_one_id_and_the_rows_above_it():
    def point(p, times):
        recs = {
            op: report.op_record(op, 10**6, {k: report.summarize(v, 1e6) for k, v in libs.items()})
            for op, libs in times.items()
        }
        return {"point": p.to_json(), **recs}

    one, shape = P.FLOOR_POINTS
    result = {
        "ops": ["forward", "forward_bf16"],
        "points": [
            point(one, {"forward": {"embark": [6e-6, 5e-6], "torch": [3e-6, 4e-6]}}),
            point(shape, {"forward": {"embark": [25e-6], "torch": [21e-6, 22e-6]}}),
        ],
    }
    split = report.floor_split(result)
    assert split["forward_bf16"] == {}  # not measured: no rows
    got = {lib: {k: round(v, 6) for k, v in r.items()} for lib, r in split["forward"].items()}
    assert got == {
        "embark": {"call_us": 5.0, "shape_us": 25.0, "rows_us": 20.0},
        "torch": {"call_us": 3.0, "shape_us": 21.0, "rows_us": 18.0},
    }
    result["floor"] = split
    text = report.tables(result)
    assert "| forward | embark | 5.0 | 25.0 | 20.0 |" in text
    assert "1024 × 8 × 64, 100k uniform: us" in text
    assert "geometric mean" not in text  # not over a call of one id


def test_samples_are_checked_against_the_reference():
    ref = np.array([1.0, 2.0])
    out = bench.check_samples("forward", {"a": ref + 1e-6, "b": ref + 1.0, "c": ref[:1]}, ref)
    assert out["a"]["ok"] and not out["b"]["ok"] and not out["c"]["ok"]
    assert out["b"]["max_abs_err"] == pytest.approx(1.0)


def _worker(*args, **env):
    env = {**os.environ, "PYTHONPATH": str(bench.ROOT), **env}
    cmd = [sys.executable, "-m", "experiments.kernels.worker", *args]
    return subprocess.run(cmd, input='{"cmd": "quit"}\n', capture_output=True, text=True, env=env)


def test_worker_reports_a_library_it_cannot_import():
    proc = _worker("--lib", "torch", **{worker.UNAVAILABLE_ENV: "torch"})
    assert proc.returncode == 0, proc.stderr
    hello = json.loads(proc.stdout.splitlines()[0])
    assert hello == {"available": False, "reason": hello["reason"]}
    assert hello["reason"].startswith("ImportError")


def _check_quick_result(data, libs):
    assert data["schema"] == bench.SCHEMA and data["checks_ok"]
    assert data["machine"]["cpu_model"] and data["machine"]["threads"] >= 1
    assert data["libs"]["embark"]["xla_intra_op_threads"] >= 1
    point = data["points"][0]
    assert point["point"]["name"] == "B256_L4_D16_V5000_zipf" and point["point"]["unique_rows"] > 0
    for op in data["ops"]:
        rec = point[op]
        assert rec["bytes"] == P.op_bytes(op, P.QUICK_POINTS[0], point["point"]["unique_rows"])
        assert set(rec["check"]) == set(rec["libs"]) and not rec["errors"], (op, rec["errors"])
        for r in rec["libs"].values():
            assert r["min_s"] == min(r["times_s"]) and r["min_s"] <= r["median_s"]
            assert r["GBps"] == pytest.approx(rec["bytes"] / r["min_s"] / 1e9)
        ours = rec["libs"]["embark"]
        for peer, r in rec["ratios"].items():
            other = point["backward_update"]["libs"] if op == "backward_two_op" else rec["libs"]
            peer_rec = other["embark" if peer == "fused" else peer]
            assert r["min"] == pytest.approx(peer_rec["min_s"] / ours["min_s"])
            assert r["median"] == pytest.approx(peer_rec["median_s"] / ours["median_s"])
    fwd = point["forward"]
    assert set(fwd["libs"]) == set(libs)
    return point


def test_quick_run_with_torch(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "k.json"
    result = kernels_main(["--quick", "--repeats", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    point = _check_quick_result(data, {"embark", "xla", "torch"})
    assert data["ops"] == list(P.OPS) and data["unavailable"] == {}
    assert data["libs"]["torch"]["num_threads"] == data["machine"]["threads"]
    assert set(point["segment_sum"]["libs"]) == {"embark", "xla", "torch", "torch_segment_reduce"}
    assert set(point["train_step"]["ratios"]) == {"xla", "torch"}
    assert set(point["backward_two_op"]["ratios"]) == {"fused", "xla", "torch"}
    assert result["points"][0]["forward"]["libs"]["torch"]["reps"] == 2
    assert "ours vs torch (min / median)" in capsys.readouterr().out


def test_quick_run_without_torch(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(worker.UNAVAILABLE_ENV, "torch")
    out = tmp_path / "k.json"
    args = ["--quick", "--repeats", "1", "--ops", "forward,backward_update,backward_two_op"]
    kernels_main([*args, "--out", str(out)])  # returns: exit status 0
    data = json.loads(out.read_text())
    _check_quick_result(data, {"embark", "xla"})
    assert data["unavailable"]["torch"].startswith("ImportError") and "torch" not in data["libs"]
    printed = capsys.readouterr().out
    assert "vs torch" not in printed and "torch: not measured (ImportError" in printed


def test_modes_pick_points_ops_and_repeats(monkeypatch, tmp_path):
    calls, loops = [], []

    def fake_run(points, repeats, out, **kw):
        calls.append((points, repeats, kw))
        return {"checks_ok": len(calls) < 3}

    def fake_loop(tasks, settings, out, say=print):
        loops.append((tasks, settings, out))
        return {"checks_ok": len(loops) < 4}

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(loop, "run", fake_loop)
    out = ["--out", str(tmp_path / "k.json")]
    kernels_main(["--quick", "--repeats", "7", *out])
    kernels_main(["--quick", "--ops", "unique,segment_sum", "--libs", "embark,torch", *out])
    points, repeats, kw = calls[0]
    assert points == P.QUICK_POINTS and repeats == 7 and kw["ops"] == P.OPS
    points, repeats, kw = calls[1]
    assert kw["ops"] == ("unique", "segment_sum") and kw["libs"] == ("embark", "torch")
    with pytest.raises(SystemExit, match="disagrees"):  # a failed check: exit status 1
        kernels_main(["--quick", *out])
    with pytest.raises(SystemExit):
        kernels_main(["--quick", "--ops", "nope", *out])
    with pytest.raises(SystemExit):
        kernels_main(["--quick", "--libs", "xla,torch", *out])
    with pytest.raises(SystemExit, match="disagrees"):  # the fake run's later checks fail
        kernels_main(["--floor", "--libs", "embark,torch", *out])
    points, _, kw = calls[-1]
    assert points == P.FLOOR_POINTS and kw["ops"] == P.FLOOR_OPS and kw["floor"] is True
    assert calls[0][2]["floor"] is False
    for mode in ("--quick", "--gpu-quick", "--loop"):
        with pytest.raises(SystemExit):
            kernels_main(["--floor", mode, *out])
    # loop mode: the GPU check's quick run, the full run and the smoke run
    kernels_main(["--gpu-quick", "--repeats", "7", "--budget-s", "100", *out])
    kernels_main(["--loop", "--ops", "unique", "--max-batch", "64", *out])
    kernels_main(["--loop", "--quick", *out])
    (tasks, s, _), (full, s_full, _), (smoke, _, _) = loops
    assert tasks == P.LOOP_QUICK and s.repeats == 3 and s.profile == 8 and s.budget_s == 100
    assert full == [(p, ("unique",)) for p, ops in P.LOOP_FULL if "unique" in ops]
    assert s_full.repeats == 5 and not s_full.profile and s_full.max_batch == 64
    assert smoke == P.LOOP_SMOKE
    with pytest.raises(SystemExit, match="disagrees with XLA"):
        kernels_main(["--loop", "--quick", *out])
    with pytest.raises(SystemExit):
        kernels_main(["--loop", "--ops", "train_step", *out])


def test_only_a_full_run_writes_results_kernels_json_by_default(monkeypatch, tmp_path):
    """A `--quick` (or partial) run without --out never replaces the committed full results."""
    outs = []
    monkeypatch.setattr(
        bench, "run", lambda points, repeats, out, **kw: outs.append(out) or {"checks_ok": True}
    )
    monkeypatch.setattr(
        loop, "run", lambda tasks, s, out, say=print: outs.append(out) or {"checks_ok": True}
    )
    monkeypatch.chdir(tmp_path)
    for argv in (
        [],
        ["--quick"],
        ["--ops", "forward"],
        ["--libs", "embark,torch"],
        ["--floor"],
        ["--gpu-quick"],
        ["--loop"],
        ["--loop", "--quick"],
    ):
        kernels_main(argv)
    assert outs == [
        "results/kernels.json",
        "results/kernels_quick.json",
        "results/kernels_partial.json",
        "results/kernels_partial.json",
        "results/kernels_floor.json",
        "results/kernels_loop_quick.json",
        "results/kernels_loop.json",
        "results/kernels_loop_smoke.json",
    ]


def test_a_session_splits_into_its_ops():
    """backward_two_op is timed in backward_update's session (interleaved with the peers)."""
    times = {"embark": [1.0], "xla": [2.0], "embark@backward_two_op": [3.0]}
    errors = {"torch@backward_two_op": "none"}
    out = bench.by_op("backward_update", times, errors)
    assert out["backward_update"] == ({"embark": [1.0], "xla": [2.0]}, {})
    assert out["backward_two_op"] == ({"embark": [3.0]}, {"torch": "none"})
