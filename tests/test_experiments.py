"""Smoke tests of the experiment scripts (tiny sizes; the real runs are benchmarks)."""

import json

from experiments.kernels.main import main as kernels_main


def test_kernel_benchmark_quick(tmp_path):
    out = tmp_path / "k.json"
    result = kernels_main(["--quick", "--repeats", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["points"][0]["forward"]["speedup"] > 0
    assert result["points"][0]["backward_update"]["bytes"] > 0


def test_planner_experiment_quick(tmp_path):
    from experiments.planner.main import main as planner_main

    rows = planner_main(["--quick", "--out", str(tmp_path / "p.json")])
    assert len(rows) == 4 and all(r["seconds"] > 0 for r in rows)
