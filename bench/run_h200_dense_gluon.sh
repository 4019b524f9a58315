#!/usr/bin/env bash
# One H200 (nvidia-h200), from the repository root: the Gluon MLA kernels' GPU tests (dense and
# sparse, TESTS= to narrow them with -k), then dense fp8_ds_mla MLA timed side by side: the launcher's
# Triton kernel and the package's Gluon kernels (warp-specialised; A operands in registers) at 1024 / 2048 /
# 4096 keys per split (VARIANTS=1: the
# bench's older restructurings too; PROBE=1: the Gluon kernel's partitions alone; KERNELS=1: the
# kernel table). Writes the test log, ds_mla_package_h200.* (ds_mla_variants_h200.* with VARIANTS=1; dense_mla_probe_h200.*,
# kernels_h200.*) to $OUT (default bench/results).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"
log="$OUT/gpu_tests_attention_gluon_dense_h200.log"
echo "# tests/test_attention_gluon_cuda.py tests/test_attention_cuda.py tests/test_engine_cuda_graphs.py -k '${TESTS:-}', $(date -u +%FT%TZ), commit ${COMMIT:-(not given)}" > "$log"
timeout ${TESTS_TIMEOUT:-360} python3 -m pytest tests/test_attention_gluon_cuda.py tests/test_attention_cuda.py \
  tests/test_engine_cuda_graphs.py -q -s -p no:cacheprovider -k "${TESTS:-}" 2>&1 | grep -v "^$" >> "$log"
echo "pytest exit ${PIPESTATUS[0]}" >> "$log"
grep -E "error|Error|passed|failed|exit" "$log" | tail -30
timeout ${BENCH_TIMEOUT:-240} python3 bench/ds_mla_variants.py --rows ${ROWS:-32,64} --context ${CONTEXT:-16384,32768} \
  --reps 10 --out "$OUT" --tag h200 $([ -z "${VARIANTS:-}" ] && echo --package-only) 2>&1 | tail -4
md="$OUT/ds_mla_$([ -z "${VARIANTS:-}" ] && echo package || echo variants)_h200.md"
[ -f "$md" ] && grep -E "^\||^#" "$md" | head -40
if [ -n "${PROBE:-}" ]; then
  timeout 150 python3 bench/dense_mla_probe.py --rows 32 --context 32768 --splits 2048 --out "$OUT" --tag h200 2>&1 \
    | grep "^|" | tail -8
fi
if [ -n "${KERNELS:-}" ]; then
  timeout 240 python3 -m pcppass bench kernels --rows 32,64 --context 16384,32768 --reps 10 --out "$OUT" --tag h200 \
    2>&1 | grep -E "mla|wrote|json" | tail -8
fi
