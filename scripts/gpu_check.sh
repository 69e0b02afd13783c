#!/usr/bin/env bash
# The one command on a machine with an NVIDIA GPU and CUDA PyTorch (no internet, no virtualenv
# needed; under 8 minutes):
#
#     bash scripts/gpu_check.sh
#
# scripts/gpu_check.py's blocks (its docstring says what each decides), then the GPU tests. The
# results go to $OUT (else bench/results/gpu-check-DATE): gpu-check.json and gpu-check.log after
# every block, pytest.log. The time limits (360 s + 150 s) stay under a 10-minute command.
# PYTHON: the interpreter (default python3). Exit status non-zero if either part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export OUT=${OUT:-bench/results/gpu-check-$(date -u +%Y-%m-%d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA GPU (torch.cuda.is_available() is False); on a CPU machine run:"
  echo "    python scripts/gpu_check.py --device cpu"
  exit 2
fi
status=0
timeout 360 "$PY" scripts/gpu_check.py --budget 320 || status=$?
# the TensorRT tests only where a TensorRT is installed (their CPU half needs tensorrt_rtx to build)
tests=(tests/test_torch_device.py)
if "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('tensorrt') or u.find_spec('tensorrt_rtx') else 1)"; then
  tests+=(tests/test_trt_runtime.py)
else
  echo "gpu_check: tests/test_trt_runtime.py left out: neither tensorrt nor tensorrt_rtx is installed"
fi
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 150 "$PY" -m pytest -q -rs -p no:warnings -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$OUT/pytest.log"
  pstatus=${PIPESTATUS[0]}
  [ "$pstatus" -eq 0 ] || status=$pstatus
else
  echo "gpu_check: pytest is not installed here: the GPU tests did not run (not a pass)"
  [ "$status" -ne 0 ] || status=3
fi
echo "gpu_check: $([ "$status" -eq 0 ] && echo PASS || echo "FAIL (status $status)")"
exit "$status"
