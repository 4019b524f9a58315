"""What bounds the dense fp8_ds_mla Gluon kernel (``gluon_kernels.dense_mla_kernel``), timed on one GPU.

    python bench/dense_mla_probe.py --rows 32 --context 32768 --out bench/results --tag h200

Each probe keeps some of the kernel's warp groups and replaces the others with stand-ins that only
pass the ring's mbarriers on, so its time is what those warp groups alone need:

* ``kernel``: the package's kernel (``launch.dense_mla_gluon``);
* ``mma only``: the scores and values warp groups over whatever the ring holds (a stand-in marks each
  slot full as soon as it is free): the MMAs, the softmax and the hand-over between the two;
* ``scores only`` / ``values only``: one MMA warp group, the other a stand-in;
* ``dequant only``: the dequant warps, a stand-in consumer freeing each slot once full: the loads
  and conversions;
* ``copies only``: the dequant warps' box rows and TMA copies, no conversion.

Outputs of the probes are meaningless; the kernel's output is compared with the launcher's Triton
kernel. Writes ``<out>/dense_mla_probe_<tag>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from pcppass.kernels.attention.gluon_kernels import (
    DENSE_BN,
    DENSE_DEQUANT_REGS,
    DENSE_DEQUANT_WARPS,
    DENSE_HEADS,
    DENSE_VALUES_REGS,
    LATENT,
    _dense_box_slots,
    _dense_dequant_warps,
    _dense_load_tile,
    _dense_scores_warps,
    _dense_values_warps,
    dense_descriptors,
    dense_program,
    dense_shared_memory,
)


@gluon.jit
def _fill_standin(kv_ready, kv_empty, unit_bufs, lo, hi, BN: gl.constexpr, H: gl.constexpr):
    """Marks each ring slot full (unit 1) as soon as it is free."""
    unit_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    for i in range(gl.cdiv(hi - lo, BN)):
        slot = i % 2
        mbarrier.wait(kv_empty.index(slot), ((i // 2) & 1) ^ 1)
        unit_bufs.index(slot).store(gl.full([H], 1.0, gl.float32, unit_l))
        fence_async_shared()
        mbarrier.arrive(kv_ready.index(slot), count=1)


@gluon.jit
def _drain_standin(kv_ready, kv_empty, lo, hi, BN: gl.constexpr):
    """Frees each ring slot as soon as it is full."""
    for i in range(gl.cdiv(hi - lo, BN)):
        slot = i % 2
        mbarrier.wait(kv_ready.index(slot), (i // 2) & 1)
        mbarrier.arrive(kv_empty.index(slot), count=1)


@gluon.jit
def _scores_standin(p_ready, p_free, kv_ready, lo, hi, BN: gl.constexpr):
    """Hands each full slot to the values warps at once (no scores)."""
    for i in range(gl.cdiv(hi - lo, BN)):
        slot = i % 2
        phase = (i // 2) & 1
        mbarrier.wait(kv_ready.index(slot), phase)
        mbarrier.wait(p_free.index(slot), phase ^ 1)
        mbarrier.arrive(p_ready.index(slot), count=1)


@gluon.jit
def _values_standin(p_ready, p_free, kv_empty, lo, hi, BN: gl.constexpr):
    """Frees each slot as soon as its probabilities are ready (no values)."""
    for i in range(gl.cdiv(hi - lo, BN)):
        slot = i % 2
        mbarrier.wait(p_ready.index(slot), (i // 2) & 1)
        mbarrier.arrive(p_free.index(slot), count=1)
        mbarrier.arrive(kv_empty.index(slot), count=1)


@gluon.jit
def _copies_only(codes_desc, scales_desc, rope_desc, TABLES, table_row, lo, hi, slots, raw_codes, raw_scales, raw_rope,
                 raw_bar, kv_ready, kv_empty, SPLIT: gl.constexpr, BLOCK_SIZE: gl.constexpr, BN: gl.constexpr,
                 R: gl.constexpr, L: gl.constexpr, WARPS: gl.constexpr):
    """The dequant warps' box rows and TMA copies, one tile in flight, no conversion."""
    _dense_box_slots(TABLES, table_row, lo, hi, slots, SPLIT, BLOCK_SIZE, BN, R, WARPS)
    n_tiles = gl.cdiv(hi - lo, BN)
    if n_tiles > 0:
        _dense_load_tile(codes_desc, scales_desc, rope_desc, slots, 0, raw_codes, raw_scales, raw_rope, raw_bar, BN, R,
                         L, WARPS)
    for i in range(n_tiles):
        mbarrier.wait(raw_bar, i & 1)
        if i + 1 < n_tiles:
            _dense_load_tile(codes_desc, scales_desc, rope_desc, slots, i + 1, raw_codes, raw_scales, raw_rope,
                             raw_bar, BN, R, L, WARPS)
        slot = i % 2
        mbarrier.wait(kv_empty.index(slot), ((i // 2) & 1) ^ 1)
        mbarrier.arrive(kv_ready.index(slot), count=1)


@gluon.jit
def dense_probe_kernel(
    Q_LAT, Q_PE, codes_desc, scales_desc, rope_desc, TABLES, POSITIONS, TOKEN_TO_REQ, IS_PADDING, OUT, PART_O, PART_ML,
    qk_scale, num_splits, num_heads,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_table, stride_ot, stride_oh,
    BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr, GROUP: gl.constexpr, PROBE: gl.constexpr, R: gl.constexpr,
    H: gl.constexpr = DENSE_HEADS, BN: gl.constexpr = DENSE_BN, L: gl.constexpr = LATENT,
    VALUES_REGS: gl.constexpr = DENSE_VALUES_REGS, DEQUANT_REGS: gl.constexpr = DENSE_DEQUANT_REGS,
    DEQUANT_WARPS: gl.constexpr = DENSE_DEQUANT_WARPS,
):
    """``dense_mla_kernel``'s program with the warp groups of ``PROBE`` (see the module docstring)."""
    row, head0, split, lo, hi, table_row = dense_program(POSITIONS, TOKEN_TO_REQ, IS_PADDING, stride_table, SPLIT,
                                                         GROUP)
    (q_smem, qpe_smem, kv0, kv1, kv2, kv3, pe_bufs, p_bufs, f_bufs, unit_bufs, l_buf, slots, raw_codes, raw_scales,
     raw_rope, raw_bar, kv_ready, kv_empty, p_ready, p_free, done) = dense_shared_memory(SPLIT, H, BN, R)
    if PROBE == "mma only":
        gl.warp_specialize([
            (_dense_scores_warps, (Q_LAT, Q_PE, PART_ML, row, head0, lo, hi, qk_scale, num_heads, num_splits, split,
                                   stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem, p_bufs, f_bufs, l_buf,
                                   kv0, kv1, kv2, kv3, pe_bufs, unit_bufs, kv_ready, p_ready, p_free, done, GROUP, BN, H, False)),
            (_dense_values_warps, (OUT, PART_O, row, head0, lo, hi, num_heads, num_splits, split, stride_ot, stride_oh,
                                   p_bufs, f_bufs, l_buf, kv0, kv1, kv2, kv3, unit_bufs, kv_empty, p_ready, p_free, done, GROUP,
                                   BN, L, H, False)),
            (_fill_standin, (kv_ready, kv_empty, unit_bufs, lo, hi, BN, H)),
        ], [4, 4], [VALUES_REGS, 80])
    elif PROBE == "scores only":
        gl.warp_specialize([
            (_dense_scores_warps, (Q_LAT, Q_PE, PART_ML, row, head0, lo, hi, qk_scale, num_heads, num_splits, split,
                                   stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem, p_bufs, f_bufs, l_buf,
                                   kv0, kv1, kv2, kv3, pe_bufs, unit_bufs, kv_ready, p_ready, p_free, done, GROUP, BN, H, False)),
            (_values_standin, (p_ready, p_free, kv_empty, lo, hi, BN)),
            (_fill_standin, (kv_ready, kv_empty, unit_bufs, lo, hi, BN, H)),
        ], [4, 4], [80, 80])
    elif PROBE == "values only":
        gl.warp_specialize([
            (_scores_standin, (p_ready, p_free, kv_ready, lo, hi, BN)),
            (_dense_values_warps, (OUT, PART_O, row, head0, lo, hi, num_heads, num_splits, split, stride_ot, stride_oh,
                                   p_bufs, f_bufs, l_buf, kv0, kv1, kv2, kv3, unit_bufs, kv_empty, p_ready, p_free, done, GROUP,
                                   BN, L, H, False)),
            (_fill_standin, (kv_ready, kv_empty, unit_bufs, lo, hi, BN, H)),
        ], [4, 4], [VALUES_REGS, 80])
    elif PROBE == "dequant only":
        gl.warp_specialize([
            (_drain_standin, (kv_ready, kv_empty, lo, hi, BN)),
            (_dense_dequant_warps, (codes_desc, scales_desc, rope_desc, TABLES, table_row, lo, hi, slots, kv0, kv1,
                                    kv2, kv3, pe_bufs, unit_bufs, raw_codes, raw_scales, raw_rope, raw_bar, kv_ready,
                                    kv_empty, SPLIT, BLOCK_SIZE, BN, R, L, H, DEQUANT_WARPS)),
        ], [DEQUANT_WARPS], [DEQUANT_REGS])
    else:  # "copies only"
        gl.warp_specialize([
            (_drain_standin, (kv_ready, kv_empty, lo, hi, BN)),
            (_copies_only, (codes_desc, scales_desc, rope_desc, TABLES, table_row, lo, hi, slots, raw_codes,
                            raw_scales, raw_rope, raw_bar, kv_ready, kv_empty, SPLIT, BLOCK_SIZE, BN, R, L,
                            DEQUANT_WARPS)),
        ], [DEQUANT_WARPS], [DEQUANT_REGS])


PROBES = ("mma only", "scores only", "values only", "dequant only", "copies only")


def probe(name: str, q_lat, q_pe, cache, rows, scale: float, split: int):
    """``dense_probe_kernel`` with ``PROBE=name`` over the launcher's splits."""
    from pcppass.kernels.attention import launch

    t, heads, lat = q_lat.shape
    flat = cache.view(torch.uint8).reshape(cache.shape[0], cache.shape[1], -1)
    splits = -(-rows.tables.shape[1] * cache.shape[1] // split)
    out, part_o, part_ml = launch._outputs(t, heads, lat, max(splits, 2), q_lat.dtype, q_lat.device)
    box = min(flat.shape[1], DENSE_BN)
    dense_probe_kernel[(t, 1, splits)](
        q_lat, q_pe, *dense_descriptors(flat, box), rows.tables, rows.positions, rows.token_to_req, rows.is_padding,
        out, part_o, part_ml, scale * 1.4426950408889634, splits, heads,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), rows.tables.stride(0), out.stride(0),
        out.stride(1),
        BLOCK_SIZE=flat.shape[1], SPLIT=split, GROUP=heads, PROBE=name, R=box, num_warps=4)
    return out


def measure(rows: int, context: int, split: int, reps: int) -> dict:
    from ds_mla_variants import _time

    from pcppass.bench.kernels import mla_inputs
    from pcppass.kernels.attention import launch

    q_lat, q_pe, step, caches = mla_inputs(rows, context)
    cache = caches[True]
    want = launch.mla_attention(q_lat, q_pe, cache, step, 0.07, True, tiles=launch.MLA_FP8_TRITON_TILES)
    got = launch.dense_mla_gluon(q_lat, q_pe, cache, step, 0.07, split)
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    entries = [{"probe": "kernel", "us": _time(lambda: launch.dense_mla_gluon(q_lat, q_pe, cache, step, 0.07, split),
                                               reps), "rel_err": err}]
    for name in PROBES:
        entries.append({"probe": name, "us": _time(lambda name=name: probe(name, q_lat, q_pe, cache, step, 0.07,
                                                                           split), reps)})
    return {"rows": rows, "context": context, "split": split, "floor_bytes": rows * context * 656, "probes": entries}


def markdown(result: dict) -> str:
    from pcppass.bench.kernels import DATASHEET_HBM

    env = result["environment"]
    lines = ["# Dense fp8_ds_mla Gluon kernel: its warp groups alone", "",
             f"{env.get('date', '')} · {env.get('device', '')} · torch {env.get('torch', '')} · "
             f"triton {env.get('triton', '')} · CUDA-graph replays, median", "",
             "| rows | context | keys per split | probe | µs | % of HBM (byte floor) |", "|---|---|---|---|---|---|"]
    for shape in result["shapes"]:
        floor = shape["floor_bytes"] / DATASHEET_HBM * 1e6
        for e in shape["probes"]:
            lines.append(f"| {shape['rows']} | {shape['context']} | {shape['split']} | {e['probe']} | {e['us']:.1f} | "
                         f"{100 * floor / e['us']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32")
    parser.add_argument("--context", default="32768")
    parser.add_argument("--splits", default="1024,4096")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="h200")
    args = parser.parse_args()
    from pcppass.bench.environment import environment
    from pcppass.bench.results import write

    result = {"environment": environment(), "config": vars(args), "shapes": []}
    for rows, context, split in itertools.product(*(map(int, v.split(",")) for v in (args.rows, args.context,
                                                                                      args.splits))):
        result["shapes"].append(measure(rows, context, split, args.reps))
    print(markdown(result))
    print(write(args.out, f"dense_mla_probe_{args.tag}", result, markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
