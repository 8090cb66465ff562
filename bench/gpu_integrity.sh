#!/usr/bin/env bash
# One lease on one H200 for format v2 (checksums): build for sm_90, the GPU
# tests (GPU bytes == CPU bytes, v1 goldens, raw kernel, checksums), the codec
# bench at 4 MiB / 256 MiB / 1 GiB, then as many mutated streams as fit under
# compute-sanitizer memcheck in what is left of BUDGET_S seconds.
#   bash bench/gpu_integrity.sh      (logs and JSON under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-bench/results/run} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$OUT"
t0=$(date +%s)
budget=${BUDGET_S:-540}
rm -rf build  # a CPU build's CMake cache from the dev machine
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -2
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } 2>&1 | tee "$OUT/machine.txt"
PZ_BACKEND=cuda PZ_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1
echo "build rc=$? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
timeout 240 python3 -P -m pytest -q -p no:cacheprovider -m "not slow" tests/test_gpu.py tests/test_golden.py \
  tests/test_errors.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
echo "gpu_tests rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
timeout 150 python3 -P bench/codec.py --systems ours --sizes 4MiB,256MiB,1GiB --tensors "bf16 N(0,0.02^2)" \
  --dtype-size 256MiB --batch-size '' --reps 20 --json "$OUT/h200-codec-v2.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
tail -25 "$OUT/bench.log"
left=$(( budget - ($(date +%s) - t0) - 45 ))  # sanitizer start-up and the closing round trip
[ "$left" -gt 30 ] && bash bench/gpu_memcheck_fuzz.sh "$left"
cat "$OUT/steps.txt"
