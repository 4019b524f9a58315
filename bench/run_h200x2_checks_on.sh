#!/usr/bin/env bash
# docs/BENCH.md's first table ("Decode steps with the checks on"): the README's decode-step configuration with
# the run-time checks on (nvidia-h200-x2, from the repository root; installs pcppass editable). Results:
# bench/results/bench_h200x2_checks_on_l2.* and, when it fits in the time left, bench_h200x2_checks_on_l16.*;
# the summary table is printed last.
#   stage 1: llama and deepseek_v32, 2 layers, P = 2, 32 rows per rank, 32k context, caches in symmetric
#            memory: replicated; pcppass deferred with the backend's automatic transport (peer stores there)
#            and with the all-gather transport forced, each with SyncChecks() on and, beside it, every check
#            off; no sync. Eager and CUDA-graph replay; after each variant's replays one replay with rotated
#            owners at a fresh position, then the device status and every cache compared across ranks.
#   stage 2 (only if >= 75 s are left): deepseek_v32, 16 layers, ordinary caches (the all-gather transport):
#            replicated, pcppass deferred (checks on), no sync.
# Everything in one call of at most BUDGET_S seconds (default 180). NVLink multicast stays off.
# Run on 2026-12-01 (BUDGET_S=560, 182 s): every variant captured, replicas equal after the replays, checks add
# 1.1-9.7 us per step (<= 0.40%); bench/results/bench_h200x2_checks_on_l{2,16}.*.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
BUDGET=${BUDGET_S:-180}
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip_checks_on.log" 2>&1 \
  || { tail -5 "$OUT/pip_checks_on.log"; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))"

T1=$(($(left) - 8))
echo "stage 1: ${T1} s"
timeout "$T1" python3 -m pcppass bench --model llama,deepseek_v32 --layers 2 --world 2 --rows-per-rank 32 \
  --context 32768 --variants replicated,deferred,deferred_allgather,nosync --also-checks-off --symmetric-caches \
  --cuda-graph --smoke-steps 2 --warmup 3 --reps 20 --out "$OUT" --tag h200x2_checks_on_l2 --timeout $((T1 - 4)) \
  > "$OUT/bench_h200x2_checks_on_l2.log" 2>&1
rc=$?
echo "stage 1 exit $rc"
grep "^\[bench" "$OUT/bench_h200x2_checks_on_l2.log" | cut -c1-220 | tail -20
[ "$rc" -ne 0 ] && tail -25 "$OUT/bench_h200x2_checks_on_l2.log" | cut -c1-300

T2=$(($(left) - 6))
if [ "$T2" -ge 75 ]; then
  echo "stage 2: ${T2} s"
  timeout "$T2" python3 -m pcppass bench --model deepseek_v32 --layers 16 --world 2 --rows-per-rank 32 \
    --context 32768 --variants replicated,deferred,nosync --cuda-graph --smoke-steps 2 --warmup 2 --reps 10 \
    --out "$OUT" --tag h200x2_checks_on_l16 --timeout $((T2 - 4)) > "$OUT/bench_h200x2_checks_on_l16.log" 2>&1
  rc=$?
  echo "stage 2 exit $rc"
  [ "$rc" -ne 0 ] && tail -15 "$OUT/bench_h200x2_checks_on_l16.log" | cut -c1-300
  grep "^\[bench" "$OUT/bench_h200x2_checks_on_l16.log" | cut -c1-220 | tail -6
else
  echo "stage 2 not run: ${T2} s left"
fi

for f in "$OUT"/bench_h200x2_checks_on_l*.md; do
  echo "== $f"; grep -E "after the timed|not captured|checks add|symmetric memory:|### error" "$f" | cut -c1-300
done
# the summary table of docs/BENCH.md from whichever results (or partial results) were written
python3 - "$OUT"/bench_h200x2_checks_on_l2.json "$OUT"/bench_h200x2_checks_on_l16.json \
  "$OUT"/bench_h200x2_checks_on_l2.partial.json "$OUT"/bench_h200x2_checks_on_l16.partial.json <<'PY'
import json, sys
from pathlib import Path
from pcppass.bench.step_report import summary_table
found = [Path(p) for p in sys.argv[1:] if Path(p).exists()]
print(summary_table([json.loads(p.read_text()) for p in found]) if found else "no results")
PY
echo "total $(( $(date +%s) - START )) s"
