"""experiments/gpu_check.sh on a CPU machine: with its steps faked, a failed build or a
failing test makes it exit non-zero, a failing step does not stop the later ones, it stops
within its time budget, and it writes one JSON file with the steps, the test summary, the
benchmark's rates and bars and the step's numbers; with its own benchmark and step commands
at tiny shapes, the one command runs the loop benchmark and the step end to end."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.kernels import points as P

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "gpu_check.sh"


def _run(tmp_path, timeout=60, **steps):
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "GPU_CHECK_FAKE": "1",
        "GPU_CHECK_BUILD": "true",
        "GPU_CHECK_TESTS": "true",
        "GPU_CHECK_BENCH": "true",
        "GPU_CHECK_STEP": "true",
        "GPU_CHECK_BENCH_FULL": "true",
        "GPU_CHECK_FULL_MIN_S": "100000",
        **steps,
    }
    env = {k: v for k, v in env.items() if v is not None}  # None: the script's own command
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=timeout
    )
    out = tmp_path / "out"
    summary = json.loads((out / "gpu_check.json").read_text())
    log = (out / "gpu_check.txt").read_text()
    return proc.returncode, summary, log, time.monotonic() - t0


def _pytest_cmd(tmp_path, body: str) -> str:
    test = tmp_path / "t" / "test_fake.py"
    test.parent.mkdir(exist_ok=True)
    test.write_text(body)
    junit = tmp_path / "out" / "gpu_tests.xml"
    return (
        f"{sys.executable} -m pytest -q -p no:cacheprovider --rootdir={test.parent} "
        f"--junitxml={junit} {test}"
    )


def test_success_exits_zero_and_collects_the_results(tmp_path):
    fwd = {"ffi_GBps": 2000.0, "xla_GBps": 1000.0, "fraction_of_copy": 0.5, "speedup": 2.0}
    bench = {
        "schema": "embark_jax.kernel_loop/1",
        "backend": "gpu",
        "devices": "cuda:0",
        "copy_GBps": 4000.0,
        "complete": True,
        "checks_ok": True,
        "skipped": [],
        "points": [
            {
                "point": {
                    "name": "B65536_L20_D128_V40000000_uniform",
                    "label": "65536 × 20 × 128, 40M uniform",
                    "hotness": 20,
                    "dtype": "float32",
                },
                "forward": {
                    **fwd,
                    "iters": 24,
                    "ratios": {"xla": {"min": 2.0, "median": 2.0}},
                    "libs": {
                        "embark": {"fraction_of_copy": 0.5},
                        "xla": {"fraction_of_copy": 0.25},
                    },
                },
            }
        ],
    }
    step = {
        "phases": ["plan", "compile", "step"],
        "batch": 65536,
        "step": {"median_s": 0.02, "samples_per_s": 3276800.0, "times_s": [0.02]},
        "hlo": {"count": 0, "copies": 0, "copied_buffers": [], "ops": []},
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "step.json").write_text(json.dumps(step))
    tests = _pytest_cmd(tmp_path, "def test_ok():\n    pass\n")
    rc, summary, log, _ = _run(
        tmp_path,
        GPU_CHECK_TESTS=tests,
        GPU_CHECK_BENCH=f"cp {tmp_path / 'bench.json'} {tmp_path / 'out' / 'kernels_gpu.json'}",
        GPU_CHECK_STEP=f"cp {tmp_path / 'step.json'} {tmp_path / 'out' / 'gpu_step.json'}",
    )
    assert rc == 0, log
    assert summary["exit_status"] == 0
    assert summary["gpu_tests"]["passed"] == 1 and summary["gpu_tests"]["failures"] == 0
    quick = summary["kernels"]["quick"]
    point = quick["points"]["B65536_L20_D128_V40000000_uniform"]
    assert point["forward"]["fraction_of_copy"] == 0.5 and point["forward"]["iters"] == 24
    assert point["forward"]["xla_fraction_of_copy"] == 0.25
    assert quick["copy_GBps"] == 4000.0 and quick["complete"] and quick["checks_ok"]
    (bar,) = summary["headline"]["quick"]
    assert bar["op"] == "forward" and bar["bar"] == 0.65 and not bar["meets_bar"]
    assert bar["vs_xla"] == 2.0 and bar["meets_xla"]
    assert summary["step"]["step"] == {"median_s": 0.02, "samples_per_s": 3276800.0}
    assert summary["step"]["hlo"] == {"count": 0, "copies": 0, "copied_buffers": []}
    # the most valuable numbers first: the benchmark, the step, then the tests
    assert list(summary["steps"]) == ["build", "benchmark", "step", "gpu_tests"]
    assert "jax " in log and "### exit status 0" in log  # versions printed, log complete


def test_build_failure_exits_non_zero_and_skips_the_rest(tmp_path):
    rc, summary, log, _ = _run(tmp_path, GPU_CHECK_BUILD="echo compiler error; exit 3")
    assert rc == 3
    assert summary["exit_status"] == 3 and summary["steps"] == {
        "build": {"status": 3, "seconds": summary["steps"]["build"]["seconds"]}
    }
    assert "BUILD FAILED" in log and "compiler error" in log


def test_failing_test_exits_non_zero_and_names_it(tmp_path):
    tests = _pytest_cmd(tmp_path, "def test_ok():\n    pass\n\ndef test_bad():\n    assert 0\n")
    rc, summary, log, _ = _run(tmp_path, GPU_CHECK_TESTS=tests)
    assert rc != 0
    assert summary["steps"]["gpu_tests"]["status"] != 0
    assert summary["gpu_tests"]["failures"] == 1 and summary["gpu_tests"]["passed"] == 1
    assert summary["gpu_tests"]["failed"] == ["test_fake::test_bad"]
    assert "FAILED" in log


def test_a_failing_benchmark_does_not_stop_the_step_and_tests(tmp_path):
    rc, summary, log, _ = _run(tmp_path, GPU_CHECK_BENCH="echo boom; exit 5")
    assert rc == 5 and summary["exit_status"] == 5
    assert summary["steps"]["benchmark"]["status"] == 5
    assert summary["steps"]["step"]["status"] == 0 and summary["steps"]["gpu_tests"]["status"] == 0
    assert "benchmark: FAILED with status 5" in log


@pytest.mark.parametrize("budget", [4])
def test_stops_within_its_budget(tmp_path, budget):
    rc, summary, log, elapsed = _run(
        tmp_path, GPU_CHECK_BUDGET_S=str(budget), GPU_CHECK_BENCH="sleep 60"
    )
    assert rc == 124
    assert summary["steps"]["benchmark"]["status"] == 124
    # no time left: the later steps are skipped and counted
    assert summary["steps"]["step"]["status"] == 124
    assert summary["steps"]["gpu_tests"]["status"] == 124
    assert elapsed < budget + 8, elapsed  # `sleep` stops at the signal; start-up
    assert "TIMED OUT" in log and "SKIPPED" in log


def test_interrupted_tests_still_report_what_ran(tmp_path):
    """The tests step is stopped with SIGINT: pytest then writes its junit file and summary
    for the tests that ran, and the step counts as timed out."""
    body = "import time\n\ndef test_ok():\n    pass\n\ndef test_slow():\n    time.sleep(60)\n"
    rc, summary, log, elapsed = _run(
        tmp_path, GPU_CHECK_BUDGET_S="8", GPU_CHECK_TESTS=_pytest_cmd(tmp_path, body)
    )
    assert rc == 124 and summary["steps"]["gpu_tests"]["status"] == 124
    assert summary["gpu_tests"]["passed"] >= 1  # test_ok, reported although interrupted
    assert "TIMED OUT" in log and "test_ok" not in summary["gpu_tests"]["failed"]
    assert elapsed < 8 + 15, elapsed


def test_full_benchmark_out_of_time_is_no_failure(tmp_path):
    """The full benchmark runs only on time left over; stopping it keeps the exit status."""
    rc, summary, log, _ = _run(
        tmp_path,
        GPU_CHECK_BUDGET_S="15",
        GPU_CHECK_FULL_MIN_S="0",
        GPU_CHECK_BENCH_FULL="sleep 60",
    )
    assert rc == 0, log
    assert summary["steps"]["benchmark_full"]["status"] == 124
    assert summary["exit_status"] == 0


def test_default_budget_fits_two_runs_in_the_device_allowance():
    text = SCRIPT.read_text()
    budget = int(text.split("GPU_CHECK_BUDGET_S:-")[1].split("}")[0])
    # one 10-minute command; two runs plus two machine starts (~2 min each) in 15 minutes
    assert budget <= 600 and 2 * budget + 2 * 120 <= 900
    assert "PYTHONUNBUFFERED=1" in text
    bench = int(text.split("GPU_CHECK_BENCH_S:-")[1].split("}")[0])
    step = int(text.split("GPU_CHECK_STEP_S:-")[1].split("}")[0])
    assert bench + step + 30 < budget  # build (~25 s on the H200), and time for the tests


def test_the_script_runs_the_loop_benchmark_and_the_step_in_that_order():
    text = SCRIPT.read_text()
    assert "experiments.kernels.main --gpu-quick --budget-s" in text
    assert "experiments.training.gpu_step --batch 65536 --budget-s" in text
    order = [text.index(f"step {name} ") for name in ("build", "benchmark", "step", "gpu_tests")]
    assert order == sorted(order)


def test_one_command_runs_the_loop_benchmark_and_the_step_on_a_cpu(tmp_path):
    """The script's own benchmark and step commands, shrunk to tiny shapes: the production
    points capped, the benchmark stopped by its budget (0 s) after the first point, the step's
    second compile skipped by its own; one JSON with both."""
    bench_args = "--max-batch 32 --max-vocab 2048 --target-bytes 2e6 --copy-min-bytes 65536"
    step_args = "--batch 32 --max-vocab 200 --max-hotness 1 --steps 1 --warmup 0 --devices 1"
    rc, summary, log, _ = _run(
        tmp_path,
        timeout=400,
        GPU_CHECK_BENCH=None,
        GPU_CHECK_STEP=None,
        GPU_CHECK_BENCH_S="25",  # the benchmark's own budget: 0 s, only the first point runs
        GPU_CHECK_BENCH_ARGS=f"{bench_args} --profile 0",
        GPU_CHECK_STEP_ARGS=f"{step_args} --topology dgx-h100 --budget-s 0.001",
        JAX_PLATFORMS="cpu",
    )
    assert rc == 0, log
    quick = summary["kernels"]["quick"]
    assert quick["backend"] == "cpu" and quick["checks_ok"]
    assert not quick["complete"] and quick["skipped"] > 0  # its budget ran out first
    assert len(quick["points"]) == 1
    first = P.LOOP_QUICK[0][0].capped(32, 2048).name
    assert set(quick["points"][first]) == set(P.HEADLINE_OPS)
    rows = summary["headline"]["quick"]
    assert rows[0]["point"] == first and rows[0]["bar"] == 0.65
    data = json.loads((tmp_path / "out" / "kernels_gpu.json").read_text())
    assert data["points"][0]["point"]["requested"] == P.LOOP_QUICK[0][0].name
    step = summary["step"]
    assert step["phases"] == ["plan", "compile", "step", "memory", "skipped"]
    assert step["step"]["samples_per_s"] > 0 and "embedding_only" in step["skipped"]
    assert step["hlo"]["count"] >= step["hlo"]["copies"]
