#!/usr/bin/env bash
# Mutated streams through the GPU decoder under compute-sanitizer memcheck for
# SECONDS (up to 20,000 streams), into $OUT/memcheck.log; a line in
# $OUT/steps.txt. The lease scripts (gpu_integrity.sh, ab_gpu.sh) call it
# with what is left of their budget.
#   bash bench/gpu_memcheck_fuzz.sh SECONDS
set -uo pipefail
cd "$(dirname "$0")/.."
secs=$1
t0=$(date +%s)
# Two thirds of the time to whole streams, a quarter to mutated tables.
PYTORCH_NO_CUDA_MEMORY_CACHING=1 PZ_GPU_FUZZ=20000 PZ_GPU_FUZZ_SECONDS=$(( secs * 2 / 3 )) \
  PZ_GPU_TABLE_FUZZ=20000 PZ_GPU_TABLE_FUZZ_SECONDS=$(( secs / 4 )) timeout $(( secs + 60 )) \
  compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 20 \
  python3 -P -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k "mutated or raw_streams or checksums" \
  > "$OUT/memcheck.log" 2>&1
rc=$?
echo "memcheck rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
grep -E "gpu (table )?fuzz|ERROR SUMMARY|passed|failed" "$OUT/memcheck.log"
exit $rc
