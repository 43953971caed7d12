"""The experiments' notebooks: each runs top to bottom in its small setting
(`EMBARK_NB_SMALL=1`) in a fresh kernel of this Python, and shows what it is for; the stored
copies hold their outputs (every code cell executed in the full setting, a figure in each).
"""

import base64
import json
import pathlib
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = {
    "paper_eval": ROOT / "experiments" / "paper_eval" / "paper_eval.ipynb",
    "ablation": ROOT / "experiments" / "ablation" / "ablation.ipynb",
    "clusters": ROOT / "experiments" / "clusters" / "clusters.ipynb",
    "kernels": ROOT / "experiments" / "kernels" / "kernels.ipynb",
}


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A `python3` kernel spec running this interpreter (so the kernel sees this venv even
    when it is not activated), found first on JUPYTER_PATH; the small setting."""
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "Python 3", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("EMBARK_NB_SMALL", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    return tmp_path


def execute(path: pathlib.Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    return nb


def outputs(nb, kind: str) -> list[str]:
    """Every output of `kind` ("image/png", "text/markdown", "stream") as text."""
    got = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if kind == "stream" and out.output_type == "stream":
                got.append(out.text)
            elif kind in out.get("data", {}):
                got.append(out["data"][kind])
    return got


def errors(nb) -> list[str]:
    return [
        f"{o.ename}: {o.evalue}"
        for c in nb.cells
        for o in c.get("outputs", [])
        if o.output_type == "error"
    ]


def test_paper_eval_notebook(kernel_env):
    nb = execute(NOTEBOOKS["paper_eval"])
    assert len(outputs(nb, "image/png")) >= 4  # step times, share, per device, bound figure
    tables = "\n".join(outputs(nb, "text/markdown"))
    for row in ("| dcnv2 | 8 |", "| dcnv2 | 64 |", "**mean**", "vs TRW H200"):
        assert row in tables, row
    assert "small setting" in "".join(outputs(nb, "stream"))


def test_ablation_notebook(kernel_env):
    nb = execute(NOTEBOOKS["ablation"])
    assert outputs(nb, "image/png")
    tables = "\n".join(outputs(nb, "text/markdown"))
    for stage in ("TRW", "+ clusters by cost", "+ 3D splits", "+ hierarchical RB", "+ bf16 comm"):
        assert f"| {stage} |" in tables, stage
    assert "DGX-H100 step ms" in tables


def test_clusters_notebook(kernel_env):
    nb = execute(NOTEBOOKS["clusters"])
    assert len(outputs(nb, "image/png")) == 2  # the three sweeps, the winner map
    tables = "\n".join(outputs(nb, "text/markdown"))
    for cluster in ("DP", "RB", "UB"):
        assert f"| hotness | 16 | {cluster} |" in tables, cluster


def fake_gpu_results(directory: pathlib.Path) -> None:
    """A GPU check's condensed JSON and an older-format benchmark JSON with a torch column."""
    check = {
        "kernels": {
            "quick": {
                "backend": "gpu",
                "device": "cuda:0 (fake)",
                "copy_GBps": 3000.0,
                "points": {
                    "B4096_L32_D128_V1000000_zipf": {
                        "forward": {"ffi_GBps": 1500.0, "xla_GBps": 400.0},
                        "backward_update": {"ffi_GBps": 900.0, "xla_GBps": 100.0},
                    }
                },
            }
        }
    }
    (directory / "gpu_check.json").write_text(json.dumps(check))
    bench = {
        "backend": "gpu",
        "devices": "cuda:0 (fake)",
        "copy_GBps": 3000.0,
        "points": [
            {
                "point": {"name": "B1024_L8_D64_V100000_uniform"},
                "forward": {
                    "bytes": 10**8,
                    "ffi_GBps": 1200.0,
                    "xla_GBps": 300.0,
                    "torch_embedding_bag_s": 10**8 / 800e9,
                },
            }
        ],
    }
    (directory / "kernels_gpu.json").write_text(json.dumps(bench))


def test_kernels_notebook_with_and_without_gpu_results(kernel_env, monkeypatch):
    gpu = kernel_env / "gpu"
    gpu.mkdir()
    fake_gpu_results(gpu)
    monkeypatch.setenv("EMBARK_KERNEL_RESULTS", str(gpu))
    nb = execute(NOTEBOOKS["kernels"])
    assert len(outputs(nb, "image/png")) == 3  # CPU, and each GPU results file
    tables = "\n".join(outputs(nb, "text/markdown"))
    assert "| forward |" in tables and "| backward_update |" in tables
    assert "vs torch_embedding_bag" in tables  # a torch_* column from the older format
    text = "\n".join(outputs(nb, "stream"))
    assert "gpu_check.json: 4 GPU records" in text and "kernels_gpu.json: 3 GPU records" in text


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_stored_notebook_has_its_outputs(name):
    """Stored executed in the full setting: every code cell ran, no errors, a figure."""
    nb = nbformat.read(NOTEBOOKS[name], as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), name
    assert not errors(nb), errors(nb)
    images = outputs(nb, "image/png")
    assert images and all(base64.b64decode(i)[:4] == b"\x89PNG" for i in images)
    assert "small setting" not in "".join(outputs(nb, "stream")), "stored in the small setting"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
