#!/usr/bin/env bash
# The GPU check: on a machine with a GPU and no network (the H200 image has jax 0.11.2 with
# CUDA, scikit-build-core, cmake, ninja, pybind11, nvcc), build the CUDA kernels, then, most
# valuable first: the kernel benchmark in loop mode on the production shapes, the main job's
# train step at batch 65,536, and the GPU tests (the CPU kernel tests, now against the GPU
# kernels, plus tests/*/test_gpu*.py), all within one time budget.
#
#   OUT=$OUT bash experiments/gpu_check.sh    # OUT defaults to ./results
#
# Outputs under $OUT (at most 7 files): gpu_check.txt (the whole log), gpu_check.json
# (versions, each step's status and seconds, the GPU test summary, every kernel's GB/s,
# fraction of the copy measured in the same run and ratio to XLA, the target bar per shape,
# the step's numbers), gpu_check_steps.tsv, gpu_tests.xml, kernels_gpu.json (the loop
# benchmark), gpu_step.json (the step), and kernels_gpu_full.json when time is left.
# kernels_gpu.json and gpu_step.json are rewritten as they go: a step stopped by its limit
# keeps what it measured.
#
# Exit status: 0 only when every step succeeded; otherwise the first failing step's status
# (124 when a step ran out of the budget). A failed build stops the script.
#
# Budget (GPU_CHECK_BUDGET_S, default 330 s): a lent GPU gives 15 minutes in all and at most
# 10 per command, including the machine's start; 330 s leaves room for a second run after a
# fix. Steps: build (at most 240 s), the loop benchmark (GPU_CHECK_BENCH_S, default 130 s; it
# stops starting ops 25 s before that, listing the rest as skipped), the step
# (GPU_CHECK_STEP_S, default 90 s; it skips its second, minimal-dense compile when half of
# that is spent), then the GPU tests with what is left (at most 180 s; on
# GPU_CHECK_TEST_WORKERS processes, default 4 when pytest-xdist is installed). The full loop
# benchmark runs only if GPU_CHECK_FULL_MIN_S (default 150 s) are still left, and its running
# out of time is recorded but is no failure.
#
# Each step can be replaced by a command string (for tests on a CPU machine, see
# tests/experiments/test_gpu_check_script.py): GPU_CHECK_BUILD, GPU_CHECK_BENCH, GPU_CHECK_STEP,
# GPU_CHECK_TESTS, GPU_CHECK_BENCH_FULL; GPU_CHECK_BENCH_ARGS and GPU_CHECK_STEP_ARGS are
# appended to the benchmark's and the step's own commands (the CPU test shrinks the shapes
# with them). GPU_CHECK_FAKE=1 skips nvidia-smi and nvcc.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.txt"
STEPS="$OUT/gpu_check_steps.tsv"
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-330}
FULL_MIN=${GPU_CHECK_FULL_MIN_S:-150}
FAKE=${GPU_CHECK_FAKE:-0}
START=$(date +%s)
: >"$LOG"
: >"$STEPS"
# Everything below goes to the terminal and the log; the status stays in this shell.
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!

