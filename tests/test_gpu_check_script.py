"""experiments/gpu_check.sh on a CPU machine, its steps faked: a failed build or a failing
test makes it exit non-zero, it stops within its time budget, and it writes one JSON file
with the steps, the test summary and the benchmark's rates."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
        "GPU_CHECK_BENCH_FULL": "true",
        "GPU_CHECK_FULL_MIN_S": "100000",
        **steps,
    }
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
    bench = {
        "backend": "gpu",
        "devices": "cuda:0",
        "copy_GBps": 4000.0,
        "points": [
            {
                "point": {"name": "B1_L1_D1_V1_uniform"},
                "forward": {"ffi_GBps": 2000.0, "xla_GBps": 1000.0, "fraction_of_copy": 0.5},
                "backward_update": {
                    "ffi_GBps": 1000.0,
                    "xla_GBps": 500.0,
                    "fraction_of_copy": 0.25,
                },
            }
        ],
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    tests = _pytest_cmd(tmp_path, "def test_ok():\n    pass\n")
    rc, summary, log, _ = _run(
        tmp_path,
        GPU_CHECK_TESTS=tests,
        GPU_CHECK_BENCH=f"cp {tmp_path / 'bench.json'} {tmp_path / 'out' / 'kernels_gpu.json'}",
    )
    assert rc == 0, log
    assert summary["exit_status"] == 0
    assert summary["gpu_tests"]["passed"] == 1 and summary["gpu_tests"]["failures"] == 0
    point = summary["kernels"]["quick"]["points"]["B1_L1_D1_V1_uniform"]
    assert point["forward"]["fraction_of_copy"] == 0.5
    assert summary["kernels"]["quick"]["copy_GBps"] == 4000.0
    assert set(summary["steps"]) == {"build", "gpu_tests", "benchmark"}
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
    assert summary["steps"]["benchmark"]["status"] == 0  # later steps still ran
    assert summary["gpu_tests"]["failures"] == 1 and summary["gpu_tests"]["passed"] == 1
    assert summary["gpu_tests"]["failed"] == ["test_fake::test_bad"]
    assert "FAILED" in log


@pytest.mark.parametrize("budget", [4])
def test_stops_within_its_budget(tmp_path, budget):
    rc, summary, log, elapsed = _run(
        tmp_path, GPU_CHECK_BUDGET_S=str(budget), GPU_CHECK_TESTS="sleep 60"
    )
    assert rc == 124
    assert summary["steps"]["gpu_tests"]["status"] == 124
    assert summary["steps"]["benchmark"]["status"] == 124  # no time left: skipped, counted
    assert elapsed < budget + 8, elapsed  # `sleep` stops at the signal; start-up
    assert "TIMED OUT" in log


def test_interrupted_tests_still_report_what_ran(tmp_path):
    """The tests step is stopped with SIGINT: pytest then writes its junit file and summary
    for the tests that ran, and the step counts as timed out."""
    body = "import time\n\ndef test_ok():\n    pass\n\ndef test_slow():\n    time.sleep(60)\n"
    rc, summary, log, elapsed = _run(
        tmp_path,
        GPU_CHECK_BUDGET_S="8",
        GPU_CHECK_BENCH_RESERVE_S="0",
        GPU_CHECK_TESTS=_pytest_cmd(tmp_path, body),
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
