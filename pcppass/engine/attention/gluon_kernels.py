"""Gluon kernels of :mod:`pcppass.engine.attention` (Hopper only: warp-group MMA, mbarriers,
``cp.async``, warp specialisation), launched by :mod:`pcppass.engine.attention.launch` on sm_90.
Both read DeepSeek's fp8_ds_mla rows (512 e4m3 latent codes, a float32 scale per 128 of them, 64
bf16 RoPE values: 656 bytes) and convert them the same way.

:func:`sparse_mla_kernel` is DeepSeek-V3.2's sparse MLA decode over an fp8_ds_mla cache: each row
attends to its top-k picks (128 heads, 512 latent + 64 RoPE dims). Its work is MMA work, not
bytes (2048 picks of 656 bytes against 128 heads x 1088 dims of MMAs per pick), so what matters is
keeping the tensor cores fed: each key tile is dequantised by warps of its own, at about one
instruction per code, beside the warps that run the MMAs.

Program (row, block of 64 heads, split of the picks); 32-key tiles; three warp groups:

* **dequant warps**: the split's cache-row offsets are looked up once (pick -> block table -> byte
  offset, into shared memory); then each tile's rows are copied into a ring of three raw slots
  (``cp.async``, two tiles in flight) and converted into the free slot of a ring of two float16
  tiles: ``code x scale / F`` (one ``cvt`` and one ``mul.f16x2`` per two codes), where ``F``, the
  tile's unit, is the power of two that puts its largest scale over ``F`` in [64, 128), so every
  value is below 448 x 128 = 57344 (float16's largest is 65504); the RoPE values are copied as
  they are (bf16).
* **scores warps**: ``q_lat . kv`` (float16, the query scaled per head by a power of two into
  float16's range) plus ``q_pe . k_pe`` (bf16) into two float32 accumulators, the whole tile as the
  MMAs' N (the query leaves shared memory once per tile); the online softmax (each head's row
  inside the warp group); the probabilities (float16) and the accumulators' factor into a double
  buffer for the values warps; ``p @ kv`` for latent chunks 0 and 1. The next tile's scores are
  issued behind this tile's values.
* **values warps**: ``p @ kv`` for latent chunks 2 and 3.

The output accumulators (two 64 x 128 float32 tiles per MMA warp group) stay in units of the last
tile's ``F``, rescaled with the softmax's factor. mbarriers order the groups: ready / empty for the
float16 ring (empty counts both MMA groups), ready / free for the probabilities.

:func:`dense_mla_kernel` is dense MLA decode over an fp8_ds_mla cache with DeepSeek-V2's 16 heads per
program (DeepSeek-V3 at TP 8 has the same): every position up to the row's own, a split of keys per
program. Few heads make it a bytes kernel (656 bytes against 16 x 1088 MMA lanes per key), so the
keys are the MMAs' M (64-key tiles, the heads zero-padded to N = 16) and the work is keeping two
things apart: the copies in flight and the conversions. Program (row, block of 16 heads, split);
three partitions, about 208 KB of shared memory:

* **dequant warps** (8): the split's boxes (up to 64 consecutive keys of one block) looked up once
  into shared memory (the block table read once, so a tile's copies never wait for it); per tile
  the raw slot (codes, scales, RoPE values) read into registers, the next tile's TMA copies into it
  (the copy engine writes each row at its offset within 128 bytes, where ``cp.async`` into
  512-byte slots spent two shared-memory wavefronts per line), then the conversion into the free
  slot of a ring of two float16 tiles (one shared buffer per 128-dim chunk, so no barrier separates
  their stores), in units of the tile's largest scale as above, each warp reducing the tile's
  scales itself; keys past the row's end, copied with their box, become zeros.
* **scores warps** (4): ``kv . q_lat`` (float16, four chunks) plus ``k_pe . q_pe`` (bf16), the
  online softmax over the tile's keys (across the four warps), the float16 probabilities and the
  accumulators' factor to a double buffer; the running sum kept per key row until the end.
* **values warps** (4): ``kv^T @ p`` per chunk (128 dims as M), then the output or the split's
  partial.

Numerics: every e4m3 code is a float16 exactly; a value is its code times its scale over the tile's
unit, both rounded to float16 (about 2^-10 relative, where the Triton kernel's single bf16 rounding
is 2^-8) for every value whose scale is within 2^12 of its tile's largest (smaller scales lose
bits gradually, their values staying exact to 2^-38 of the tile's largest value); units are
clamped to 2^-40..2^40 (tile scales outside 2^-34..2^46 lose bits); probabilities are float16 (at
most 1, rounding at 2^-11); accumulation is float32. A query value below 2^-28 of its head's
largest rounds (as fp8 GQA's float16 dots).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

#: keys per tile, heads per program, latent dims and their quantisation tile, RoPE dims
SPARSE_BN = 32
SPARSE_HEADS = 64
LATENT = 512
ROPE = 64
#: registers of each values thread and each dequant thread (the scores warps take the rest)
VALUES_REGS = 160
DEQUANT_REGS = 120


@gluon.jit
def _two_to(e):
    """``2^e`` (float32, exact) for an integer exponent ``e`` in [-126, 127]."""
    return ((e + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _exponent(x):
    """The unbiased exponent of positive normal float32 values ``x``."""
    return ((x.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127


@gluon.jit
def pow2_scales(amax):
    """Per head, ``(2^k, 2^-k)`` putting ``amax`` in [2^14, 2^15) (``k`` clamped to [-126, 126], as
    :func:`pcppass.engine.attention.triton_kernels.pow2_lane_scales`; a Gluon kernel cannot call a
    Triton ``@jit`` function)."""
    k = gl.minimum(gl.maximum(14 - _exponent(amax), -126), 126)
    return _two_to(k), _two_to(-k)


@gluon.jit
def _tile_unit(largest_scale):
    """``(F, 1/F)`` of a key tile: the power of two with ``largest_scale / F`` in [64, 128), so
    its values (at most 448 x scale / F) stay below 57344, under float16's largest (65504); 1 for a
    tile of zero scales (all picks unused). The exponent is clamped to [-40, 40], so the ratio of
    two tiles' units, which rescales the accumulators, stays far inside float32's range."""
    e = gl.where(largest_scale > 0.0, gl.minimum(gl.maximum(_exponent(largest_scale) - 6, -40), 40), 0)
    return _two_to(e), _two_to(-e)


@gluon.jit
def e4m3_words_scaled_f16(words, scale):
    """32-bit words of four e4m3 codes times ``scale`` (float16x2 bits, broadcast to ``words``) ->
    four float16 tensors, bytes 0..3 of each word (one ``cvt`` and one ``mul.f16x2`` per two codes)."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        .reg .b32 a, b;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 a, lo;
        cvt.rn.f16x2.e4m3x2 b, hi;
        mul.rn.f16x2 a, a, $5;
        mul.rn.f16x2 b, b, $5;
        mov.b32 {$0, $1}, a;
        mov.b32 {$2, $3}, b;
        }""",
        "=h,=h,=h,=h,r,r", [words, scale], dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True,
        pack=1)


@gluon.jit
def _scaled_codes(words, scale):
    """32-bit words of four e4m3 codes ``[BN, W]`` times ``scale`` (float16x2 bits, per key) ->
    float16 ``[BN, 4W]``: two ``cvt`` and two ``mul.f16x2`` per word."""
    c0, c1, c2, c3 = e4m3_words_scaled_f16(words, scale)
    v = gl.permute(gl.join(gl.join(c0, c1), gl.join(c2, c3)), (0, 1, 3, 2))
    return gl.reshape(v, [v.shape[0], v.shape[1] * 4])


@gluon.jit
def _half2_bits(x):
    """float32 ``x`` as float16, its 16 bits twice in one 32-bit word (an ``f16x2`` operand)."""
    bits = x.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return bits | (bits << 16)


@gluon.constexpr_function
def codes_layout(warps):
    """The dequant warps' layout of a key tile's codes ``[keys, 32 words]`` (one 128-dim chunk):
    8 codes per thread, so a quarter-warp's float16 stores (16 bytes each) fill the eight 16-byte
    bank groups of a 128-byte swizzled row (with 16 codes per thread they were two-way conflicts)
    and a half-warp reads 128 bytes of one row."""
    return gl.BlockedLayout([1, 2], [2, 16], [warps, 1], [1, 0])


@gluon.jit
def _row_offsets(INDEX, TABLES, CODES, table_row, row, lo, hi, stride_it, stride_b, stride_s, bases,
                 SPLIT: gl.constexpr, BLOCK_SIZE: gl.constexpr, BN: gl.constexpr, L: gl.constexpr):
    """The split's picks as cache byte offsets into ``bases [SPLIT // BN, BN]`` (-1: an unused pick);
    returns each tile's largest scale, every thread holding all of them (:func:`_tile_largest`)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    T: gl.constexpr = SPLIT // BN
    n = (gl.arange(0, T, layout=gl.SliceLayout(1, layout))[:, None] * BN
         + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))[None, :])
    live = lo + n < hi
    pick = gl.load(INDEX + row * stride_it + lo + n, mask=live, other=-1).to(gl.int64)
    used = pick >= 0
    safe = gl.where(used, pick, 0)
    block = gl.load(TABLES + table_row + safe // BLOCK_SIZE, mask=used, other=0).to(gl.int64)
    base = block * stride_b + (safe % BLOCK_SIZE) * stride_s
    bases._reinterpret(gl.int64, [T, BN], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).store(gl.where(used, base, -1))
    scales = CODES + base // 4 + L // 4
    largest = gl.load(scales, mask=used, other=0.0)
    for c in gl.static_range(1, 4):
        largest = gl.maximum(largest, gl.load(scales + c, mask=used, other=0.0))
    return gl.convert_layout(gl.max(largest, axis=1), gl.BlockedLayout([T], [32], [4], [0]))


@gluon.jit
def _tile_largest(largest, i):
    """Element ``i`` of :func:`_row_offsets`' per-tile largest scales (inside each thread)."""
    tiles = gl.arange(0, largest.shape[0], layout=largest.type.layout)
    return gl.max(gl.where(tiles == i, largest, 0.0), axis=0)


@gluon.jit
def _tile_offsets(bases, tile, layout: gl.constexpr):
    """Tile ``tile``'s cache byte offsets (unused picks at 0) and which picks are used, in
    ``layout``; the offsets are multiples of 16 bytes (the launcher checks), so copies of 16 bytes."""
    offset = bases.index(tile).load(layout)
    used = offset >= 0
    return gl.multiple_of(gl.where(used, offset, 0), [16]), used


@gluon.jit
def _copy_rows(CODES, ROPE_VALUES, bases, raw_codes, raw_scales, raw_rope, tile, raw, L: gl.constexpr,
               BN: gl.constexpr):
    """``cp.async`` of the cache rows of tile ``bases[tile]`` into raw slot ``raw``: codes
    ``[BN, L/4]`` words, each 128-dim chunk's scales ``raw_scales[4 raw + c]``, RoPE values
    ``[BN, 64]``; unused picks are filled with zeros."""
    codes_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])  # a key's 512 bytes per warp
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    base, used = _tile_offsets(bases, tile, gl.SliceLayout(1, codes_l))
    w = gl.arange(0, L // 4, layout=gl.SliceLayout(0, codes_l))
    async_copy.async_copy_global_to_shared(raw_codes.index(raw), CODES + (base // 4)[:, None] + w[None, :],
                                           mask=used[:, None])
    # the offsets read again in the RoPE copy's layout (a layout conversion would cost two barriers),
    # which the scales share: fewer keys per thread than a key per warp
    base_r, used_r = _tile_offsets(bases, tile, gl.SliceLayout(1, rope_l))
    for c in gl.static_range(4):
        async_copy.async_copy_global_to_shared(raw_scales.index(4 * raw + c), CODES + base_r // 4 + L // 4 + c,
                                               mask=used_r)
    r = gl.arange(0, 64, layout=gl.SliceLayout(0, rope_l))
    async_copy.async_copy_global_to_shared(raw_rope.index(raw),
                                           ROPE_VALUES + (base_r // 2 + (L + 16) // 2)[:, None] + r[None, :],
                                           mask=used_r[:, None])
    async_copy.commit_group()


@gluon.jit
def _dequant_tile(raw_codes, s0, s1, s2, s3, inverse, kv_bufs, first):
    """A raw tile's four latent chunks (128 dims each), each key's codes times its chunk's scale
    over the tile's unit (``inverse`` = 1 / unit), as float16 into ``kv_bufs[first + c]``; every
    chunk's codes are read from shared memory before the first is converted."""
    codes_l: gl.constexpr = codes_layout(4)
    w0 = raw_codes.slice(0, 32, dim=1).load(codes_l)
    w1 = raw_codes.slice(32, 32, dim=1).load(codes_l)
    w2 = raw_codes.slice(64, 32, dim=1).load(codes_l)
    w3 = raw_codes.slice(96, 32, dim=1).load(codes_l)
    kv_bufs.index(first).store(_scaled_codes(w0, _half2_bits(s0 * inverse)[:, None]))
    kv_bufs.index(first + 1).store(_scaled_codes(w1, _half2_bits(s1 * inverse)[:, None]))
    kv_bufs.index(first + 2).store(_scaled_codes(w2, _half2_bits(s2 * inverse)[:, None]))
    kv_bufs.index(first + 3).store(_scaled_codes(w3, _half2_bits(s3 * inverse)[:, None]))


@gluon.jit
def _dequant_warps(INDEX, TABLES, CODES, ROPE_VALUES, table_row, row, lo, hi, stride_it, stride_b, stride_s,
                   bases, raw_codes, raw_scales, raw_rope, kv_bufs, pe_bufs, unit_bufs, kv_ready, kv_empty,
                   SPLIT: gl.constexpr, BLOCK_SIZE: gl.constexpr, BN: gl.constexpr, L: gl.constexpr,
                   M: gl.constexpr):
    """4 warps: the split's row offsets once, then per tile: copy two tiles ahead into the raw
    ring, convert this one into the free float16 slot with its RoPE values and its unit ``F``."""
    codes_l: gl.constexpr = codes_layout(4)
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    unit_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    keys_l: gl.constexpr = gl.SliceLayout(1, codes_l)
    largest = _row_offsets(INDEX, TABLES, CODES, table_row, row, lo, hi, stride_it, stride_b, stride_s, bases, SPLIT,
                           BLOCK_SIZE, BN, L)
    n_tiles = gl.cdiv(hi - lo, BN)
    for pre in gl.static_range(2):  # two tiles in flight before the first is converted
        if pre < n_tiles:
            _copy_rows(CODES, ROPE_VALUES, bases, raw_codes, raw_scales, raw_rope, pre, pre, L, BN)
        else:
            async_copy.commit_group()
    for i in range(n_tiles):
        raw = i % 3
        async_copy.wait_group(1)
        s0 = raw_scales.index(4 * raw).load(keys_l)
        s1 = raw_scales.index(4 * raw + 1).load(keys_l)
        s2 = raw_scales.index(4 * raw + 2).load(keys_l)
        s3 = raw_scales.index(4 * raw + 3).load(keys_l)
        unit, inverse = _tile_unit(_tile_largest(largest, i))
        if i + 2 < n_tiles:  # into the slot read two tiles ago
            _copy_rows(CODES, ROPE_VALUES, bases, raw_codes, raw_scales, raw_rope, i + 2, (i + 2) % 3, L, BN)
        else:
            async_copy.commit_group()
        slot = i % 2
        mbarrier.wait(kv_empty.index(slot), ((i // 2) & 1) ^ 1)
        _dequant_tile(raw_codes.index(raw), s0, s1, s2, s3, inverse, kv_bufs, slot * 4)
        pe_bufs.index(slot).store(raw_rope.index(raw).load(rope_l))
        unit_bufs.index(slot).store(gl.zeros([M], gl.float32, unit_l) + unit)
        fence_async_shared()
        mbarrier.arrive(kv_ready.index(slot), count=1)
    async_copy.wait_group(0)


@gluon.jit
def _query_to_smem(Q_LAT, Q_PE, row, head0, stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem,
                         GROUP: gl.constexpr, H: gl.constexpr, heads_l: gl.constexpr):
    """The program's ``GROUP`` heads' latent queries as float16 (four 128-dim chunks, each head scaled
    by the power of two that puts its largest value in [2^14, 2^15)) and RoPE queries (bf16), padded
    with zero heads to ``H``; returns the factors that undo the scaling, per head, in ``heads_l``."""
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    qh = gl.arange(0, H, layout=gl.SliceLayout(1, q_l))
    qd = gl.arange(0, 128, layout=gl.SliceLayout(0, q_l))
    rq = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
    live = (qh < GROUP)[:, None]
    q_at = Q_LAT + row * stride_qt + (head0 + qh)[:, None] * stride_qh + qd[None, :]
    amax = gl.max(gl.abs(gl.load(q_at, mask=live, other=0.0).to(gl.float32)), axis=1)
    for c in gl.static_range(1, 4):
        amax = gl.maximum(amax, gl.max(gl.abs(gl.load(q_at + c * 128, mask=live, other=0.0).to(gl.float32)), axis=1))
    up, down = pow2_scales(amax)
    for c in gl.static_range(4):
        q = gl.load(q_at + c * 128, mask=live, other=0.0).to(gl.float32)
        q_smem.index(c).store((q * up[:, None]).to(gl.float16))
    qpe_smem.store(gl.load(Q_PE + row * stride_pt + (head0 + qh)[:, None] * stride_ph + rq[None, :], mask=live,
                           other=0.0))
    fence_async_shared()
    return gl.convert_layout(down, heads_l)


@gluon.jit
def keys_softmax_step(s, m_i, l_rows):
    """One key tile of the online softmax over ``s [keys, heads]`` (-inf where not visible): the new
    running max per head, the factor that rescales what came before, the tile's probabilities and
    the running sums kept per key row (``l_rows``, summed at the end)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[None, :])
    return m_new, alpha, p, l_rows * alpha[None, :] + p


@gluon.jit
def dense_split_stats(l_rows, m_i, l_buf, done, PART_ML, row, head0, num_heads, num_splits, split,
                      GROUP: gl.constexpr, H: gl.constexpr, DIRECT: gl.constexpr, heads_l: gl.constexpr):
    """A dense split's running sum (its per-key-row sums added up) and max: with one split the sum
    for the values warps (``l_buf``, then ``done``), else both into the split's partial."""
    l_i = gl.sum(l_rows, axis=0)
    if DIRECT:
        l_buf.store(l_i)
        mbarrier.arrive(done, count=1)
    else:
        h = gl.arange(0, H, layout=heads_l)
        part = (row * num_heads + head0 + h) * num_splits + split
        gl.store(PART_ML + part * 2, m_i, mask=h < GROUP)
        gl.store(PART_ML + part * 2 + 1, l_i, mask=h < GROUP)


@gluon.jit
def _hand_over(p, factor, p_bufs, f_bufs, p_ready, p_free, slot, phase):
    """A tile's probabilities (float16) and the accumulators' factor into slot ``slot`` of the
    values warps' double buffer, once they are done with the tile two before."""
    mbarrier.wait(p_free.index(slot), phase ^ 1)
    p_bufs.index(slot).store(p.to(gl.float16))
    f_bufs.index(slot).store(factor)
    fence_async_shared()
    mbarrier.arrive(p_ready.index(slot), count=1)


@gluon.jit
def _store_half(o0, o1, scale, OUT, PART_O, row, head0, num_heads, num_splits, split, stride_ot, stride_oh,
                first: gl.constexpr, L: gl.constexpr, M: gl.constexpr, DIRECT: gl.constexpr, o_l: gl.constexpr):
    """Latent chunks ``first`` and ``first + 1`` (128 dims each) of the output times ``scale`` (per
    head): normalised into ``OUT`` (``DIRECT``: one split) or into this split's partial output."""
    heads = head0 + gl.arange(0, M, layout=gl.SliceLayout(1, o_l))
    dims = first * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, o_l))
    f = scale[:, None]
    if DIRECT:
        at = OUT + row * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        gl.store(at, (o0 * f).to(OUT.dtype.element_ty))
        gl.store(at + 128, (o1 * f).to(OUT.dtype.element_ty))
    else:
        at = PART_O + ((row * num_heads + heads) * num_splits + split)[:, None] * L + dims[None, :]
        gl.store(at, o0 * f)
        gl.store(at + 128, o1 * f)


@gluon.jit
def _issue_scores(q_smem, qpe_smem, kv_bufs, pe_bufs, slot, zero):
    """The five asynchronous MMAs of a tile's scores (slot ``slot`` of the ring): RoPE (bf16) and
    latent (float16, four 128-dim chunks) into two accumulators."""
    s_pe = warpgroup_mma(qpe_smem, pe_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
    s_lat = warpgroup_mma(q_smem.index(0), kv_bufs.index(slot * 4).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
    s_lat = warpgroup_mma(q_smem.index(1), kv_bufs.index(slot * 4 + 1).permute((1, 0)), s_lat, is_async=True)
    s_lat = warpgroup_mma(q_smem.index(2), kv_bufs.index(slot * 4 + 2).permute((1, 0)), s_lat, is_async=True)
    s_lat = warpgroup_mma(q_smem.index(3), kv_bufs.index(slot * 4 + 3).permute((1, 0)), s_lat, is_async=True)
    return s_pe, s_lat


@gluon.jit
def _scores_warps(Q_LAT, Q_PE, OUT, PART_O, PART_ML, row, head0, lo, hi, qk_scale, num_heads, num_splits, split,
                  stride_qt, stride_qh, stride_pt, stride_ph, stride_ot, stride_oh, bases, q_smem, qpe_smem, p_bufs,
                  f_bufs, l_buf, kv_bufs, pe_bufs, unit_bufs, kv_ready, kv_empty, p_ready, p_free, done,
                  BN: gl.constexpr, L: gl.constexpr, M: gl.constexpr, DIRECT: gl.constexpr):
    """One warp group: per tile the scores (its MMAs' N the whole tile, so the query is read from
    shared memory once per tile), the online softmax (every row inside this warp group), the
    probabilities and the accumulators' factor for :func:`_values_warps`, then the values of latent
    chunks 0 and 1; at the end the split's running max and sum, and its half of the result."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
    down = _query_to_smem(Q_LAT, Q_PE, row, head0, stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem, M, M,
                          rows_s)
    m_i = gl.full([M], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.full([M], 0.0, gl.float32, layout=rows_s)
    g = gl.full([M], 1.0, gl.float32, layout=rows_s)  # the unit the accumulators are in
    o0 = gl.zeros([M, 128], gl.float32, layout=o_l)
    o1 = gl.zeros([M, 128], gl.float32, layout=o_l)
    zero = gl.zeros([M, BN], gl.float32, layout=s_l)
    n_tiles = gl.cdiv(hi - lo, BN)
    # tile i + 1's scores are issued behind tile i's values, so they run while this warp group
    # waits for its values and while the values warps run theirs; the last tile's are issued twice
    # (the second result unused), and a row with no tile issues them over whatever the slot holds
    mbarrier.wait(kv_ready.index(0), 0, pred=n_tiles > 0)
    s_pe, s_lat = _issue_scores(q_smem, qpe_smem, kv_bufs, pe_bufs, 0, zero)
    for i in range(n_tiles):
        slot = i % 2
        phase = (i // 2) & 1
        unit = unit_bufs.index(slot).load(rows_s)
        used = bases.index(i).load(gl.SliceLayout(0, s_l)) >= 0
        s_pe, s_lat = warpgroup_mma_wait(0, deps=(s_pe, s_lat))
        s = (s_lat * (down * unit)[:, None] + s_pe) * qk_scale
        s = gl.where(used[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        factor = alpha * (g / unit)
        g = unit
        _hand_over(p, factor, p_bufs, f_bufs, p_ready, p_free, slot, phase)
        # rescaled before the first MMA is issued: a register written between asynchronous MMAs
        # makes ptxas serialise them
        f = gl.convert_layout(factor, rows_o)[:, None]
        o0 = o0 * f
        o1 = o1 * f
        o0 = warpgroup_mma(p_bufs.index(slot), kv_bufs.index(slot * 4), o0, is_async=True)
        o1 = warpgroup_mma(p_bufs.index(slot), kv_bufs.index(slot * 4 + 1), o1, is_async=True)
        nxt = gl.minimum(i + 1, n_tiles - 1)
        mbarrier.wait(kv_ready.index(nxt % 2), (nxt // 2) & 1)
        s_pe, s_lat = _issue_scores(q_smem, qpe_smem, kv_bufs, pe_bufs, nxt % 2, zero)
        o0, o1 = warpgroup_mma_wait(5, deps=(o0, o1))  # the values done, the five scores MMAs may fly
        mbarrier.arrive(kv_empty.index(slot), count=1)
    s_pe, s_lat = warpgroup_mma_wait(0, deps=(s_pe, s_lat))
    if DIRECT:
        l_buf.store(l_i)
        mbarrier.arrive(done, count=1)
        scale = g / gl.where(l_i == 0.0, 1.0, l_i)
    else:
        part = (row * num_heads + head0 + gl.arange(0, M, layout=rows_s)) * num_splits + split
        gl.store(PART_ML + part * 2, m_i)
        gl.store(PART_ML + part * 2 + 1, l_i)
        scale = g
    _store_half(o0, o1, gl.convert_layout(scale, rows_o), OUT, PART_O, row, head0, num_heads, num_splits, split,
                stride_ot, stride_oh, 0, L, M, DIRECT, o_l)


@gluon.jit
def _values_warps(OUT, PART_O, row, head0, lo, hi, num_heads, num_splits, split, stride_ot, stride_oh, p_bufs,
                  f_bufs, l_buf, kv_bufs, unit_bufs, kv_empty, p_ready, p_free, done, BN: gl.constexpr,
                  L: gl.constexpr, M: gl.constexpr, DIRECT: gl.constexpr):
    """One warp group: the values of latent chunks 2 and 3 from :func:`_scores_warps`'
    probabilities and factors, and that half of the result."""
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
    g = gl.full([M], 1.0, gl.float32, layout=rows_o)
    o2 = gl.zeros([M, 128], gl.float32, layout=o_l)
    o3 = gl.zeros([M, 128], gl.float32, layout=o_l)
    for i in range(gl.cdiv(hi - lo, BN)):
        slot = i % 2
        mbarrier.wait(p_ready.index(slot), (i // 2) & 1)
        f = f_bufs.index(slot).load(rows_o)[:, None]
        g = unit_bufs.index(slot).load(rows_o)
        o2 = o2 * f
        o3 = o3 * f
        o2 = warpgroup_mma(p_bufs.index(slot), kv_bufs.index(slot * 4 + 2), o2, is_async=True)
        o3 = warpgroup_mma(p_bufs.index(slot), kv_bufs.index(slot * 4 + 3), o3, is_async=True)
        o2, o3 = warpgroup_mma_wait(0, deps=(o2, o3))
        mbarrier.arrive(p_free.index(slot), count=1)
        mbarrier.arrive(kv_empty.index(slot), count=1)
    if DIRECT:
        mbarrier.wait(done, 0)
        l_i = l_buf.load(rows_o)
        g = g / gl.where(l_i == 0.0, 1.0, l_i)
    _store_half(o2, o3, g, OUT, PART_O, row, head0, num_heads, num_splits, split, stride_ot, stride_oh, 2, L, M,
                DIRECT, o_l)


@gluon.jit
def sparse_mla_kernel(
    Q_LAT, Q_PE, CODES, ROPE_VALUES, TABLES, TOKEN_TO_REQ, IS_PADDING, INDEX, OUT, PART_O, PART_ML, qk_scale,
    num_splits, num_heads, index_len,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_b, stride_s, stride_table, stride_it, stride_ot, stride_oh,
    BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr, DIRECT: gl.constexpr, BN: gl.constexpr = SPARSE_BN,
    M: gl.constexpr = SPARSE_HEADS, L: gl.constexpr = LATENT, VALUES_WARP_REGS: gl.constexpr = VALUES_REGS,
    DEQUANT_WARP_REGS: gl.constexpr = DEQUANT_REGS,
):
    """Sparse MLA decode over fp8_ds_mla rows, program (row, block of ``M`` heads, split of
    ``SPLIT`` picks): ``softmax(q_lat . kv + q_pe . k_pe) @ kv`` over the logical positions
    ``INDEX[row, split * SPLIT:][:SPLIT]`` (``-1``: unused). ``CODES`` / ``ROPE_VALUES``: the cache's
    bytes as float32 words / bf16 values (strides in bytes). See the module docstring."""
    row = gl.program_id(0).to(gl.int64)
    head0 = gl.program_id(1) * M
    split = gl.program_id(2)
    lo = split * SPLIT
    hi = gl.minimum(lo + SPLIT, index_len)
    hi = gl.where(gl.load(IS_PADDING + row) == 0, hi, lo)
    table_row = gl.load(TOKEN_TO_REQ + row).to(gl.int64) * stride_table
    f16_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BN, element_bitwidth=16, rank=2)
    plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    plain1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_smem = gl.allocate_shared_memory(gl.float16, [4, M, 128], f16_sl)
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [M, 64], f16_sl)
    kv_bufs = gl.allocate_shared_memory(gl.float16, [8, BN, 128], f16_sl)
    pe_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 64], f16_sl)
    p_bufs = gl.allocate_shared_memory(gl.float16, [2, M, BN], p_sl)
    f_bufs = gl.allocate_shared_memory(gl.float32, [2, M], plain1)
    l_buf = gl.allocate_shared_memory(gl.float32, [M], plain1)
    unit_bufs = gl.allocate_shared_memory(gl.float32, [2, M], plain1)
    raw_codes = gl.allocate_shared_memory(gl.int32, [3, BN, L // 4], plain2)
    raw_scales = gl.allocate_shared_memory(gl.float32, [3 * 4, BN], plain1)
    raw_rope = gl.allocate_shared_memory(gl.bfloat16, [3, BN, 64], plain2)
    bases = gl.allocate_shared_memory(gl.int64, [SPLIT // BN, BN], plain1)
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(kv_ready.index(b), count=1)
        mbarrier.init(kv_empty.index(b), count=2)  # both MMA warp groups
        mbarrier.init(p_ready.index(b), count=1)
        mbarrier.init(p_free.index(b), count=1)
    mbarrier.init(done, count=1)
    gl.warp_specialize([
        (_scores_warps, (Q_LAT, Q_PE, OUT, PART_O, PART_ML, row, head0, lo, hi, qk_scale, num_heads, num_splits,
                         split, stride_qt, stride_qh, stride_pt, stride_ph, stride_ot, stride_oh, bases, q_smem,
                         qpe_smem, p_bufs, f_bufs, l_buf, kv_bufs, pe_bufs, unit_bufs, kv_ready, kv_empty, p_ready,
                         p_free, done, BN, L, M, DIRECT)),
        (_values_warps, (OUT, PART_O, row, head0, lo, hi, num_heads, num_splits, split, stride_ot, stride_oh, p_bufs,
                         f_bufs, l_buf, kv_bufs, unit_bufs, kv_empty, p_ready, p_free, done, BN, L, M, DIRECT)),
        (_dequant_warps, (INDEX, TABLES, CODES, ROPE_VALUES, table_row, row, lo, hi, stride_it, stride_b, stride_s,
                          bases, raw_codes, raw_scales, raw_rope, kv_bufs, pe_bufs, unit_bufs, kv_ready, kv_empty,
                          SPLIT, BLOCK_SIZE, BN, L, M)),
    ], [4, 4], [VALUES_WARP_REGS, DEQUANT_WARP_REGS])


#: dense MLA: keys per tile (the scores MMA's M, the values MMA's K) and heads per program (both
#: MMAs' N, zero-padded)
DENSE_BN = 64
DENSE_HEADS = 16
#: registers of each values thread and each dequant thread of the dense kernel (the scores warps
#: take the rest)
DENSE_VALUES_REGS = 112
DENSE_DEQUANT_REGS = 152
#: warps converting the key tiles (one partition)
DENSE_DEQUANT_WARPS = 8
#: the raw slot's shared layouts, which the TMA descriptors of :func:`dense_descriptors` share:
#: the codes' 128-dim chunks in 128-byte swizzled rows (conflict-free reads), the scales as rows of
#: 16 bytes, the RoPE values as the float16 ring's
RAW_CODES_SL = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
RAW_SCALES_SL = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
RAW_ROPE_SL = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))


@gluon.jit
def _dense_box_slots(TABLES, table_row, lo, hi, slots, SPLIT: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                     BN: gl.constexpr, R: gl.constexpr, WARPS: gl.constexpr):
    """The split's boxes (``R`` consecutive keys of one block) as the cache row of their first key
    into ``slots [SPLIT // BN, BN // R]``, once, so a tile's copies never wait for its block-table
    loads; a box past ``hi`` reads row 0 (its keys are masked)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [WARPS, 1], [1, 0])
    j = lo + (gl.arange(0, SPLIT // BN, layout=gl.SliceLayout(1, layout))[:, None] * BN
              + gl.arange(0, BN // R, layout=gl.SliceLayout(0, layout))[None, :] * R)
    live = j < hi
    block = gl.load(TABLES + table_row + j // BLOCK_SIZE, mask=live, other=0)
    slots._reinterpret(gl.int32, [SPLIT // BN, BN // R], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).store(
        gl.where(live, block * BLOCK_SIZE + j % BLOCK_SIZE, 0).to(gl.int32))


@gluon.jit
def _dense_tile_slots(slots, tile, WARPS: gl.constexpr):
    """Tile ``tile``'s box rows ``[BN // R]`` and their positions."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    row = slots.index(tile).load(layout)
    return row, gl.arange(0, row.shape[0], layout=layout)


@gluon.jit
def _dense_load_tile(codes_desc, scales_desc, rope_desc, slots, tile, raw_codes, raw_scales, raw_rope, raw_bar,
                     BN: gl.constexpr, R: gl.constexpr, L: gl.constexpr, WARPS: gl.constexpr, first_chunk=0):
    """TMA copies of key tile ``tile`` into the raw slot, per box of ``R`` keys: its codes (the four
    128-dim chunks, into ``raw_codes`` from buffer ``first_chunk`` on), scales and RoPE values,
    completing ``raw_bar``. The copy engine writes a row
    into shared memory at its offset within 128 bytes in the cache, which ``cp.async`` from 656-byte
    rows into 512-byte rows could not (two wavefronts per line instead of one)."""
    mbarrier.expect(raw_bar, BN * (L + 16 + 128))
    row, box = _dense_tile_slots(slots, tile, WARPS)
    for j in gl.static_range(BN // R):
        first = gl.max(gl.where(box == j, row, 0), axis=0)
        for c in gl.static_range(4):
            tma.async_copy_global_to_shared(codes_desc, [first, 32 * c], raw_bar,
                                            raw_codes.index(first_chunk + c).slice(j * R, R))
        tma.async_copy_global_to_shared(scales_desc, [first, L // 4], raw_bar, raw_scales.slice(j * R, R))
        tma.async_copy_global_to_shared(rope_desc, [first, (L + 16) // 2], raw_bar, raw_rope.slice(j * R, R))


@gluon.jit
def _dense_tile_unit(raw_scales, first_key, hi, BN: gl.constexpr, WARPS: gl.constexpr):
    """``(F, 1/F)`` (:func:`_tile_unit`) of the raw slot's tile (keys from ``first_key``, those
    from ``hi`` on not counted), each warp reading every scale of the tile (a layout repeated across
    the warps: the reduction stays inside each warp)."""
    every_warp: gl.constexpr = gl.BlockedLayout([BN // 32, 4], [32, 1], [WARPS, 1], [1, 0])
    keys = first_key + gl.arange(0, BN, layout=gl.SliceLayout(1, every_warp))
    scales = gl.where((keys < hi)[:, None], raw_scales.load(every_warp), 0.0)
    return _tile_unit(gl.max(gl.max(scales, axis=1), axis=0))


@gluon.jit
def _scale_column(scales, c: gl.constexpr, layout: gl.constexpr):
    """Column ``c`` of a tile's scales ``[BN, 4]`` (each thread holding its keys' four) in ``layout``."""
    chunk = gl.arange(0, 4, layout=gl.SliceLayout(0, scales.type.layout))
    return gl.convert_layout(gl.sum(gl.where((chunk == c)[None, :], scales, 0.0), axis=1), layout)


@gluon.jit
def _dense_dequant_warps(codes_desc, scales_desc, rope_desc, TABLES, table_row, lo, hi, slots, kv0, kv1, kv2, kv3,
                         pe_bufs, unit_bufs, raw_codes, raw_scales, raw_rope, raw_bar, kv_ready, kv_empty,
                         SPLIT: gl.constexpr, BLOCK_SIZE: gl.constexpr, BN: gl.constexpr, R: gl.constexpr,
                         L: gl.constexpr, H: gl.constexpr, WARPS: gl.constexpr):
    """``WARPS`` warps: the split's box rows once (:func:`_dense_box_slots`), then per key tile:
    read the raw slot into registers, start the next tile's TMA copies into it, convert this tile
    to float16 in units of its largest scale (:func:`_tile_unit`, :func:`_scaled_codes`) into the
    free ring slot with its RoPE values and unit. Keys from ``hi`` on (copied all the same) become
    zeros."""
    codes_l: gl.constexpr = codes_layout(WARPS)
    scales_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [WARPS, 1], [1, 0])
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    unit_l: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    keys_l: gl.constexpr = gl.SliceLayout(1, codes_l)
    _dense_box_slots(TABLES, table_row, lo, hi, slots, SPLIT, BLOCK_SIZE, BN, R, WARPS)
    n_tiles = gl.cdiv(hi - lo, BN)
    if n_tiles > 0:
        _dense_load_tile(codes_desc, scales_desc, rope_desc, slots, 0, raw_codes, raw_scales, raw_rope, raw_bar, BN, R,
                         L, WARPS)
    for i in range(n_tiles):
        mbarrier.wait(raw_bar, i & 1)
        w0 = raw_codes.index(0).load(codes_l)
        w1 = raw_codes.index(1).load(codes_l)
        w2 = raw_codes.index(2).load(codes_l)
        w3 = raw_codes.index(3).load(codes_l)
        scales = raw_scales.load(scales_l)
        pe = raw_rope.load(rope_l)
        unit, inverse = _dense_tile_unit(raw_scales, lo + i * BN, hi, BN, WARPS)
        if i + 1 < n_tiles:
            _dense_load_tile(codes_desc, scales_desc, rope_desc, slots, i + 1, raw_codes, raw_scales, raw_rope,
                             raw_bar, BN, R, L, WARPS)
        live = lo + i * BN + gl.arange(0, BN, layout=keys_l) < hi
        s0 = gl.where(live, _scale_column(scales, 0, keys_l), 0.0) * inverse
        s1 = gl.where(live, _scale_column(scales, 1, keys_l), 0.0) * inverse
        s2 = gl.where(live, _scale_column(scales, 2, keys_l), 0.0) * inverse
        s3 = gl.where(live, _scale_column(scales, 3, keys_l), 0.0) * inverse
        slot = i % 2
        mbarrier.wait(kv_empty.index(slot), ((i // 2) & 1) ^ 1)
        kv0.index(slot).store(_scaled_codes(gl.where(live[:, None], w0, 0), _half2_bits(s0)[:, None]))
        kv1.index(slot).store(_scaled_codes(gl.where(live[:, None], w1, 0), _half2_bits(s1)[:, None]))
        kv2.index(slot).store(_scaled_codes(gl.where(live[:, None], w2, 0), _half2_bits(s2)[:, None]))
        kv3.index(slot).store(_scaled_codes(gl.where(live[:, None], w3, 0), _half2_bits(s3)[:, None]))
        pe_bufs.index(slot).store(pe)
        unit_bufs.index(slot).store(gl.zeros([H], gl.float32, unit_l) + unit)
        fence_async_shared()
        mbarrier.arrive(kv_ready.index(slot), count=1)


@gluon.jit
def _dense_scores_warps(Q_LAT, Q_PE, PART_ML, row, head0, lo, hi, qk_scale, num_heads, num_splits, split,
                        stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem, p_bufs, f_bufs, l_buf, kv0, kv1,
                        kv2, kv3, pe_bufs, unit_bufs, kv_ready, p_ready, p_free, done, GROUP: gl.constexpr, BN: gl.constexpr,
                        H: gl.constexpr, DIRECT: gl.constexpr):
    """One warp group: per tile the scores (keys as the MMAs' M, the program's heads as N), the
    online softmax over the keys (across the four warps), the probabilities (float16) and the
    accumulators' factor for :func:`_dense_values_warps`; at the end the split's running max and
    sum (the sum kept per key row until then)."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    keys_s: gl.constexpr = gl.SliceLayout(1, s_l)
    heads_s: gl.constexpr = gl.SliceLayout(0, s_l)
    down = _query_to_smem(Q_LAT, Q_PE, row, head0, stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem,
                          GROUP, H, heads_s)
    m_i = gl.full([H], float("-inf"), gl.float32, layout=heads_s)
    g = gl.full([H], 1.0, gl.float32, layout=heads_s)  # the unit the accumulators are in
    l_rows = gl.zeros([BN, H], gl.float32, layout=s_l)
    zero = gl.zeros([BN, H], gl.float32, layout=s_l)
    for i in range(gl.cdiv(hi - lo, BN)):
        slot = i % 2
        phase = (i // 2) & 1
        mbarrier.wait(kv_ready.index(slot), phase)
        s_pe = warpgroup_mma(pe_bufs.index(slot), qpe_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        s_lat = warpgroup_mma(kv0.index(slot), q_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        s_lat = warpgroup_mma(kv1.index(slot), q_smem.index(1).permute((1, 0)), s_lat, is_async=True)
        s_lat = warpgroup_mma(kv2.index(slot), q_smem.index(2).permute((1, 0)), s_lat, is_async=True)
        s_lat = warpgroup_mma(kv3.index(slot), q_smem.index(3).permute((1, 0)), s_lat, is_async=True)
        unit = unit_bufs.index(slot).load(heads_s)
        keys = lo + i * BN + gl.arange(0, BN, layout=keys_s)
        s_pe, s_lat = warpgroup_mma_wait(0, deps=(s_pe, s_lat))
        s = (s_lat * (down * unit)[None, :] + s_pe) * qk_scale
        s = gl.where((keys < hi)[:, None], s, float("-inf"))
        m_i, alpha, p, l_rows = keys_softmax_step(s, m_i, l_rows)
        factor = alpha * (g / unit)
        g = unit
        _hand_over(p, factor, p_bufs, f_bufs, p_ready, p_free, slot, phase)
    dense_split_stats(l_rows, m_i, l_buf, done, PART_ML, row, head0, num_heads, num_splits, split, GROUP, H, DIRECT,
                      heads_s)


@gluon.jit
def _dense_values_warps(OUT, PART_O, row, head0, lo, hi, num_heads, num_splits, split, stride_ot, stride_oh, p_bufs,
                        f_bufs, l_buf, kv0, kv1, kv2, kv3, unit_bufs, kv_empty, p_ready, p_free, done, GROUP: gl.constexpr,
                        BN: gl.constexpr, L: gl.constexpr, H: gl.constexpr, DIRECT: gl.constexpr):
    """One warp group: ``kv^T @ p`` per 128-dim latent chunk (dims as the MMA's M) from
    :func:`_dense_scores_warps`' probabilities and factors, then the split's output (normalised into
    ``OUT`` with one split, else its partial output)."""
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    heads_o: gl.constexpr = gl.SliceLayout(0, o_l)
    g = gl.full([H], 1.0, gl.float32, layout=heads_o)
    o0 = gl.zeros([128, H], gl.float32, layout=o_l)
    o1 = gl.zeros([128, H], gl.float32, layout=o_l)
    o2 = gl.zeros([128, H], gl.float32, layout=o_l)
    o3 = gl.zeros([128, H], gl.float32, layout=o_l)
    for i in range(gl.cdiv(hi - lo, BN)):
        slot = i % 2
        mbarrier.wait(p_ready.index(slot), (i // 2) & 1)
        f = f_bufs.index(slot).load(heads_o)[None, :]
        g = unit_bufs.index(slot).load(heads_o)
        # rescaled before the first MMA is issued: a register written between asynchronous MMAs
        # makes ptxas serialise them
        o0 = o0 * f
        o1 = o1 * f
        o2 = o2 * f
        o3 = o3 * f
        o0 = warpgroup_mma(kv0.index(slot).permute((1, 0)), p_bufs.index(slot), o0, is_async=True)
        o1 = warpgroup_mma(kv1.index(slot).permute((1, 0)), p_bufs.index(slot), o1, is_async=True)
        o2 = warpgroup_mma(kv2.index(slot).permute((1, 0)), p_bufs.index(slot), o2, is_async=True)
        o3 = warpgroup_mma(kv3.index(slot).permute((1, 0)), p_bufs.index(slot), o3, is_async=True)
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
        mbarrier.arrive(p_free.index(slot), count=1)
        mbarrier.arrive(kv_empty.index(slot), count=1)
    heads = gl.arange(0, H, layout=heads_o)
    if DIRECT:
        mbarrier.wait(done, 0)
        l_i = l_buf.load(heads_o)
        g = g / gl.where(l_i == 0.0, 1.0, l_i)
        at = OUT + row * stride_ot + (head0 + heads)[None, :] * stride_oh
    else:
        at = PART_O + ((row * num_heads + head0 + heads) * num_splits + split)[None, :] * L
    dims = gl.arange(0, 128, layout=gl.SliceLayout(1, o_l))[:, None]
    live = (heads < GROUP)[None, :]
    f = g[None, :]
    if DIRECT:
        gl.store(at + dims, (o0 * f).to(OUT.dtype.element_ty), mask=live)
        gl.store(at + 128 + dims, (o1 * f).to(OUT.dtype.element_ty), mask=live)
        gl.store(at + 256 + dims, (o2 * f).to(OUT.dtype.element_ty), mask=live)
        gl.store(at + 384 + dims, (o3 * f).to(OUT.dtype.element_ty), mask=live)
    else:
        gl.store(at + dims, o0 * f, mask=live)
        gl.store(at + 128 + dims, o1 * f, mask=live)
        gl.store(at + 256 + dims, o2 * f, mask=live)
        gl.store(at + 384 + dims, o3 * f, mask=live)


@gluon.jit
def dense_program(POSITIONS, TOKEN_TO_REQ, IS_PADDING, stride_table, SPLIT: gl.constexpr, GROUP: gl.constexpr):
    """A dense program's (row, first head, split, keys ``[lo, hi)``, block-table row offset); a
    padding row's split is empty."""
    row = gl.program_id(0).to(gl.int64)
    split = gl.program_id(2)
    lo = split * SPLIT
    hi = gl.minimum(lo + SPLIT, gl.load(POSITIONS + row) + 1).to(gl.int32)
    hi = gl.where(gl.load(IS_PADDING + row) == 0, hi, lo)
    return row, gl.program_id(1) * GROUP, split, lo, hi, gl.load(TOKEN_TO_REQ + row).to(gl.int64) * stride_table


@gluon.jit
def dense_shared_memory(SPLIT: gl.constexpr, H: gl.constexpr, BN: gl.constexpr, R: gl.constexpr):
    """Every shared buffer and mbarrier of a dense program (about 208 KB), the mbarriers initialised."""
    f16_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * H, element_bitwidth=16, rank=2)
    plain1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_smem = gl.allocate_shared_memory(gl.float16, [4, H, 128], f16_sl)
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [H, 64], f16_sl)
    # one buffer per latent chunk: stores into different buffers need no barrier between them
    kv0 = gl.allocate_shared_memory(gl.float16, [2, BN, 128], f16_sl)
    kv1 = gl.allocate_shared_memory(gl.float16, [2, BN, 128], f16_sl)
    kv2 = gl.allocate_shared_memory(gl.float16, [2, BN, 128], f16_sl)
    kv3 = gl.allocate_shared_memory(gl.float16, [2, BN, 128], f16_sl)
    pe_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 64], f16_sl)
    p_bufs = gl.allocate_shared_memory(gl.float16, [2, BN, H], p_sl)
    f_bufs = gl.allocate_shared_memory(gl.float32, [2, H], plain1)
    unit_bufs = gl.allocate_shared_memory(gl.float32, [2, H], plain1)
    l_buf = gl.allocate_shared_memory(gl.float32, [H], plain1)
    slots = gl.allocate_shared_memory(gl.int32, [SPLIT // BN, BN // R], plain1)
    raw_codes = gl.allocate_shared_memory(gl.int32, [4, BN, 32], RAW_CODES_SL)
    raw_scales = gl.allocate_shared_memory(gl.float32, [BN, 4], RAW_SCALES_SL)
    raw_rope = gl.allocate_shared_memory(gl.bfloat16, [BN, 64], RAW_ROPE_SL)
    raw_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(raw_bar, count=1)
    for b in gl.static_range(2):
        mbarrier.init(kv_ready.index(b), count=1)
        mbarrier.init(kv_empty.index(b), count=1)
        mbarrier.init(p_ready.index(b), count=1)
        mbarrier.init(p_free.index(b), count=1)
    mbarrier.init(done, count=1)
    return (q_smem, qpe_smem, kv0, kv1, kv2, kv3, pe_bufs, p_bufs, f_bufs, unit_bufs, l_buf, slots, raw_codes,
            raw_scales, raw_rope, raw_bar, kv_ready, kv_empty, p_ready, p_free, done)


@gluon.jit
def dense_mla_kernel(
    Q_LAT, Q_PE, codes_desc, scales_desc, rope_desc, TABLES, POSITIONS, TOKEN_TO_REQ, IS_PADDING, OUT, PART_O, PART_ML,
    qk_scale, num_splits, num_heads,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_table, stride_ot, stride_oh,
    BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr, GROUP: gl.constexpr, DIRECT: gl.constexpr, R: gl.constexpr,
    H: gl.constexpr = DENSE_HEADS, BN: gl.constexpr = DENSE_BN, L: gl.constexpr = LATENT,
    VALUES_WARP_REGS: gl.constexpr = DENSE_VALUES_REGS, DEQUANT_WARP_REGS: gl.constexpr = DENSE_DEQUANT_REGS,
    DEQUANT_WARPS: gl.constexpr = DENSE_DEQUANT_WARPS,
):
    """Dense MLA decode over fp8_ds_mla rows, program (row, block of ``GROUP`` heads, split of
    ``SPLIT`` keys): ``softmax(q_lat . kv + q_pe . k_pe) @ kv`` over the row's positions up to its
    own; the cache's rows through the descriptors of :func:`dense_descriptors` (boxes of ``R``
    rows). See the module docstring."""
    row, head0, split, lo, hi, table_row = dense_program(POSITIONS, TOKEN_TO_REQ, IS_PADDING, stride_table, SPLIT,
                                                         GROUP)
    (q_smem, qpe_smem, kv0, kv1, kv2, kv3, pe_bufs, p_bufs, f_bufs, unit_bufs, l_buf, slots, raw_codes, raw_scales,
     raw_rope, raw_bar, kv_ready, kv_empty, p_ready, p_free, done) = dense_shared_memory(SPLIT, H, BN, R)
    gl.warp_specialize([
        (_dense_scores_warps, (Q_LAT, Q_PE, PART_ML, row, head0, lo, hi, qk_scale, num_heads, num_splits, split,
                               stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem, p_bufs, f_bufs, l_buf,
                               kv0, kv1, kv2, kv3, pe_bufs, unit_bufs, kv_ready, p_ready, p_free, done, GROUP, BN, H,
                               DIRECT)),
        (_dense_values_warps, (OUT, PART_O, row, head0, lo, hi, num_heads, num_splits, split, stride_ot, stride_oh,
                               p_bufs, f_bufs, l_buf, kv0, kv1, kv2, kv3, unit_bufs, kv_empty, p_ready, p_free, done,
                               GROUP, BN, L, H, DIRECT)),
        (_dense_dequant_warps, (codes_desc, scales_desc, rope_desc, TABLES, table_row, lo, hi, slots, kv0, kv1, kv2,
                                kv3, pe_bufs, unit_bufs, raw_codes, raw_scales, raw_rope, raw_bar, kv_ready, kv_empty,
                                SPLIT, BLOCK_SIZE, BN, R, L, H, DEQUANT_WARPS)),
    ], [4, DEQUANT_WARPS], [VALUES_WARP_REGS, DEQUANT_WARP_REGS])


def dense_descriptors(cache, box: int) -> tuple:
    """The TMA descriptors of :func:`dense_mla_kernel` over fp8_ds_mla rows ``cache [nb, bs, 656]``
    (bytes; blocks contiguous): the rows as ``[nb * bs, 164]`` words, boxes of ``box`` rows of the
    codes' 128-dim chunks, of the scales and of the RoPE values."""
    nb, bs, _ = cache.shape
    pitch = cache.stride(1)
    words = cache.view(torch.int32).as_strided((nb * bs, LATENT // 4 + 4 + ROPE // 2), (pitch // 4, 1))
    scales = cache.view(torch.float32).as_strided((nb * bs, LATENT // 4 + 4 + ROPE // 2), (pitch // 4, 1))
    rope = cache.view(torch.bfloat16).as_strided((nb * bs, LATENT // 2 + 8 + ROPE), (pitch // 2, 1))
    return (TensorDescriptor.from_tensor(words, [box, 32], RAW_CODES_SL.value),
            TensorDescriptor.from_tensor(scales, [box, 4], RAW_SCALES_SL.value),
            TensorDescriptor.from_tensor(rope, [box, ROPE], RAW_ROPE_SL.value))
