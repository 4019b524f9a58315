#!/usr/bin/env bash
# Correctness on 2x H200 at the current commit (nvidia-h200-x2, from the repository root; installs pcppass
# editable), in one call. Logs and JSON under $OUT (default bench/results):
#   1. the GPU tests (tests/*_cuda.py): kernels, attention, row kernels, sync transports under graph replay;
#   2. `pcppass run` on CUDA (NCCL) with the default SyncChecks (state digest, liveness watch, slot checks);
#   3. a rank SIGKILLed mid-step on NCCL: its peer must raise PcpSyncError naming it (liveness watch
#      with a 5 s timeout, process-group timeout 60 s so the NCCL watchdog is not what ends the wait).
# docs/BENCH.md, "Correctness on the GPUs"; docs/FAILURE_MODES.md (the NCCL fault).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
START=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip_verify.log" 2>&1 \
  || { tail -5 "$OUT/pip_verify.log"; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))"

timeout 170 python3 -m pytest tests/test_kernels_cuda.py tests/test_attention_cuda.py tests/test_row_kernels_cuda.py \
  tests/test_sync_transports_cuda.py tests/test_analysis_triton_cuda.py -q -p no:cacheprovider -W ignore \
  > "$OUT/gpu_tests_verify_h200x2.log" 2>&1
echo "gpu tests exit $? ($(( $(date +%s) - START )) s): $(tail -1 "$OUT/gpu_tests_verify_h200x2.log")"

timeout 150 python3 -m pcppass run --device cuda --world 2 --model deepseek_v32 --steps 16 \
  > "$OUT/run_cuda_h200x2_deepseek_v32_checks.log" 2>&1
echo "pcppass run exit $? ($(( $(date +%s) - START )) s)"
grep -E "tokens equal|digests equal|collectives per|transport \(decode" "$OUT/run_cuda_h200x2_deepseek_v32_checks.log" | cut -c1-120

timeout 110 python3 tests/rank_fault.py --backend nccl --world 2 --victim 1 --step-kind decode --pg-timeout 60 \
  --deadline 90 --liveness-timeout 5 --out "$OUT/fault_sigkill_nccl_liveness_h200x2.json" \
  > /dev/null 2> "$OUT/fault_sigkill_nccl_liveness_h200x2.log"
echo "nccl fault exit $? ($(( $(date +%s) - START )) s)"
python3 - "$OUT/fault_sigkill_nccl_liveness_h200x2.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print("exitcodes", s["exitcodes"], "hung", s["hung"])
for r, o in s["outcomes"].items():
    print("rank", r, o["error"], "after", o["after_death_s"], "s:", o["message"][:300])
PY

echo "total $(( $(date +%s) - START )) s"
