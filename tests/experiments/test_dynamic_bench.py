"""Smoke test of the dynamic-table benchmark (experiments/dynamic/): a tiny table, both load
factors, both ops, against the std::unordered_map baseline built with g++ at run time."""

import json
import shutil

import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def test_dynamic_bench_quick(tmp_path):
    from experiments.dynamic import bench
    from experiments.dynamic.main import main

    out = tmp_path / "d.json"
    result = main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result)) and data["schema"] == bench.SCHEMA
    c = data["config"]
    assert (c["capacity"], c["batch"], c["dim"], c["threads_baseline"]) == (4096, 512, 64, 1)
    assert [(p["load_factor"], p["op"]) for p in data["points"]] == [
        (0.5, "find"),
        (0.5, "find_or_insert"),
        (0.9, "find"),
        (0.9, "find_or_insert"),
    ]
    for p in data["points"]:
        assert p["load_reached"] == pytest.approx(p["load_factor"], abs=1 / c["capacity"])
        assert len(p["ours_s"]) == len(p["baseline_s"]) == c["repeats"]
        assert p["ours_mkeys_s"] == pytest.approx(c["batch"] / p["ours_min_s"] / 1e6)
        assert p["ratio_min"] == pytest.approx(p["baseline_min_s"] / p["ours_min_s"])
        half = c["batch"] // 2
        if p["op"] == "find":
            assert p["counts"] == {"found": half}  # and the baseline found as many
        else:  # the held half found, the new half inserted; a new id that fills its bucket
            # evicts a held one, which, if it comes later in the batch, is inserted again
            k = p["counts"]
            assert k["found"] + k["inserted"] == c["batch"] and k["dropped"] == k["refused"] == 0
            assert k["found"] == half - (k["inserted"] - half) and k["found"] + k["evicted"] >= half
    assert "| 0.9 | find_or_insert |" in bench.table(data)
