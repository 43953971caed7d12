"""The whole-embedding-step benchmark (experiments/collection): its workloads, its numpy
reference, its checks, and a smoke run at tiny shapes, with FBGEMM's TBE when torch and
fbgemm-gpu-cpu are installed (the `bench` extra) and without it (the peer skipped)."""

import importlib.util
import json
import math

import numpy as np
import pytest

from experiments.collection import bench, data, workloads
from experiments.collection.main import main as collection_main

HAS_FBGEMM = importlib.util.find_spec("fbgemm_gpu") is not None


def test_workloads_are_the_issues():
    by_name = {w.name: w for w in workloads.full()}
    assert list(by_name) == ["dcnv2-mini", "tables-100", "one-4m"]
    dcn = by_name["dcnv2-mini"]
    assert len(dcn.tables) == 26 and dcn.batch == 4096 and dcn.pooling == "sum"
    from embark_jax.planner import load_preset

    preset = load_preset("dcnv2-mini")
    assert [t.hotness for t in dcn.tables] == [math.ceil(t.hotness) for t in preset.tables]
    assert [t.rows for t in dcn.tables] == [t.vocab_size for t in preset.tables]
    assert set(dcn.contenders) == set(workloads.CONTENDERS)
    t100 = by_name["tables-100"]
    assert len(t100.tables) == 100 and t100.batch == 8192
    assert all(1e4 <= t.rows <= 1e6 and t.dim in (32, 64) for t in t100.tables)
    assert {t.hotness for t in t100.tables} == set(range(1, 11))
    assert t100.tables == workloads.full()[1].tables  # a fixed generator
    (big,) = by_name["one-4m"].tables
    assert (big.rows, big.dim, big.hotness, by_name["one-4m"].batch) == (4_000_000, 128, 32, 4096)
    for w in [*workloads.full(), *workloads.quick()]:
        assert workloads.Workload.from_json(json.loads(json.dumps(w.to_json()))) == w


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_reference_step_is_rowwise_adagrad(tmp_path, pooling):
    w = workloads.Workload(
        "tiny", (workloads.Table("a", 50, 4, 3), workloads.Table("b", 7, 8, 2)), 16, pooling
    )
    inp = data.Inputs(str(tmp_path), w, batches=2, ids="uniform").write()
    assert data.Inputs.load(inp.manifest) == inp
    for i, t in enumerate(w.tables):
        ids, g = inp.batch_ids(0, i), inp.grad(i).astype(np.float64)
        table = np.array(inp.table(i), np.float64)
        div = t.hotness if pooling == "mean" else 1
        np.testing.assert_allclose(data.reference_output(inp, i), table[ids].sum(1) / div)
        full = np.zeros_like(table)  # dense gradient, then exact row-wise Adagrad everywhere
        for b in range(w.batch):
            for r in ids[b]:
                full[r] += g[b] / div
        acc = (full**2).mean(1)
        new = table - (inp.learning_rate / (np.sqrt(acc) + inp.eps))[:, None] * full
        rows = inp.sample_rows(i)
        w0, w1 = data.reference_rows(inp, i)
        np.testing.assert_allclose(w0, table[rows])
        np.testing.assert_allclose(w1, new[rows], rtol=1e-12, atol=1e-15)
        assert set(np.unique(ids)) <= set(rows)  # every touched row is sampled (few here)


def test_check_flags_a_wrong_update(tmp_path):
    w = workloads.Workload("tiny", (workloads.Table("a", 3000, 8, 4),), 32)
    inp = data.Inputs(str(tmp_path / "in"), w, batches=1).write()
    ref = bench.Reference(inp)
    good = tmp_path / "good"
    good.mkdir()
    w0, w1 = ref.rows(0)
    assert len(w0) > 100 and (w0 == w1).all(axis=1).any()  # untouched rows are sampled
    np.save(good / "out_0.npy", ref.output(0).astype(np.float32))
    np.save(good / "rows_0.npy", w1.astype(np.float32))
    assert bench.check_against_reference(ref, str(good))["ok"]
    np.save(good / "rows_0.npy", (w0 - 2 * (w1 - w0)).astype(np.float32))  # twice the step
    assert not bench.check_against_reference(ref, str(good))["ok"]
    np.save(good / "rows_0.npy", (w1 + 1e-3 * ((w0 == w1).all(1))[:, None]).astype(np.float32))
    res = bench.check_against_reference(ref, str(good))  # an untouched row moved
    assert not res["ok"] and res["untouched_max_abs"] > 0


