#!/usr/bin/env bash
# The GPU checks of the KV store, as one script for a lent device (15 minutes of device time in all):
# build csrc/store.cu, run the CUDA tests (the store's, and the tiered cache with its pools on the GPU),
# run the kv fuzz machine on CUDA for 60 s, run the store benchmark (checked and fast modes; rows 1..65536,
# head_dim 128, 8 KV heads, bf16), and leave logs and a JSON of results under $OUT.
# Needs torch, cffi, hypothesis and pytest.
#
#   run with timeout_s <= 300:  bash tests/gpu/run_gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/radixspec-gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RADIXSPEC_CACHE="$PWD/build/cuda"
status=0
{
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.txt"
# the C helpers (CPU path) in place, if cffi is there; the CUDA path needs only cffi's ABI mode
python3 csrc/build_ffi.py >"$OUT/build_cffi.log" 2>&1 || echo "cffi module not built (CPU path unavailable here)"
python3 -m optimized.build_cuda 2>&1 | tee "$OUT/build_cuda.log" || status=1
if python3 -c "import pytest" 2>/dev/null; then
  python3 -m pytest --noconftest -p no:cacheprovider -q tests/optimized/test_kv_store.py tests/optimized/test_tiered_cache.py -k "cuda" 2>&1 | tee "$OUT/cuda_tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  echo "pytest missing: CUDA tests not run" | tee "$OUT/cuda_tests.log"
  status=1
fi
python3 -m fuzz --machine kv --device cuda --minutes 1 --quiet 2>&1 | tee "$OUT/kv_machine_cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 tests/gpu/bench_store_gpu.py --device cuda --out "$OUT/store_bench.json" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
