#!/usr/bin/env bash
# The GPU check: on a machine with a GPU and no network (the H200 image has jax 0.11.2 with
# CUDA, scikit-build-core, cmake, ninja, pybind11, nvcc), build the CUDA kernels, run the GPU
# tests (the CPU kernel tests, now against the GPU kernels, plus tests/test_gpu.py) and the
# kernel benchmark. Everything goes to one results file: $OUT/gpu_check.txt (+ JSON).
#
#   bash experiments/gpu_check.sh            # OUT defaults to ./results
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.txt"
PY=${PYTHON:-python3}
status=0
run() { echo; echo "### $*"; "$@" || status=$?; }
{
  date
  run nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  run "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  echo "### build (CUDA on, sm_90)"
  EMBARK_CUDA=ON EMBARK_CUDA_ARCHITECTURES="${EMBARK_CUDA_ARCHITECTURES:-90}" \
    "$PY" -m pip install --no-build-isolation --no-deps -q -e . || { echo "BUILD FAILED"; exit 1; }
  run "$PY" -m embark_jax info
  echo "### GPU tests"
  EMBARK_TEST_GPU=1 run "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py \
    tests/test_kernels.py tests/test_ffi_segment_sum.py
  echo "### kernel benchmark"
  run "$PY" -m experiments.kernels.main --out "$OUT/kernels_gpu.json"
  echo "### exit status $status"
} 2>&1 | tee "$LOG"
exit "$status"
