#!/usr/bin/env bash
# The runs behind bench/results/*attention*, kernels_h200.*, serve_h200x2_llama.* (nvidia-h200-x2, from the
# repository root; installs pcppass editable). As run on 2026-11-30:
#   stage 1 (commit 3870726): GPU tests of the paged attention kernels (GPU 1) beside the kernel bench (GPU 0),
#            decode steps with the kernels (2 layers, llama and deepseek_v32, P = 2, eager and CUDA graphs),
#            the serving bench (llama, 2 layers, 32 requests per run)
#   stage 16 (commit 3870726): decode steps of a 16-layer deepseek_v32
#   stage kernels (commit 2b66941): the GPU tests and the kernel bench again (the published kernel table)
#   stage 2: not run yet (device budget): 16-layer llama, DeepSeek-V3.2 serving with 64 requests per run
# NVLink multicast stays off on shared GPU hosts; every multi-GPU command has a timeout.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))"
kernel_bench() {
  (CUDA_VISIBLE_DEVICES=1 timeout 100 python3 -m pytest tests/test_attention_cuda.py -q -p no:cacheprovider \
     > "$OUT/gpu_tests_attention_h200.log" 2>&1; echo "pytest exit $?" >> "$OUT/gpu_tests_attention_h200.log") &
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pcppass bench kernels --rows 32,64 --context 16384,32768 --reps 10 \
    --out "$OUT" --tag h200 2>&1 | grep -v "^|"
  wait
  tail -3 "$OUT/gpu_tests_attention_h200.log"
}
case "${1:-1}" in
1)
  kernel_bench
  timeout 110 python3 -m pcppass bench --model llama,deepseek_v32 --layers 2 --world 2 --rows-per-rank 8,32 \
    --context 32768 --variants replicated,immediate,deferred,deferred_nochecks,nosync --cuda-graph \
    --out "$OUT" --tag h200x2_attention_l2 --timeout 105 | tail -30
  timeout 130 python3 -m pcppass bench serve --model llama --layers 2 --world 2 --requests 32 --no-progress \
    --out "$OUT" --tag h200x2_llama --timeout 125 | tail -30
  ;;
16)
  timeout 150 python3 -m pcppass bench --model deepseek_v32 --layers 16 --world 2 --rows-per-rank 32 --context 32768 \
    --variants replicated,immediate,deferred,deferred_nochecks,nosync --cuda-graph \
    --out "$OUT" --tag h200x2_attention_l16 --timeout 145
  ;;
kernels)
  kernel_bench
  ;;
2)
  timeout 400 python3 -m pcppass bench --model llama --layers 16 --world 2 --rows-per-rank 32 \
    --context 32768 --variants replicated,immediate,deferred,deferred_nochecks,nosync --cuda-graph \
    --out "$OUT" --tag h200x2_attention_l16_llama --timeout 390
  timeout 590 python3 -m pcppass bench serve --model deepseek_v32 --layers 2 --world 2 \
    --out "$OUT" --tag h200x2_v32 --timeout 580
  ;;
esac