def test_ratios_are_samples_per_second_over_tbe():
    recs = {"embark": bench.summarize([0.2, 0.1, 0.3], 100), "tbe": bench.summarize([0.1], 100)}
    assert recs["embark"]["samples_per_s"] == {"best": 1000.0, "median": 500.0}
    r = bench.ratios(recs)
    assert r == {"embark": {"best": 1.0, "median": 0.5}}
    assert bench.ratios({"embark": recs["embark"]}) == {}


def test_schedule_follows_memory(monkeypatch):
    w = workloads.full()[2]  # one-4m: 1.9 GiB of tables
    names = ["embark", "embark_rb", "tbe"]
    need = sum(bench.memory_needed(w, n) for n in names)
    monkeypatch.setattr(bench, "mem_available", lambda: need + 3 * 2**30)
    assert bench.choose_schedule(w, names, "auto") == "interleaved"
    monkeypatch.setattr(bench, "mem_available", lambda: need)
    assert bench.choose_schedule(w, names, "auto") == "one-at-a-time"
    assert bench.choose_schedule(w, names, "interleaved") == "interleaved"
    assert bench.wait_for_memory(need + 1, 0.0, poll_s=0.0).startswith("not enough memory")
    assert bench.wait_for_memory(need, 0.0) is None


def _assert_ran(rec: dict, contenders: set[str], tbe_expected: bool) -> None:
    ran = set(rec["contenders"])
    if tbe_expected:
        assert ran == contenders and not rec["unavailable"]
        assert set(rec["ratios"]) == contenders - {"tbe"} == set(rec["agreement"])
        for a in rec["agreement"].values():  # the same step, two libraries
            assert a["outputs_max_abs"] < 1e-5 and a["rows_max_abs"] < 1e-6
    else:
        assert ran == contenders - {"tbe"}
        assert rec["unavailable"]["tbe"].startswith("ImportError")
        assert rec["ratios"] == {} and rec["agreement"] == {}
    for c in rec["contenders"].values():
        assert c["check"]["ok"] and c["check"]["untouched_max_abs"] == 0.0
        assert len(c["step_s"]["rounds"]) == 1 and c["samples_per_s"]["best"] > 0
        assert 0 < c["memory"]["rss_gib"] <= c["memory"]["peak_rss_gib"]
        assert 0 < c["first_step_s"] <= c["check_s"]  # step 1 alone, then with the check
        assert c["settle"]["seconds"] >= 0
    for name in contenders - {"tbe"}:
        assert rec["contenders"][name]["check"]["overflow"] == 0
        # huge pages are on by default, for every embark contender: the settle waited for them
        assert rec["contenders"][name]["settle"]["huge_pages"]["done"]
    if "tbe" in rec["contenders"]:
        assert rec["contenders"]["tbe"]["settle"]["huge_pages"] is None


def test_quick_run(tmp_path):
    """dcnv2-mini-quick (every contender) and tables-quick (mean pooling): TBE runs when
    fbgemm is installed, and is skipped cleanly otherwise."""
    out = tmp_path / "c.json"
    argv = ["--quick", "--rounds", "1", "--steps", "1", "--batches", "2", "--out", str(out)]
    result = collection_main([*argv, "--workloads", "dcnv2-mini-quick,tables-quick"])
    saved = json.loads(out.read_text())
    assert saved["schema"] == bench.SCHEMA and saved["checks_ok"] and result["checks_ok"]
    dcn, tables = saved["workloads"]
    _assert_ran(dcn, set(workloads.CONTENDERS), HAS_FBGEMM)
    _assert_ran(tables, {"embark", "tbe"}, HAS_FBGEMM)
    assert dcn["contenders"]["embark_rb"]["check"]["clusters"] == {"rb": 6}
    # the process tuning is on for the tuned contender only, whatever the caller's environment
    build = {k: c["info"]["embark_build"] for k, c in dcn["contenders"].items() if k != "tbe"}
    assert build["embark_tuned"]["malloc"] != "off" and build["embark"]["malloc"] == "off"
    assert tables["workload"]["pooling"] == "mean"


def test_quick_run_without_fbgemm(tmp_path, monkeypatch):
    """The peer made unavailable (as on a machine without fbgemm): its row is left out."""
    monkeypatch.setenv("EMBARK_BENCH_UNAVAILABLE", "tbe")
    out = tmp_path / "c.json"
    argv = ["--quick", "--rounds", "1", "--steps", "1", "--batches", "1", "--out", str(out)]
    argv += ["--schedule", "one-at-a-time"]
    collection_main([*argv, "--workloads", "one-table-quick", "--contenders", "embark,tbe"])
    (rec,) = json.loads(out.read_text())["workloads"]
    _assert_ran(rec, {"embark", "tbe"}, tbe_expected=False)
    assert rec["schedule"] == "one-at-a-time"
    assert "not run: ImportError" in bench.table([rec])
