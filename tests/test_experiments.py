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


def test_training_benchmark_quick(tmp_path):
    from experiments.training.main import main as training_main

    out = tmp_path / "t.json"
    rows = training_main(["--quick", "--out", str(out)])
    assert {r["plan"] for r in rows} == {"embark", "trw", "rw"}
    assert all(r["collective_bytes"] > 0 and r["steps_per_s"] > 0 for r in rows)
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_paper_eval_quick_and_notebook_is_valid(tmp_path):
    import json
    import os

    from experiments.paper_eval.main import main as paper_main

    rows = paper_main(["--quick", "--out", str(tmp_path / "e.json")])
    assert rows[0]["speedup"] >= 1.0 and (tmp_path / "e.png").exists()
    nb_path = os.path.join(
        os.path.dirname(__file__), "..", "experiments", "paper_eval", "paper_eval.ipynb"
    )
    with open(nb_path) as fh:
        nb = json.load(fh)
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert nb["nbformat"] == 4 and any("evaluate()" in c for c in code)
    for c in code:  # every cell is valid Python
        compile(c, "paper_eval.ipynb", "exec")
