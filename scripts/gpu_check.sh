#!/usr/bin/env bash
# GPU checks for medseg.kernels, for a machine with an NVIDIA GPU (target: under 5 minutes).
#   1. builds the native extension with its CUDA sources (cached under ~/.cache/medseg);
#   2. runs the CUDA kernel tests (native vs reference on cuda) and the fused-layer tests;
#   3. runs the memory benchmark on the GPU at 96^3 (max_memory_allocated) for baseline, fused and
#      checkpoint, writing docs/bench-memory-gpu.json (and OUT_DIR/, when given, for collection).
# Usage: scripts/gpu_check.sh [PYTHON] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
OUT=${2:-}
start=$(date +%s)
"$PY" - <<'PY'
import time, torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, "cuda", torch.version.cuda)
t0 = time.time()
from medseg.kernels import native
mod = native.load()
print(f"native build/load {time.time() - t0:.1f} s, backend for cuda tensors: {native.backend_name('cuda')}")
assert native.backend_name("cuda") == "native-cuda", "CUDA kernels did not build; see the warning above"
PY
"$PY" -m pytest -q -x tests/test_kernels_native.py -k "Cuda or cuda" -p no:cacheprovider
"$PY" -m pytest -q -x tests/test_kernels.py -k "gradcheck or matches_in_float32 or exact_in_float64" -p no:cacheprovider
"$PY" -m medseg bench memory --device cuda --variants baseline fused checkpoint --json docs/bench-memory-gpu.json
if [ -n "$OUT" ]; then mkdir -p "$OUT" && cp docs/bench-memory-gpu.json "$OUT/"; fi
echo "gpu_check done in $(( $(date +%s) - start )) s"
