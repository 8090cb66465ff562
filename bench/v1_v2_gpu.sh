#!/usr/bin/env bash
# One lease on one H200: what format v2's checksums cost on the GPU, v1 and v2
# side by side in one run on the same (seeded) tensors, alternating v1, v2,
# v1, v2; then the v2 hostile-stream fuzz under compute-sanitizer memcheck for
# what is left of BUDGET_S; then the Communicator's guard cost over gloo on
# this machine's quiet CPU. v1's source comes as the carried .wt/v1
# (git archive 55f15d5 | tar -x -C .wt/v1).
#   bash bench/v1_v2_gpu.sh      (logs and JSON under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-bench/results/run} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
t0=$(date +%s)
budget=${BUDGET_S:-500}
rm -rf build .wt/v1/build
{ date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvcc --version | tail -2; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } \
  2>&1 | tee "$OUT/machine.txt"
# Both builds at once (16 cores): v1 into its own target, v2 into site-packages.
(cd .wt/v1 && PZ_BACKEND=cuda PZ_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/v1 . \
  > "$OUT/build_v1.log" 2>&1; echo "build_v1 rc=$?" >> "$OUT/steps.txt") &
PZ_BACKEND=cuda PZ_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build_v2.log" 2>&1
echo "build_v2 rc=$?" >> "$OUT/steps.txt"
wait
echo "builds done after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
args=(--systems ours --sizes 4MiB,256MiB,1GiB --tensors "bf16 N(0,0.02^2)" --dtype-size '' --batch-size '' --reps 20)
# v1's tree predates portable_zip/bench/: its codec bench is still the module portable_zip.codec_bench.
for round in 1 2; do
  (cd /tmp && PYTHONPATH=/tmp/v1 python3 -P -m portable_zip.codec_bench "${args[@]}" --json "$OUT/v1-r$round.json") \
    > "$OUT/bench_v1_r$round.log" 2>&1 || true
  python3 -P bench/codec.py "${args[@]}" --json "$OUT/v2-r$round.json" > "$OUT/bench_v2_r$round.log" 2>&1
  echo "bench round $round after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
done
python3 -P bench/guard_cost.py --backend gloo --reps 200 --json "$OUT/guard-cost-gloo.json" > "$OUT/guard.log" 2>&1
echo "guard rc=$? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
left=$(( budget - ($(date +%s) - t0) - 40 ))
[ "$left" -gt 30 ] && bash bench/gpu_memcheck_fuzz.sh "$left"
tail -n 8 "$OUT"/bench_v*_r2.log "$OUT/guard.log"
cat "$OUT/steps.txt"
