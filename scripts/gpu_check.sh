#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU and PyTorch (under 8 minutes): the PyTorch-CUDA
# backend with and without CUDA graphs (equality checks, step latency by Q, tokens/s) and the
# CUDA-marked tests. Installs only the small pure-Python needs when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible to torch'"
# a machine without internet keeps what it has: the check needs no more than these
"$PY" -c "import tokenizers, jinja2, click, tqdm, onnx, onnxruntime, safetensors, pytest" 2>/dev/null \
  || "$PY" -m pip install -q tokenizers jinja2 click tqdm onnx onnxruntime safetensors pytest \
  || echo "gpu_check: could not install missing packages (offline?); going on with what is installed"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# both parts run whatever the first one says (set -e would skip the tests after a failed check);
# the exit status is non-zero when either failed
status=0
timeout 420 "$PY" scripts/gpu_check.py || status=$?
timeout 240 "$PY" -m pytest -q -rs tests/test_torch_device.py tests/test_trt_runtime.py -p no:cacheprovider || status=$?
echo "gpu_check: $([ "$status" -eq 0 ] && echo PASS || echo "FAIL (status $status)")"
exit "$status"
