#!/usr/bin/env bash
# One H200 (nvidia-h200), from the repository root: the Gluon sparse MLA kernel's GPU tests beside the
# other paged-attention GPU tests, then the decode kernels by rows (Gluon and Triton sparse MLA side by
# side; KERNELS=1: the kernel table too). Writes the test log, decode_rows_h200.* (and kernels_h200.*) to
# $OUT (default bench/results).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"
log="$OUT/gpu_tests_attention_gluon_h200.log"
echo "# tests/test_attention_gluon_cuda.py tests/test_attention_cuda.py tests/test_engine_cuda_graphs.py, $(date -u +%FT%TZ), commit ${COMMIT:-(not given)}" > "$log"
timeout 360 python3 -m pytest tests/test_attention_gluon_cuda.py tests/test_attention_cuda.py tests/test_engine_cuda_graphs.py -q -s -p no:cacheprovider \
  2>&1 | grep -v "^$" >> "$log"
echo "pytest exit ${PIPESTATUS[0]}" >> "$log"
grep -E "error|passed|failed|exit" "$log" | tail -25
timeout ${ROWS_TIMEOUT:-240} python3 bench/decode_rows.py --rows ${ROWS:-4,8,16,32,64} --context 32768 --reps 10 \
  --out "$OUT" --tag h200 2>&1 | tail -8
if [ -n "${KERNELS:-}" ]; then
  timeout 150 python3 -m pcppass bench kernels --rows 32,64 --context 16384,32768 --reps 10 --out "$OUT" --tag h200 \
    2>&1 | grep -E "sparse|V3.2|wrote|json" | tail -8
fi
