"""The decode attention kernels under Nsight Compute, one launch each (after a warm-up launch).

    ncu --clock-control none -k regex:'gqa_kernel|mla_kernel|indexer_kernel|select' --launch-skip-before-match 0 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis python bench/profile_attention.py --rows 32 --context 32768

``--clock-control none`` leaves the GPU's clocks as they are. The kernels run in this order:
fp8 GQA, fp8_ds_mla dense MLA (DeepSeek-V2 widths; ``mla_fp8_ds_mla_regs``: the kernel with its MMAs'
A operands in registers, not the launcher's), then DeepSeek-V3.2's indexer, top-2048 and
sparse MLA; each kernel twice, the first launch compiling it.
"""

from __future__ import annotations

import argparse

import torch

from pcppass.bench.kernels import V32, gqa_inputs, mla_inputs, v32_input_set
from pcppass.kernels.attention.launch import MLA_FP8_REGS_TILES, gqa_attention, indexer_scores, mla_attention
from pcppass.kernels.attention.select import select_topk_triton


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--kernels", default="gqa_fp8,mla_fp8_ds_mla,indexer,topk_select,sparse_mla",
                        help="which kernels to run, in this order")
    args = parser.parse_args()
    q, k, v, step, *scales = gqa_inputs(args.rows, args.context, True)
    q_lat, q_pe, mla_step, caches = mla_inputs(args.rows, args.context)
    s = v32_input_set(args.rows, args.context, 0)
    calls = {
        "gqa_fp8": lambda: gqa_attention(q, k, v, step, 0.088, *scales),
        "mla_fp8_ds_mla": lambda: mla_attention(q_lat, q_pe, caches[True], mla_step, 0.07, True),
        "mla_fp8_ds_mla_regs": lambda: mla_attention(q_lat, q_pe, caches[True], mla_step, 0.07, True,
                                                     tiles=MLA_FP8_REGS_TILES),
        "indexer": lambda: indexer_scores(s.q, s.w, s.icache, s.step, V32.dim),
        "topk_select": lambda: select_topk_triton(s.scores, V32.topk),
        "sparse_mla": lambda: mla_attention(s.q_lat, s.q_pe, s.mcache, s.step, 0.07, True, s.picked),
    }
    for name in args.kernels.split(","):
        call = calls[name]
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        print(f"ran {name}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
