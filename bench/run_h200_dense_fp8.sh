#!/usr/bin/env bash
# One H200 (nvidia-h200), from the repository root: the dense Gluon MLA GPU tests of the kernel with
# fp8 scores on the raw codes (gluon_dense_fp8; TESTS= to widen or narrow them with -k), then dense
# fp8_ds_mla MLA timed side by side (the launcher's Triton kernel and every package Gluon kernel at
# 1024 / 2048 / 4096 keys per split), then the fp8 kernel's stages left out at 32 rows, 32k.
# Writes the test log, ds_mla_package_fp8_h200.* and dense_mla_fp8_probe_h200.* to $OUT
# (default bench/results).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"
log="$OUT/gpu_tests_attention_gluon_fp8_h200.log"
echo "# tests/test_attention_gluon_cuda.py -k '${TESTS:-dense and fp8}', $(date -u +%FT%TZ), commit ${COMMIT:-(not given)}" > "$log"
timeout ${TESTS_TIMEOUT:-300} python3 -m pytest tests/test_attention_gluon_cuda.py -q -s -p no:cacheprovider \
  -k "${TESTS:-dense and fp8}" 2>&1 | grep -v "^$" >> "$log"
echo "pytest exit ${PIPESTATUS[0]}" >> "$log"
grep -E "error|Error|passed|failed|exit|dense" "$log" | tail -30
timeout ${BENCH_TIMEOUT:-300} python3 bench/ds_mla_variants.py --rows ${ROWS:-32,64} --context ${CONTEXT:-16384,32768} \
  --reps 10 --out "$OUT" --tag fp8_h200 --package-only 2>&1 | tail -3
grep -E "^\||^#" "$OUT/ds_mla_package_fp8_h200.md" | head -60
timeout 200 python3 bench/dense_mla_regs_probe.py --kernel fp8 --rows 32 --context 32768 --splits 2048,4096 \
  --out "$OUT" --tag h200 2>&1 | grep "^|" | tail -12
