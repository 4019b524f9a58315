#!/usr/bin/env bash
# The P=2 runs behind bench/results/*h200x2* (nvidia-h200-x2, from the repository root, uninstalled checkout).
# NVLink multicast stays off on shared GPU hosts; every multi-GPU command has a timeout.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
# 1. sync-cost microbenchmark (61 layers, real pcppass::sync_* ops); the model part of this run failed (see BENCH.md)
timeout 575 python3 -m pcppass bench --model deepseek_v32 --world 2 --rows-per-rank 8,32 --context 4096,32768 \
  --sync-microbench --micro-rows 8,32,128 --out "$OUT" --tag h200x2_deepseek_v32 --timeout 565
# 2. decode steps, host-sync-free sync kernels (pcppass.kernels.rows_cuda)
timeout 580 python3 -m pcppass bench --model deepseek_v32,llama --world 2 --rows-per-rank 8,32 \
  --context 4096,16384,32768 --out "$OUT" --tag h200x2_models --timeout 570
# 3. the same with the reference (plain-torch) sync ops
timeout 400 python3 -m pcppass bench --model deepseek_v32,llama --world 2 --rows-per-rank 8,32 --context 4096,32768 \
  --sync-kernels reference --variants deferred,nosync,replicated --out "$OUT" \
  --tag h200x2_models_reference_sync_ops --timeout 390
# 4. one-launch sync (sync_pack + sync_scatter_rows_all in Triton) vs the per-cache ops, 61-layer microbenchmark,
#    plus a 2-layer llama step under CUDA graphs (cache-write ops without host reads); GPU tests first
python3 -m pytest tests/test_row_kernels_cuda.py tests/test_kernels_cuda.py -q -x -p no:cacheprovider
timeout 400 python3 -m pcppass bench --model llama --layers 2 --world 2 --rows-per-rank 8 --context 4096 \
  --variants replicated,deferred,nosync --cuda-graph --sync-microbench --micro-rows 8,32,128 --out "$OUT" \
  --tag h200x2_sync_batched --timeout 390
# 5. (nvidia-h200-x2) GPU tests, the engine end to end on NCCL, and deepseek_v32 steps under CUDA graphs
python3 -m pytest tests/test_analysis_triton_cuda.py tests/test_row_kernels_cuda.py tests/test_kernels_cuda.py -q -p no:cacheprovider
timeout 280 python3 -m pcppass run --model deepseek_v32 --world 2 --steps 24 --device cuda --inner inductor
timeout 230 python3 -m pcppass bench --model deepseek_v32 --layers 2 --world 2 --rows-per-rank 8,32 --context 32768 \
  --variants replicated,deferred,nosync --cuda-graph --out "$OUT" --tag h200x2_v32_cudagraph --timeout 220
# 6. (nvidia-h200-x4) P = 4: both models under CUDA graphs, and the 61-layer sync microbenchmark
timeout 470 python3 -m pcppass bench --model llama,deepseek_v32 --layers 2 --world 4 --rows-per-rank 8,32 --context 32768 \
  --variants replicated,immediate,deferred,nosync --cuda-graph --sync-microbench --micro-rows 8,32,128 \
  --out "$OUT" --tag h200x4_p4 --timeout 460
