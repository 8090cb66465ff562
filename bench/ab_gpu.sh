#!/usr/bin/env bash
# One lease on one H200: this tree against a base tree carried as .wt/base
# (git archive REV | tar -x -C .wt/base), and any variant trees named in
# VARIANTS (.wt/<name>, each with a REV file saying what it is), built side by
# side for sm_90. This tree's GPU tests first, then the codec benches
# alternating base, this, variants, ... on the same seeded tensors (ROUNDS
# rounds), then this tree's hostile-stream fuzz under compute-sanitizer
# memcheck for what is left of BUDGET_S, and a side-by-side table
# (bench/ab_table.py, $OUT/ab_table.txt). ARGS replaces the bench arguments.
#   bash bench/ab_gpu.sh      (logs and JSON under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-bench/results/run} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
t0=$(date +%s)
budget=${BUDGET_S:-540}
variants=${VARIANTS:-}
rm -rf build .wt/base/build
for v in $variants; do rm -rf ".wt/$v/build"; done
{ date -u +%FT%TZ; cat .wt/base/REV 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvcc --version | tail -2; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  for v in $variants; do echo "$v: $(cat ".wt/$v/REV")"; done; } 2>&1 | tee "$OUT/machine.txt"
(cd .wt/base && PZ_BACKEND=cuda PZ_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/base . \
  > "$OUT/build_base.log" 2>&1; echo "build_base rc=$?" >> "$OUT/steps.txt") &
for v in $variants; do
  (cd ".wt/$v" && PZ_BACKEND=cuda PZ_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps --target "/tmp/$v" . \
    > "$OUT/build_$v.log" 2>&1; echo "build_$v rc=$?" >> "$OUT/steps.txt") &
done
PZ_BACKEND=cuda PZ_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1
echo "build rc=$?" >> "$OUT/steps.txt"
python3 -P -m pytest -q -p no:cacheprovider -m "not slow" -k "not asan" tests/test_gpu.py tests/test_golden.py \
  tests/test_roundtrip.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu_tests rc=$? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
tail -n 3 "$OUT/gpu_tests.log"
wait
echo "builds done after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
if [ -n "${ARGS:-}" ]; then eval "args=($ARGS)"
else args=(--systems ours --sizes 4MiB,64MiB,256MiB,1GiB --tensors "bf16 N(0,0.02^2)" --batch-size '' --reps 20); fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  PYTHONPATH=/tmp/base python3 -P .wt/base/bench/codec.py "${args[@]}" --json "$OUT/base-r$round.json" \
    > "$OUT/bench_base_r$round.log" 2>&1
  python3 -P bench/codec.py "${args[@]}" --json "$OUT/this-r$round.json" > "$OUT/bench_this_r$round.log" 2>&1
  for v in $variants; do
    PYTHONPATH="/tmp/$v" python3 -P ".wt/$v/bench/codec.py" "${args[@]}" --json "$OUT/$v-r$round.json" \
      > "$OUT/bench_${v}_r$round.log" 2>&1
  done
  echo "bench round $round after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
done
left=$(( budget - ($(date +%s) - t0) - 40 ))
[ "$left" -gt 30 ] && bash bench/gpu_memcheck_fuzz.sh "$left"
python3 -P bench/ab_table.py "$OUT" | tee "$OUT/ab_table.txt"
cat "$OUT/steps.txt"