status=0
left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME MAX_S CMD...: runs CMD under `timeout` (at most MAX_S, at most what is left of
# the budget), records its status and time, and keeps the first failure in $status. The
# signal is $STEP_SIGNAL (default TERM; the tests get INT, so that pytest still writes its
# summary and junit file for the tests that ran), then KILL 10 s later.
step() {
  local name=$1 max=$2
  shift 2
  local t
  t=$(left)
  if [ "$max" -lt "$t" ]; then t=$max; fi
  echo
  echo "### $name (limit ${t}s, $(left)s of ${BUDGET}s left)"
  if [ "$t" -le 0 ]; then
    echo "### $name: SKIPPED, the time budget is spent"
    printf '%s\t%s\t%s\n' "$name" 124 0 >>"$STEPS"
    [ "$status" -eq 0 ] && status=124
    return 124
  fi
  local t0 rc
  t0=$(date +%s)
  timeout -s "${STEP_SIGNAL:-TERM}" --kill-after=10 "$t" "$@"
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" $(($(date +%s) - t0)) >>"$STEPS"
  if [ "$rc" -ne 0 ]; then
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      echo "### $name: TIMED OUT after ${t}s"
    else
      echo "### $name: FAILED with status $rc"
    fi
    [ "$status" -eq 0 ] && status=$rc
  fi
  return "$rc"
}

date -u
echo "budget ${BUDGET}s, fake=$FAKE"
echo "### versions"
if [ "$FAKE" != 1 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  nvcc --version | tail -n 2 || echo "nvcc: not found"
fi
"$PY" - <<'EOF' || true
import importlib.metadata as md
import platform

print("python", platform.python_version())
for dist in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "scikit-build-core",
             "cmake", "ninja", "pybind11"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        pass
EOF

# GPU-specific files first: if the budget runs out, the kernel tests shared with the CPU
# are the ones left out.
GPU_TEST_FILES="tests/xla_ffi/test_gpu.py tests/xla_ffi/test_gpu_kernels.py tests/xla_ffi/test_gpu_hash_table.py tests/ops/test_kernel_contracts.py tests/training/test_gpu_training.py tests/ops/test_lookup.py tests/xla_ffi/test_kernels.py tests/xla_ffi/test_segment_sum.py tests/xla_ffi/test_abi_native.py tests/ops/test_stochastic_rounding.py"
BENCH_S=${GPU_CHECK_BENCH_S:-130}
STEP_S=${GPU_CHECK_STEP_S:-90}
if [ -z "${GPU_CHECK_TEST_WORKERS:-}" ]; then
  if "$PY" -c "import xdist" 2>/dev/null; then GPU_CHECK_TEST_WORKERS=4; else GPU_CHECK_TEST_WORKERS=0; fi
fi
# several test processes share the GPU: each allocates what it uses, not 75% of the memory
XDIST=""
if [ "$GPU_CHECK_TEST_WORKERS" -gt 0 ]; then XDIST="-n $GPU_CHECK_TEST_WORKERS"; fi
BUILD_CMD=${GPU_CHECK_BUILD:-"EMBARK_CUDA=ON EMBARK_CUDA_ARCHITECTURES=${EMBARK_CUDA_ARCHITECTURES:-90} $PY -m pip install --no-build-isolation --no-deps -q -e ."}
BENCH_CMD=${GPU_CHECK_BENCH:-"$PY -m experiments.kernels.main --gpu-quick --budget-s $((BENCH_S - 25)) --out $OUT/kernels_gpu.json ${GPU_CHECK_BENCH_ARGS:-}"}
STEP_CMD=${GPU_CHECK_STEP:-"$PY -m experiments.training.gpu_step --batch 65536 --budget-s $STEP_S --out $OUT/gpu_step.json ${GPU_CHECK_STEP_ARGS:-}"}
TESTS_CMD=${GPU_CHECK_TESTS:-"EMBARK_TEST_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -m pytest -q -p no:cacheprovider $XDIST --junitxml=$OUT/gpu_tests.xml $GPU_TEST_FILES"}

if step build 240 bash -c "$BUILD_CMD"; then
  if [ "$FAKE" != 1 ]; then step info 30 "$PY" -m embark_jax info; fi
  step benchmark "$BENCH_S" bash -c "$BENCH_CMD"
  step step "$STEP_S" bash -c "$STEP_CMD"
  STEP_SIGNAL=INT step gpu_tests 180 bash -c "$TESTS_CMD"
  if [ "$(left)" -ge "$FULL_MIN" ]; then
    # optional: running out of time here keeps the points measured and fails nothing
    before=$status
    full_s=$(($(left) - 10))
    BENCH_FULL_CMD=${GPU_CHECK_BENCH_FULL:-"$PY -m experiments.kernels.main --loop --budget-s $((full_s - 30)) --out $OUT/kernels_gpu_full.json"}
    step benchmark_full "$full_s" bash -c "$BENCH_FULL_CMD"
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=$before; fi
  else
    echo "### benchmark_full: skipped ($(left)s left, needs ${FULL_MIN}s)"
  fi
else
  echo "### BUILD FAILED: no benchmark, no step, no tests"
fi

elapsed=$(($(date +%s) - START))
"$PY" - "$OUT" "$status" "$elapsed" "$BUDGET" <<'EOF' || { [ "$status" -eq 0 ] && status=1; }
"""Collects the steps, the GPU test summary, the loop benchmark and the step into
gpu_check.json (each part from whatever its step wrote, complete or not)."""
import json
import os
import sys
import xml.etree.ElementTree as ET

out, status, elapsed, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
result = {"exit_status": status, "elapsed_s": elapsed, "budget_s": budget, "steps": {}}
with open(os.path.join(out, "gpu_check_steps.tsv")) as fh:
    for line in fh:
        name, rc, secs = line.rstrip("\n").split("\t")
        result["steps"][name] = {"status": int(rc), "seconds": int(secs)}
junit = os.path.join(out, "gpu_tests.xml")
if os.path.exists(junit):
    suites = ET.parse(junit).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    summary = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    summary["passed"] = summary["tests"] - summary["failures"] - summary["errors"] - summary["skipped"]
    summary["failed"] = [
        f"{c.get('classname')}::{c.get('name')}"
        for s in suites for c in s.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    result["gpu_tests"] = summary


def load(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError) as e:  # a file cut short by a kill
        return {"unreadable": f"{type(e).__name__}: {e}"}


FLAT = ("ffi_GBps", "xla_GBps", "fraction_of_copy", "speedup", "iters")
kernels, headline = {}, {}
for mode, fname in (("quick", "kernels_gpu.json"), ("full", "kernels_gpu_full.json")):
    bench = load(fname)
    if bench is None:
        continue
    rows = {}
    for p in bench.get("points", []):
        rows[p["point"]["name"]] = {
            k: {f: p[k][f] for f in FLAT if f in p[k]}
            | {"xla_fraction_of_copy": p[k].get("libs", {}).get("xla", {}).get("fraction_of_copy")}
            for k in p if isinstance(p[k], dict) and "ffi_GBps" in p[k]
        }
    kernels[mode] = {
        "backend": bench.get("backend"),
        "device": bench.get("devices"),
        "copy_GBps": bench.get("copy_GBps"),
        "complete": bench.get("complete"),
        "checks_ok": bench.get("checks_ok"),
        "skipped": len(bench.get("skipped", [])),
        "points": rows,
    }
    try:
        from experiments.kernels.loop import headline as bars

        headline[mode] = bars(bench)
    except Exception as e:  # an older or partial file: the rows above still stand
        headline[mode] = f"{type(e).__name__}: {e}"
result["kernels"] = kernels
result["headline"] = headline
step = load("gpu_step.json")
if step is not None:
    keep = ("phases", "batch", "devices", "plan", "predicted", "compile", "memory_analysis",
            "memory", "skipped", "unreadable")
    result["step"] = {k: step[k] for k in keep if k in step}
    if "step" in step:
        result["step"]["step"] = {k: v for k, v in step["step"].items() if k != "times_s"}
    if "embedding_only" in step:
        e = step["embedding_only"]
        result["step"]["embedding_only"] = {k: e[k] for k in ("median_s", "min_s", "share")}
    if "hlo" in step:
        result["step"]["hlo"] = {k: v for k, v in step["hlo"].items() if k != "ops"}
with open(os.path.join(out, "gpu_check.json"), "w") as fh:
    json.dump(result, fh, indent=1)
print(json.dumps({k: result[k] for k in ("exit_status", "elapsed_s", "steps")}))
print("wrote", os.path.join(out, "gpu_check.json"))
EOF

echo "### exit status $status after ${elapsed}s (budget ${BUDGET}s)"
exec 1>&- 2>&-
wait "$TEE_PID" 2>/dev/null
exit "$status"
