"""Restructurings of dense fp8_ds_mla MLA decode, timed beside the launcher's kernel on one GPU.

    python bench/ds_mla_variants.py --rows 32,64 --context 16384,32768 --out bench/results --tag h200
    python bench/ds_mla_variants.py --sass      # no GPU: registers and the loop's instructions (sm_90)
    python bench/ds_mla_variants.py --gluon-splits 1024,2048,4096 --rows 32,64 --context 16384,32768

The launcher's kernel (:func:`pcppass.kernels.attention.triton_kernels.mla_kernel` at
``MLA_FP8_TILES``) reads DeepSeek-V2-width fp8_ds_mla rows at 27-28% of HBM bandwidth. Nsight
Compute and its SASS (``bench/kernel_sass.py``) show why: 1577 instructions per warp per 32-key
tile (each code converted twice through float32, the values' operand read from shared memory one
byte at a time, the probabilities moved between warps), 255 registers with spills, two programs
of 4 warps per SM, each scheduler issuing every other cycle at best. The two Triton kernels here
remove most of that work and are not faster; the Gluon kernels (``bench/ds_mla_gluon.py``) are
what overlapping the work takes:

* ``slices`` (:func:`ds_mla_slices_kernel`): the latent dims cut into one slice per warp, every dot
  batched over the slices (a batched dot puts its batch on the warps), so each warp converts its
  slice of the codes once (float16, two per instruction) and both dots read the converted tile from
  shared memory; the partial scores are summed across the warps and every warp runs the softmax of
  the whole tile. Known defect, found by a test with scales spanning 2^-30 to 2^20 inside one key
  tile (error 0.23): the probabilities are divided by the largest scale of their tile, so where a
  key with a small scale carries most of the weight its probability underflows float16.
* ``wgmma`` (:func:`ds_mla_wgmma_kernel`): Hopper's warp-group MMA, keys as the scores' M and
  dims as the values' M.
* ``gluon_*``: each tile dequantised once into shared memory where both MMAs read it, by one warp
  group in turn (``gluon_one_group``) or by dequant warps beside MMA warps (``gluon_ws``,
  ``gluon_ws_f16``: warp specialisation; see that module).

Each kernel is timed from CUDA-graph replays (median) on the same inputs as the launcher's; its
output is compared with the launcher's Triton kernel (max relative error), as are the package's
Gluon kernels (``gluon_kernels.dense_mla_kernel``, what the launcher runs on Hopper, and
``gluon_dense``'s two with register operands) at 1024, 2048 and 4096 keys per split. Writes
``<out>/ds_mla_variants_<tag>.json`` and ``.md``
(``--package-only``: only the Triton and package kernels, into ``ds_mla_package_<tag>.*``).
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton
import triton.language as tl

from ds_mla_gluon import ds_mla_one_group_kernel, ds_mla_ws_f16_kernel, ds_mla_ws_kernel
from pcppass.kernels.attention.triton_kernels import (
    e4m3,
    fdot,
    key_blocks,
    max_along,
    pow2_lane_scales,
    split_blocks,
    sum_along,
)


@triton.jit
def e4m3_as_f16_asm(codes):
    """e4m3 bytes as float16 (exact), two per ``cvt``. Inline assembly that is not pure: the
    compiler then converts each code once, where it is loaded from shared memory, and stages the
    float16 tile for both dots, instead of moving the conversion into each dot's operand layout
    (the values' operand reads codes one byte at a time, the keys' axis being its inner one)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        "=r,=r,r", [codes], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def ds_mla_slices_kernel(
    Q_LAT, Q_PE, CACHE, SCALES, ROPE, TABLES, POSITIONS, TOKEN_TO_REQ, IS_PADDING,
    OUT, PART_O, PART_ML, qk_scale, num_splits, num_heads,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_b, stride_s, stride_table, stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, M: tl.constexpr, BN: tl.constexpr, L: tl.constexpr,
    R: tl.constexpr, RW: tl.constexpr, SPLIT: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
    NBLK: tl.constexpr, NS: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr,
):
    """Dense MLA decode over an fp8_ds_mla cache, one row per program (program (row, head block,
    split)), the ``L`` latent dims cut into ``NS`` slices of ``W`` (and the RoPE dims into slices of
    ``RW``, masked past ``R``), one slice per warp: every dot is batched over the slices, and a
    batched dot puts its batch on the warps (``num_warps == NS``).

    Per key tile, each warp converts its slice of the codes once and stages it in shared memory,
    where both dots read it: the scores run keys x heads (``kv @ q^T``, a partial over the warp's
    dims, times each key's tile scale), the partials are summed across the warps, every warp runs
    the softmax of the whole tile itself (reductions along the keys stay inside a warp), and its
    probabilities meet its own slice for its dims of the output. :func:`mla_kernel` instead splits
    a tile's keys over the warps: its probabilities travel between warps, every max and sum is a
    reduction across warps, and the values' dot reads the codes byte by byte.

    ``F16`` (16-bit queries): the dots run on float16. The codes convert exactly, two per
    instruction (``ASM``: :func:`e4m3_as_f16_asm`; the interpreter converts the same values through
    :func:`e4m3`); each head's query is scaled by a power of two into float16's range
    (:func:`pow2_lane_scales` over the head's latent dims, undone on its scores; the RoPE dot stays
    in the query's dtype); the probabilities meet the values as float16, each key's scale divided by
    the largest of its slice's tile (so the products stay in [0, 1]) and that largest scale carried
    by the slice's accumulator (``g``) until the end. Otherwise the codes convert to the query's
    dtype and the scale multiplies the probabilities, as in :func:`mla_kernel`."""
    W: tl.constexpr = L // NS
    NT: tl.constexpr = L // 128
    row = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    if tl.load(IS_PADDING + row) == 0:
        req = tl.load(TOKEN_TO_REQ + row)
        pos = tl.load(POSITIONS + row)
        m = tl.arange(0, M)
        live = m < GROUP
        head = hb * GROUP + m
        b = tl.arange(0, NS)
        w = tl.arange(0, W)
        rope = (b * RW)[:, None, None] + tl.arange(0, RW)[None, None, :]
        q = tl.load(Q_LAT + row * stride_qt + head[None, :, None] * stride_qh + (b * W)[:, None, None]
                    + w[None, None, :], mask=live[None, :, None], other=0.0)
        q_pe = tl.load(Q_PE + row * stride_pt + head[None, :, None] * stride_ph + rope,
                       mask=live[None, :, None] & (rope < R), other=0.0)
        if F16:
            up, lane = pow2_lane_scales(max_along(max_along(tl.abs(q.to(tl.float32)), 2), 0))
            q = (q.to(tl.float32) * up[None, :, None]).to(tl.float16)
        q_t = tl.trans(q, 0, 2, 1)
        q_pe_t = tl.trans(q_pe, 0, 2, 1)
        lo = split * SPLIT
        hi = tl.minimum(lo + SPLIT, pos + 1).to(tl.int32)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.full([M], 0.0, tl.float32)
        acc = tl.full([NS, M, W], 0.0, tl.float32)
        g = tl.full([NS], 1.0, tl.float32)
        table = TABLES + req * stride_table
        blocks = split_blocks(table, lo, hi, BLOCK_SIZE, NBLK)
        tile_of = (b * W) // 128  # each slice's quantisation tile
        for start in range(lo, hi, BN):
            j = start + tl.arange(0, BN)
            jm = j < hi
            block = key_blocks(table, blocks, j, jm, lo, BLOCK_SIZE, NBLK)
            base = block * stride_b + (j % BLOCK_SIZE).to(tl.int64) * stride_s
            codes = tl.load(CACHE + base[None, :, None] + (b * W)[:, None, None] + w[None, None, :],
                            mask=jm[None, :, None], other=0)
            if F16 and ASM:
                kv = e4m3_as_f16_asm(codes)
            else:
                kv = e4m3(codes, q.dtype)
            scale = tl.load(SCALES + (base // 4 + L // 4)[None, :] + tile_of[:, None], mask=jm[None, :], other=0.0)
            pe = tl.load(ROPE + (base // 2)[None, :, None] + (L + 4 * NT) // 2 + rope,
                         mask=jm[None, :, None] & (rope < R), other=0.0).to(q_pe.dtype)
            if F16:
                s3 = fdot(kv, q_t, IEEE) * (scale[:, :, None] * lane[None, None, :]) + fdot(pe, q_pe_t, IEEE)
            else:
                s3 = fdot(kv, q_t, IEEE) * scale[:, :, None] + fdot(pe, q_pe_t, IEEE)
            s = sum_along(s3, 0) * qk_scale  # [BN, M]: keys x heads
            s = tl.where(((j <= pos) & jm)[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, max_along(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[None, :])
            l_i = l_i * alpha + sum_along(p, 0)
            m_i = m_new
            if F16:
                largest = max_along(scale, 1)
                largest = tl.where(largest > 0.0, largest, 1.0)
                p3 = tl.trans((p[None, :, :] * (scale / largest[:, None])[:, :, None]).to(tl.float16), 0, 2, 1)
                acc = tl.dot(p3, kv, acc * (alpha[None, :] * (g / largest)[:, None])[:, :, None])
                g = largest
            else:
                p3 = tl.trans((p[None, :, :] * scale[:, :, None]).to(kv.dtype), 0, 2, 1)
                acc = acc * alpha[None, :, None] + fdot(p3, kv, IEEE)
        acc = acc * g[:, None, None]
        col = (b * W)[:, None, None] + w[None, None, :]
        mask3 = live[None, :, None]
        if DIRECT:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[None, :, None]
            tl.store(OUT + row * stride_ot + head[None, :, None] * stride_oh + col, out.to(OUT.dtype.element_ty),
                     mask=mask3)
        else:
            part = (row * num_heads + head) * num_splits + split
            tl.store(PART_O + part[None, :, None] * L + col, acc, mask=mask3)
            tl.store(PART_ML + part * 2, m_i, mask=live)
            tl.store(PART_ML + part * 2 + 1, l_i, mask=live)


@triton.jit
def ds_mla_wgmma_kernel(
    Q_LAT, Q_PE, CACHE, SCALES, ROPE, TABLES, POSITIONS, TOKEN_TO_REQ, IS_PADDING,
    OUT, PART_O, PART_ML, qk_scale, num_splits, num_heads,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_b, stride_s, stride_table, stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, M: tl.constexpr, BN: tl.constexpr, L: tl.constexpr,
    SPLIT: tl.constexpr, NBLK: tl.constexpr,
):
    """Dense fp8_ds_mla MLA decode on Hopper's asynchronous warp-group MMA (one row per program,
    one warp group): the scores run keys x heads (``kv_c @ q_c^T`` per 128-dim tile, 64 keys
    the MMA's M), the values dims x heads (``kv_c^T @ p^T``, the 128 dims its M), each tile's
    codes converted to float16 where they are loaded (:func:`e4m3_as_f16_asm`) and, for the
    values, loaded and converted a second time after the softmax (holding the four converted tiles
    across it spilled 312 bytes per thread). Probabilities times scales meet the codes as float16
    with no range guard (an experiment: scales far from the test data's would overflow)."""
    TL: tl.constexpr = 128
    NT: tl.constexpr = L // 128
    row = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    if tl.load(IS_PADDING + row) == 0:
        req = tl.load(TOKEN_TO_REQ + row)
        pos = tl.load(POSITIONS + row)
        m = tl.arange(0, M)
        live = m < GROUP
        head = hb * GROUP + m
        t = tl.arange(0, TL)
        r = tl.arange(0, 64)
        q_at = Q_LAT + row * stride_qt + head[None, :] * stride_qh + t[:, None]
        qt0 = tl.load(q_at, mask=live[None, :], other=0.0).to(tl.float16)
        qt1 = tl.load(q_at + TL, mask=live[None, :], other=0.0).to(tl.float16)
        qt2 = tl.load(q_at + 2 * TL, mask=live[None, :], other=0.0).to(tl.float16)
        qt3 = tl.load(q_at + 3 * TL, mask=live[None, :], other=0.0).to(tl.float16)
        qpe_t = tl.load(Q_PE + row * stride_pt + head[None, :] * stride_ph + r[:, None], mask=live[None, :], other=0.0)
        lo = split * SPLIT
        hi = tl.minimum(lo + SPLIT, pos + 1).to(tl.int32)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.full([M], 0.0, tl.float32)
        acc0 = tl.full([TL, M], 0.0, tl.float32)
        acc1 = tl.full([TL, M], 0.0, tl.float32)
        acc2 = tl.full([TL, M], 0.0, tl.float32)
        acc3 = tl.full([TL, M], 0.0, tl.float32)
        table = TABLES + req * stride_table
        blocks = split_blocks(table, lo, hi, BLOCK_SIZE, NBLK)
        for start in range(lo, hi, BN):
            j = start + tl.arange(0, BN)
            jm = j < hi
            block = key_blocks(table, blocks, j, jm, lo, BLOCK_SIZE, NBLK)
            base = block * stride_b + (j % BLOCK_SIZE).to(tl.int64) * stride_s
            kv0 = e4m3_as_f16_asm(tl.load(CACHE + base[:, None] + t[None, :], mask=jm[:, None], other=0))
            kv1 = e4m3_as_f16_asm(tl.load(CACHE + base[:, None] + TL + t[None, :], mask=jm[:, None], other=0))
            kv2 = e4m3_as_f16_asm(tl.load(CACHE + base[:, None] + 2 * TL + t[None, :], mask=jm[:, None], other=0))
            kv3 = e4m3_as_f16_asm(tl.load(CACHE + base[:, None] + 3 * TL + t[None, :], mask=jm[:, None], other=0))
            sc = SCALES + base // 4 + L // 4
            sc0 = tl.load(sc, mask=jm, other=0.0)
            sc1 = tl.load(sc + 1, mask=jm, other=0.0)
            sc2 = tl.load(sc + 2, mask=jm, other=0.0)
            sc3 = tl.load(sc + 3, mask=jm, other=0.0)
            pe = tl.load(ROPE + (base // 2)[:, None] + (L + 4 * NT) // 2 + r[None, :], mask=jm[:, None], other=0.0)
            s = tl.dot(kv0, qt0) * sc0[:, None]
            s += tl.dot(kv1, qt1) * sc1[:, None]
            s += tl.dot(kv2, qt2) * sc2[:, None]
            s += tl.dot(kv3, qt3) * sc3[:, None]
            s = (s + tl.dot(pe, qpe_t)) * qk_scale
            s = tl.where(((j <= pos) & jm)[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, max_along(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[None, :])
            l_i = l_i * alpha + sum_along(p, 0)
            m_i = m_new
            kv0 = e4m3_as_f16_asm(tl.load(CACHE + base[:, None] + t[None, :], mask=jm[:, None], other=0))
            acc0 = tl.dot(tl.trans(kv0), (p * sc0[:, None]).to(tl.float16), acc0 * alpha[None, :])
            kv1 = e4m3_as_f16_asm(tl.load(CACHE + base[:, None] + TL + t[None, :], mask=jm[:, None], other=0))
            acc1 = tl.dot(tl.trans(kv1), (p * sc1[:, None]).to(tl.float16), acc1 * alpha[None, :])
            kv2 = e4m3_as_f16_asm(tl.load(CACHE + base[:, None] + 2 * TL + t[None, :], mask=jm[:, None], other=0))
            acc2 = tl.dot(tl.trans(kv2), (p * sc2[:, None]).to(tl.float16), acc2 * alpha[None, :])
            kv3 = e4m3_as_f16_asm(tl.load(CACHE + base[:, None] + 3 * TL + t[None, :], mask=jm[:, None], other=0))
            acc3 = tl.dot(tl.trans(kv3), (p * sc3[:, None]).to(tl.float16), acc3 * alpha[None, :])
        part = (row * num_heads + head) * num_splits + split
        tl.store(PART_O + part[None, :] * L + t[:, None], acc0, mask=live[None, :])
        tl.store(PART_O + part[None, :] * L + TL + t[:, None], acc1, mask=live[None, :])
        tl.store(PART_O + part[None, :] * L + 2 * TL + t[:, None], acc2, mask=live[None, :])
        tl.store(PART_O + part[None, :] * L + 3 * TL + t[:, None], acc3, mask=live[None, :])
        tl.store(PART_ML + part * 2, m_i, mask=live)
        tl.store(PART_ML + part * 2 + 1, l_i, mask=live)


def _outputs(rows, heads: int, lat: int, splits: int, like: torch.Tensor):
    """(out, partial outputs, partial max/sum) on ``like``'s device: both kernels always write
    partials, where :func:`launch._outputs` gives a single split no partial buffers."""
    return (torch.empty(rows, heads, lat, dtype=like.dtype, device=like.device),
            torch.empty(rows * heads * splits * lat, dtype=torch.float32, device=like.device),
            torch.empty(rows * heads * splits * 2, dtype=torch.float32, device=like.device))


#: the kernels the launch functions below call (looked up at each call, so --sass can record them)
KERNELS = {"slices": ds_mla_slices_kernel, "wgmma": ds_mla_wgmma_kernel, "gluon_one_group": ds_mla_one_group_kernel,
           "gluon_ws": ds_mla_ws_kernel, "gluon_ws_f16": ds_mla_ws_f16_kernel}


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8).reshape(cache.shape[0], cache.shape[1], -1)


def _launch(kernel: str, q_lat, q_pe, cache, rows, scale: float, stages: int, warps: int, **shape) -> torch.Tensor:
    """``KERNELS[kernel]`` over the launcher's splits (one program per row and split, all heads),
    merged by the launcher's combine kernel."""
    from pcppass.kernels.attention import launch

    t, heads, lat = q_lat.shape
    flat, bs = _flat(cache), cache.shape[1]
    splits, split = -(-rows.tables.shape[1] * bs // launch.MLA_SPLIT), launch.MLA_SPLIT
    out, part_o, part_ml = _outputs(t, heads, lat, splits, q_lat)
    KERNELS[kernel][(t, 1, splits)](
        q_lat, q_pe, flat, flat.view(torch.float32), flat.view(torch.bfloat16), rows.tables, rows.positions,
        rows.token_to_req, rows.is_padding, out, part_o, part_ml, scale * 1.4426950408889634, splits, heads,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), flat.stride(0), flat.stride(1),
        rows.tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=bs, GROUP=heads, M=heads, L=lat, SPLIT=split, NBLK=launch._split_blocks(True, split, bs), **shape,
        num_warps=warps, num_stages=stages)
    launch._combine(out, part_o, part_ml, rows.is_padding, splits)
    return out


def slices_attention(q_lat, q_pe, cache, rows, scale: float, bn: int, stages: int, slices: int) -> torch.Tensor:
    """:func:`ds_mla_slices_kernel` (bf16 queries: float16 dots), one warp per slice."""
    rope = q_pe.shape[2]
    return _launch("slices", q_lat, q_pe, cache, rows, scale, stages, slices, BN=bn, R=rope,
                   RW=max(16, rope // slices), DIRECT=False, IEEE=False, NS=slices, F16=True, ASM=True)


def wgmma_attention(q_lat, q_pe, cache, rows, scale: float, bn: int, stages: int, warps: int) -> torch.Tensor:
    """:func:`ds_mla_wgmma_kernel`."""
    return _launch("wgmma", q_lat, q_pe, cache, rows, scale, stages, warps, BN=bn)


def gluon_attention(kernel: str, q_lat, q_pe, cache, rows, scale: float, **options) -> torch.Tensor:
    """A ``bench/ds_mla_gluon.py`` kernel: 64-key tiles, 4 warps (plus 4 dequant warps when
    warp-specialised)."""
    return _launch(kernel, q_lat, q_pe, cache, rows, scale, 1, 4, BN=64, **options)


#: (name, launch(q_lat, q_pe, cache, rows, scale)) of every variant timed; shapes as swept by hand
#: (slices: 64-key tiles or 8 slices measured slower in attention_tiles sweeps; wgmma: 3 stages
#: do not fit shared memory)
VARIANTS = [
    (f"slices, {bn} keys, {stages} stages, {slices} slices",
     lambda *a, bn=bn, stages=stages, slices=slices: slices_attention(*a, bn, stages, slices))
    for bn, stages, slices in ((32, 2, 4), (32, 3, 4), (64, 2, 4), (32, 2, 8))
] + [
    (f"wgmma, 64 keys, 2 stages, {warps} warps", lambda *a, warps=warps: wgmma_attention(*a, 64, 2, warps))
    for warps in (4, 8)
] + [
    ("gluon, one warp group, 64 keys", lambda *a: gluon_attention("gluon_one_group", *a)),
    ("gluon warp-specialised: 4 dequant + 4 MMA warps, bf16 tiles", lambda *a: gluon_attention(
        "gluon_ws", *a, DEQUANT_REGS=192)),
    ("gluon warp-specialised, float16 codes, scales on scores and probabilities", lambda *a: gluon_attention(
        "gluon_ws_f16", *a, DEQUANT_REGS=168)),
]


def _time(call, reps: int) -> float:
    from pcppass.bench.timing import graph_median_us

    return graph_median_us(call, reps)


#: keys per split the package's Gluon kernel is timed at (``launch.DENSE_GLUON_SPLIT`` is the launcher's)
PACKAGE_SPLITS = (1024, 2048, 4096)


def package_variants() -> list:
    """(name, launch) of the package's Gluon kernels at each of :data:`PACKAGE_SPLITS`:
    ``gluon_kernels.dense_mla_kernel`` (what the launcher runs on Hopper) and ``gluon_dense``'s
    ``dense_mla_regs_kernel`` and ``dense_mla_regs_ws_kernel`` (the MMAs' A operands in registers)."""
    from pcppass.kernels.attention import launch

    kernels = [("dense_mla_kernel", launch.dense_mla_gluon),
               ("A operands in registers, dense_mla_regs_kernel", launch.dense_mla_regs),
               ("A operands in registers, three warp groups, dense_mla_regs_ws_kernel", launch.dense_mla_regs_ws),
               ("scores as fp8 MMAs on the raw codes, dense_mla_fp8_kernel", launch.dense_mla_fp8),
               ("scores as fp8 MMAs, three raw slots, dense_mla_fp8_kernel",
                functools.partial(launch.dense_mla_fp8, STAGES=3))]
    return [(f"package Gluon kernel ({name}), {split} keys per split",
             lambda q_lat, q_pe, cache, rows, scale, run=run, split=split: run(q_lat, q_pe, cache, rows, scale, split))
            for name, run in kernels for split in PACKAGE_SPLITS]


def measure(rows: int, context: int, reps: int, package_only: bool = False) -> dict:
    from pcppass.bench.kernels import mla_inputs
    from pcppass.kernels.attention.launch import MLA_FP8_TRITON_TILES, mla_attention

    q_lat, q_pe, step, caches = mla_inputs(rows, context)
    cache = caches[True]
    want = mla_attention(q_lat, q_pe, cache, step, 0.07, True, tiles=MLA_FP8_TRITON_TILES)
    entries = [{"kernel": "mla_kernel (the launcher's Triton kernel)", "us": _time(lambda: mla_attention(
        q_lat, q_pe, cache, step, 0.07, True, tiles=MLA_FP8_TRITON_TILES), reps), "rel_err": 0.0}]
    for name, run in package_variants() + ([] if package_only else VARIANTS):
        try:
            got = run(q_lat, q_pe, cache, step, 0.07)
            err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
            entries.append({"kernel": name, "us": _time(lambda: run(q_lat, q_pe, cache, step, 0.07), reps),
                            "rel_err": err})
        except Exception as exc:  # a shape the compiler rejects is reported
            entries.append({"kernel": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    return {"rows": rows, "context": context, "floor_bytes": rows * context * 656, "kernels": entries}


def split_sweep(rows: int, context: int, splits: list[int], registers: list[int], reps: int) -> list[dict]:
    """``gluon_ws`` at each keys-per-split (the launcher's ``MLA_SPLIT``) and dequant-warp register
    count, against the launcher's output."""
    from pcppass.bench.kernels import mla_inputs
    from pcppass.kernels.attention import launch

    q_lat, q_pe, step, caches = mla_inputs(rows, context)
    cache = caches[True]
    want = launch.mla_attention(q_lat, q_pe, cache, step, 0.07, True)
    default, out = launch.MLA_SPLIT, []
    for split, regs in itertools.product(splits, registers):
        def run(regs=regs):
            return gluon_attention("gluon_ws", q_lat, q_pe, cache, step, 0.07, DEQUANT_REGS=regs)
        launch.MLA_SPLIT = split
        try:
            err = float((run().float() - want.float()).abs().max() / want.float().abs().max())
            out.append({"rows": rows, "context": context, "split": split, "registers": regs, "us": _time(run, reps),
                        "rel_err": err, "floor_bytes": rows * context * 656})
        finally:
            launch.MLA_SPLIT = default
    return out


def split_markdown(result: dict) -> str:
    from pcppass.bench.kernels import DATASHEET_HBM

    env = result["environment"]
    lines = ["# Warp-specialised Gluon fp8_ds_mla dense MLA: keys per split and dequant registers", "",
             f"{env.get('date', '')} · {env.get('device', '')} · torch {env.get('torch', '')} · "
             f"triton {env.get('triton', '')} · CUDA-graph replays, median · `ds_mla_ws_kernel`, 64-key tiles; "
             "error against the launcher's output", "",
             "| rows | context | keys per split | dequant registers | µs | % of HBM | rel. error |",
             "|---|---|---|---|---|---|---|"]
    for e in result["sweep"]:
        floor = e["floor_bytes"] / DATASHEET_HBM * 1e6
        lines.append(f"| {e['rows']} | {e['context']} | {e['split']} | {e['registers']} | {e['us']:.1f} | "
                     f"{100 * floor / e['us']:.0f} | {e['rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def sass_rows() -> list[dict]:
    """Each kernel compiled for sm_90 from CPU tensors (``bench/kernel_sass.py``)."""
    import kernel_sass

    out = [{"kernel": "mla_kernel (the launcher's Triton kernel)", **_stats(kernel_sass.mla_case(True))}]
    inputs = kernel_sass.mla_inputs(True)
    for name, run in VARIANTS:
        out.append({"kernel": name, **_stats(_intercepted(lambda run=run: run(*inputs, 0.07)))})
    return out


def _intercepted(run):
    """The first launch of :data:`KERNELS` made by ``run()`` on CPU tensors (nothing runs)."""
    import kernel_sass

    from pcppass.kernels.attention import launch

    found: list = []
    saved, combine = dict(KERNELS), launch._combine
    KERNELS.update({name: kernel_sass.Recorder(fn, found) for name, fn in saved.items()})
    launch._combine = lambda *args: None
    try:
        run()
    finally:
        KERNELS.update(saved)
        launch._combine = combine
    return found[0]


def _stats(call) -> dict:
    import kernel_sass

    stats = kernel_sass.sass_stats(kernel_sass.compile_launch(call))
    return {"registers": stats.registers, "stack_bytes": stats.stack_bytes, "shared_bytes": stats.shared_bytes,
            "loop_instructions": stats.loop_instructions, "loop_opcodes": dict(stats.loop_opcodes.most_common(10))}


def markdown(result: dict) -> str:
    from pcppass.bench.kernels import DATASHEET_HBM

    env = result["environment"]
    lines = ["# Dense fp8_ds_mla MLA decode: the launcher's kernel and its restructurings", "",
             f"{env.get('date', '')} · {env.get('device', '')} · torch {env.get('torch', '')} · "
             f"triton {env.get('triton', '')} · CUDA-graph replays, median", ""]
    for shape in result["shapes"]:
        floor = shape["floor_bytes"] / DATASHEET_HBM * 1e6
        lines += [f"## {shape['rows']} rows, context {shape['context']} (byte floor {floor:.1f} µs)", "",
                  "| kernel | µs | % of HBM | rel. error vs the Triton kernel |", "|---|---|---|---|"]
        for e in shape["kernels"]:
            if "us" in e:
                lines.append(f"| {e['kernel']} | {e['us']:.1f} | {100 * floor / e['us']:.0f} | {e['rel_err']:.1e} |")
            else:
                lines.append(f"| {e['kernel']} | {e['error']} | | |")
        lines.append("")
    if result.get("sass"):
        lines += ["## Compiled for sm_90 (per warp, per key tile of the loop)", "",
                  "| kernel | registers | stack B | shared B | loop instructions | top opcodes |",
                  "|---|---|---|---|---|---|"]
        for e in result["sass"]:
            mix = ", ".join(f"{k} {v}" for k, v in e["loop_opcodes"].items())
            lines.append(f"| {e['kernel']} | {e['registers']} | {e['stack_bytes']} | {e['shared_bytes']} | "
                         f"{e['loop_instructions']} | {mix} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,64")
    parser.add_argument("--context", default="16384,32768")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--sass", action="store_true", help="only compile for sm_90 and print (no GPU needed)")
    parser.add_argument("--package-only", action="store_true",
                        help="time the launcher's Triton kernel and the package's Gluon kernel only")
    parser.add_argument("--gluon-splits", default="", help="only sweep gluon_ws over these keys per split")
    parser.add_argument("--gluon-registers", default="192,232", help="dequant-warp registers for --gluon-splits")
    args = parser.parse_args()
    from pcppass.bench.environment import environment
    from pcppass.bench.results import write

    shapes = list(itertools.product(map(int, args.rows.split(",")), map(int, args.context.split(","))))
    if args.gluon_splits:
        splits, registers = (list(map(int, v.split(","))) for v in (args.gluon_splits, args.gluon_registers))
        sweep = [e for rows, context in shapes for e in split_sweep(rows, context, splits, registers, args.reps)]
        result = {"environment": environment(), "config": vars(args), "sweep": sweep}
        print(write(args.out, f"ds_mla_gluon_splits_{args.tag}", result, split_markdown))
        return 0

    sass = [] if args.package_only else sass_rows()
    if args.sass:
        for e in sass:
            print(f"{e['kernel']}: {e['registers']} registers, {e['stack_bytes']} B stack, loop "
                  f"{e['loop_instructions']} instructions {e['loop_opcodes']}")
        return 0
    result = {"environment": environment(), "config": vars(args), "sass": sass, "shapes": []}
    for rows, context in shapes:
        result["shapes"].append(measure(rows, context, args.reps, args.package_only))
        torch.cuda.empty_cache()
    name = "ds_mla_package" if args.package_only else "ds_mla_variants"
    print(write(args.out, f"{name}_{args.tag}", result, markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
