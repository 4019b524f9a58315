"""Dense fp8_ds_mla MLA decode in Gluon (Triton's lower-level language: explicit layouts, shared
memory, Hopper's warp-group MMA, warp specialisation), timed by ``bench/ds_mla_variants.py``.

One program per (row, key split), 64-key tiles, keys as the MMA's M (``kv @ q^T``: 64 keys x 16
heads) and the latent dims as the values' M (``kv^T @ p``: 128 dims x 16 heads per latent chunk),
both operands read from shared memory, where each tile is dequantised once:

* :func:`ds_mla_one_group_kernel`: one warp group does everything in turn (load, dequantise into
  shared memory, scores, softmax, values).
* :func:`ds_mla_ws_kernel`: warp-specialised. Four *dequant warps* copy the next tile's codes into
  shared memory (``cp.async``) while they dequantise this one (code x scale, bf16) into the free
  slot of a two-tile ring; four *MMA warps* run the scores, the softmax and the values of the
  other slot. mbarriers hand the slots over.
* :func:`ds_mla_ws_f16_kernel`: the same split, the dequant warps' work cut to one conversion per
  two codes (float16, exact): the scales move to the MMA warps, onto the float32 scores and onto
  the probabilities (each latent chunk's probabilities over their running largest per head, so
  they cannot underflow float16 where a small-scale key carries the weight).

``_launch`` in ``bench/ds_mla_variants.py`` calls them with the launcher's splits and combine.
DeepSeek-V2 widths only (``L = 512`` latent dims in four 128-dim chunks, ``R = 64`` RoPE dims, at
most 16 heads per row).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

from pcppass.kernels.attention.gluon_kernels import e4m3_words_f16, pow2_scales


@gluon.jit
def _tile_bases(table, start, hi, BN: gl.constexpr, BLOCK_SIZE: gl.constexpr, stride_b, stride_s,
                layout: gl.constexpr):
    """Each key's byte offset in the cache for keys ``[start, start + BN)``, and which are ``< hi``."""
    j = start + gl.arange(0, BN, layout=layout)
    jm = j < hi
    block = gl.load(table + j // BLOCK_SIZE, mask=jm, other=0)
    return block.to(gl.int64) * stride_b + (j % BLOCK_SIZE).to(gl.int64) * stride_s, jm


@gluon.jit
def _copy_codes(raw, SCALES, table, start, hi, stride_b, stride_s, BN: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                codes_l: gl.constexpr):
    """cp.async of a key tile's codes (32-bit words) into ``raw [BN, 128]``; each thread copies the
    words it later reads, so no barrier orders the copy and the reads."""
    base, jm = _tile_bases(table, start, hi, BN, BLOCK_SIZE, stride_b, stride_s, gl.SliceLayout(1, codes_l))
    d = gl.arange(0, 128, layout=gl.SliceLayout(0, codes_l))
    async_copy.async_copy_global_to_shared(raw, SCALES + (base // 4)[:, None] + d[None, :], mask=jm[:, None])
    async_copy.commit_group()


@gluon.jit
def _scales_rope(SCALES, ROPE, table, start, hi, stride_b, stride_s, BN: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                 L: gl.constexpr, codes_l: gl.constexpr, rope_l: gl.constexpr):
    """A key tile's four chunk scales (float32, per key) and its RoPE values (bf16 [BN, 64])."""
    base, jm = _tile_bases(table, start, hi, BN, BLOCK_SIZE, stride_b, stride_s, gl.SliceLayout(1, codes_l))
    base_r, jrm = _tile_bases(table, start, hi, BN, BLOCK_SIZE, stride_b, stride_s, gl.SliceLayout(1, rope_l))
    r = gl.arange(0, 64, layout=gl.SliceLayout(0, rope_l))
    sc = SCALES + base // 4 + L // 4
    s0 = gl.load(sc, mask=jm, other=0.0)
    s1 = gl.load(sc + 1, mask=jm, other=0.0)
    s2 = gl.load(sc + 2, mask=jm, other=0.0)
    s3 = gl.load(sc + 3, mask=jm, other=0.0)
    pe = gl.load(ROPE + (base_r // 2)[:, None] + (L + 16) // 2 + r[None, :], mask=jrm[:, None], other=0.0)
    return s0, s1, s2, s3, pe


@gluon.jit
def _codes_f16(k):
    """32-bit words of four e4m3 codes [BN, W] -> their float16 values [BN, 4W] (exact)."""
    c0, c1, c2, c3 = e4m3_words_f16(k)
    v = gl.permute(gl.join(gl.join(c0, c1), gl.join(c2, c3)), (0, 1, 3, 2))
    return gl.reshape(v, [v.shape[0], v.shape[1] * 4])


@gluon.jit
def _dequant(k, s):
    """32-bit words of four e4m3 codes [BN, W] -> bf16 values times their key's scale [BN, 4W]."""
    v = _codes_f16(k)
    return (v.to(gl.float32) * gl.convert_layout(s, gl.SliceLayout(1, v.type.layout))[:, None]).to(gl.bfloat16)


@gluon.jit
def _query_to_smem(Q_LAT, Q_PE, row, stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem,
                   GROUP: gl.constexpr, M: gl.constexpr):
    """The row's latent query (four 128-dim chunks) and RoPE query, bf16, into shared memory."""
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    qh = gl.arange(0, M, layout=gl.SliceLayout(1, q_l))
    qd = gl.arange(0, 128, layout=gl.SliceLayout(0, q_l))
    rq = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
    live = qh < GROUP
    for c in gl.static_range(4):
        q_smem.index(c).store(gl.load(Q_LAT + row * stride_qt + qh[:, None] * stride_qh + c * 128 + qd[None, :],
                                      mask=live[:, None], other=0.0))
    qpe_smem.store(gl.load(Q_PE + row * stride_pt + qh[:, None] * stride_ph + rq[None, :], mask=live[:, None],
                           other=0.0))
    fence_async_shared()


@gluon.jit
def _store_partials(acc0, acc1, acc2, acc3, m_i, l_i, PART_O, PART_ML, row, num_heads, num_splits, split,
                    GROUP: gl.constexpr, M: gl.constexpr, L: gl.constexpr, layout: gl.constexpr):
    """The split's unnormalised output (``acc_c``: dims x heads) and its running max and sum."""
    heads = gl.arange(0, M, layout=gl.SliceLayout(0, layout))
    dims = gl.arange(0, 128, layout=gl.SliceLayout(1, layout))
    live = heads < GROUP
    part = (row * num_heads + heads) * num_splits + split
    at = PART_O + part[None, :] * L + dims[:, None]
    gl.store(at, acc0, mask=live[None, :])
    gl.store(at + 128, acc1, mask=live[None, :])
    gl.store(at + 256, acc2, mask=live[None, :])
    gl.store(at + 384, acc3, mask=live[None, :])
    gl.store(PART_ML + part * 2, m_i, mask=live)
    gl.store(PART_ML + part * 2 + 1, l_i, mask=live)


@gluon.jit
def _scores_bf16(kv, first, pe_buf, q_smem, qpe_smem, mma_l: gl.constexpr, BN: gl.constexpr, M: gl.constexpr):
    """``kv @ q^T + pe @ q_pe^T`` over one dequantised tile (its chunks: ``kv[first + c]``)."""
    s = warpgroup_mma(pe_buf, qpe_smem.permute((1, 0)), gl.zeros([BN, M], gl.float32, layout=mma_l), is_async=True)
    for c in gl.static_range(4):
        s = warpgroup_mma(kv.index(first + c), q_smem.index(c).permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(0, deps=(s,))


@gluon.jit
def _softmax_step(s, start, hi, pos, qk_scale, m_i, l_i, mma_l: gl.constexpr, BN: gl.constexpr):
    """One score tile (keys x heads) into the running max and sum: (p, alpha, max, sum)."""
    js = start + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_l))
    s = gl.where(((js <= pos) & (js < hi))[:, None], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[None, :])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=0)


@gluon.jit
def _values(kv, first, p_smem, acc0, acc1, acc2, acc3, f0, f1, f2, f3, P_PER_CHUNK: gl.constexpr):
    """``acc_c * f_c + kv_c^T @ p`` for the four latent chunks (``kv[first + c]``), waited for
    (``P_PER_CHUNK``: ``p_smem[c]`` for chunk ``c``). The accumulators are
    rescaled before the first MMA is issued: a register defined between two asynchronous MMAs
    makes ptxas serialise every one of them."""
    a0 = acc0 * f0[None, :]
    a1 = acc1 * f1[None, :]
    a2 = acc2 * f2[None, :]
    a3 = acc3 * f3[None, :]
    if P_PER_CHUNK:
        a0 = warpgroup_mma(kv.index(first + 0).permute((1, 0)), p_smem.index(0), a0, is_async=True)
        a1 = warpgroup_mma(kv.index(first + 1).permute((1, 0)), p_smem.index(1), a1, is_async=True)
        a2 = warpgroup_mma(kv.index(first + 2).permute((1, 0)), p_smem.index(2), a2, is_async=True)
        a3 = warpgroup_mma(kv.index(first + 3).permute((1, 0)), p_smem.index(3), a3, is_async=True)
    else:
        a0 = warpgroup_mma(kv.index(first + 0).permute((1, 0)), p_smem, a0, is_async=True)
        a1 = warpgroup_mma(kv.index(first + 1).permute((1, 0)), p_smem, a1, is_async=True)
        a2 = warpgroup_mma(kv.index(first + 2).permute((1, 0)), p_smem, a2, is_async=True)
        a3 = warpgroup_mma(kv.index(first + 3).permute((1, 0)), p_smem, a3, is_async=True)
    return warpgroup_mma_wait(0, deps=(a0, a1, a2, a3))


@gluon.jit
def ds_mla_one_group_kernel(
    Q_LAT, Q_PE, CACHE, SCALES, ROPE, TABLES, POSITIONS, TOKEN_TO_REQ, IS_PADDING,
    OUT, PART_O, PART_ML, qk_scale, num_splits, num_heads,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_b, stride_s, stride_table, stride_ot, stride_oh,
    BLOCK_SIZE: gl.constexpr, GROUP: gl.constexpr, M: gl.constexpr, BN: gl.constexpr, L: gl.constexpr,
    SPLIT: gl.constexpr, NBLK: gl.constexpr,
):
    """One warp group per program, each tile in turn: its codes loaded (32-bit words) and
    dequantised into shared memory, then scores, softmax and values (4 warps)."""
    codes_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    heads_s: gl.constexpr = gl.SliceLayout(0, mma_l)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    row = gl.program_id(0).to(gl.int64)
    split = gl.program_id(2)
    pos = gl.load(POSITIONS + row)
    lo = split * SPLIT
    hi = gl.minimum(lo + SPLIT, pos + 1).to(gl.int32)
    hi = gl.where(gl.load(IS_PADDING + row) == 0, hi, lo)
    kv = gl.allocate_shared_memory(gl.bfloat16, [4, BN, 128], kv_sl)
    pe_buf = gl.allocate_shared_memory(gl.bfloat16, [BN, 64], kv_sl)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [4, M, 128], kv_sl)
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [M, 64], kv_sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, M], p_sl)
    _query_to_smem(Q_LAT, Q_PE, row, stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem, GROUP, M)
    table = TABLES + gl.load(TOKEN_TO_REQ + row) * stride_table
    m_i = gl.full([M], float("-inf"), gl.float32, layout=heads_s)
    l_i = gl.full([M], 0.0, gl.float32, layout=heads_s)
    acc0 = gl.zeros([128, M], gl.float32, layout=mma_l)
    acc1 = gl.zeros([128, M], gl.float32, layout=mma_l)
    acc2 = gl.zeros([128, M], gl.float32, layout=mma_l)
    acc3 = gl.zeros([128, M], gl.float32, layout=mma_l)
    d = gl.arange(0, 32, layout=gl.SliceLayout(0, codes_l))
    for start in range(lo, hi, BN):
        base, jm = _tile_bases(table, start, hi, BN, BLOCK_SIZE, stride_b, stride_s, gl.SliceLayout(1, codes_l))
        s0, s1, s2, s3, pe = _scales_rope(SCALES, ROPE, table, start, hi, stride_b, stride_s, BN, BLOCK_SIZE, L,
                                          codes_l, rope_l)
        words = SCALES + (base // 4)[:, None] + d[None, :]
        kv.index(0).store(_dequant(gl.load(words, mask=jm[:, None], other=0.0).to(gl.int32, bitcast=True), s0))
        kv.index(1).store(_dequant(gl.load(words + 32, mask=jm[:, None], other=0.0).to(gl.int32, bitcast=True), s1))
        kv.index(2).store(_dequant(gl.load(words + 64, mask=jm[:, None], other=0.0).to(gl.int32, bitcast=True), s2))
        kv.index(3).store(_dequant(gl.load(words + 96, mask=jm[:, None], other=0.0).to(gl.int32, bitcast=True), s3))
        pe_buf.store(pe)
        fence_async_shared()
        s = _scores_bf16(kv, 0, pe_buf, q_smem, qpe_smem, mma_l, BN, M)
        p, alpha, m_i, l_i = _softmax_step(s, start, hi, pos, qk_scale, m_i, l_i, mma_l, BN)
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        acc0, acc1, acc2, acc3 = _values(kv, 0, p_smem, acc0, acc1, acc2, acc3, alpha, alpha, alpha, alpha, False)
    _store_partials(acc0, acc1, acc2, acc3, m_i, l_i, PART_O, PART_ML, row, num_heads, num_splits, split, GROUP, M,
                    L, mma_l)


@gluon.jit
def _dequant_warps(CACHE, SCALES, ROPE, table, lo, hi, stride_b, stride_s, kv_bufs, pe_bufs, sc_bufs, raw, kv_ready,
                   kv_empty, BN: gl.constexpr, BLOCK_SIZE: gl.constexpr, L: gl.constexpr, F16: gl.constexpr):
    """4 warps: the next tile's codes fly into shared memory (cp.async, ``raw``) while this one is
    converted from registers into the free slot of the ring with its RoPE values: code x scale as
    bf16, or (``F16``) the codes as float16 and their scales to ``sc_bufs``."""
    codes_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    _copy_codes(raw, SCALES, table, lo, hi, stride_b, stride_s, BN, BLOCK_SIZE, codes_l)
    s0, s1, s2, s3, pe = _scales_rope(SCALES, ROPE, table, lo, hi, stride_b, stride_s, BN, BLOCK_SIZE, L,
                                      codes_l, rope_l)
    i = 0
    for start in range(lo, hi, BN):
        t0, t1, t2, t3, npe = _scales_rope(SCALES, ROPE, table, start + BN, hi, stride_b, stride_s, BN,
                                           BLOCK_SIZE, L, codes_l, rope_l)
        async_copy.wait_group(0)
        k0 = raw.slice(0, 32, dim=1).load(codes_l)
        k1 = raw.slice(32, 32, dim=1).load(codes_l)
        k2 = raw.slice(64, 32, dim=1).load(codes_l)
        k3 = raw.slice(96, 32, dim=1).load(codes_l)
        _copy_codes(raw, SCALES, table, start + BN, hi, stride_b, stride_s, BN, BLOCK_SIZE, codes_l)
        slot = i % 2
        first = slot * 4
        mbarrier.wait(kv_empty.index(slot), ((i // 2) & 1) ^ 1)
        if F16:
            kv_bufs.index(first).store(_codes_f16(k0))
            kv_bufs.index(first + 1).store(_codes_f16(k1))
            kv_bufs.index(first + 2).store(_codes_f16(k2))
            kv_bufs.index(first + 3).store(_codes_f16(k3))
            sc_bufs.index(first).store(s0)
            sc_bufs.index(first + 1).store(s1)
            sc_bufs.index(first + 2).store(s2)
            sc_bufs.index(first + 3).store(s3)
        else:
            kv_bufs.index(first).store(_dequant(k0, s0))
            kv_bufs.index(first + 1).store(_dequant(k1, s1))
            kv_bufs.index(first + 2).store(_dequant(k2, s2))
            kv_bufs.index(first + 3).store(_dequant(k3, s3))
        pe_bufs.index(slot).store(pe)
        fence_async_shared()
        mbarrier.arrive(kv_ready.index(slot), count=1)
        s0 = t0
        s1 = t1
        s2 = t2
        s3 = t3
        pe = npe
        i += 1
    async_copy.wait_group(0)


@gluon.jit
def _mma_warps(q_smem, qpe_smem, p_smem, kv_bufs, pe_bufs, kv_ready, kv_empty, lo, hi, pos, qk_scale,
               PART_O, PART_ML, row, num_heads, num_splits, split, GROUP: gl.constexpr, M: gl.constexpr,
               BN: gl.constexpr, L: gl.constexpr):
    """4 warps: scores, softmax and values of each dequantised tile, the slot handed back after
    its values; then the split's partials."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    heads_s: gl.constexpr = gl.SliceLayout(0, mma_l)
    m_i = gl.full([M], float("-inf"), gl.float32, layout=heads_s)
    l_i = gl.full([M], 0.0, gl.float32, layout=heads_s)
    acc0 = gl.zeros([128, M], gl.float32, layout=mma_l)
    acc1 = gl.zeros([128, M], gl.float32, layout=mma_l)
    acc2 = gl.zeros([128, M], gl.float32, layout=mma_l)
    acc3 = gl.zeros([128, M], gl.float32, layout=mma_l)
    i = 0
    for start in range(lo, hi, BN):
        slot = i % 2
        mbarrier.wait(kv_ready.index(slot), (i // 2) & 1)
        s = _scores_bf16(kv_bufs, slot * 4, pe_bufs.index(slot), q_smem, qpe_smem, mma_l, BN, M)
        p, alpha, m_i, l_i = _softmax_step(s, start, hi, pos, qk_scale, m_i, l_i, mma_l, BN)
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        acc0, acc1, acc2, acc3 = _values(kv_bufs, slot * 4, p_smem, acc0, acc1, acc2, acc3, alpha, alpha, alpha,
                                         alpha, False)
        mbarrier.arrive(kv_empty.index(slot), count=1)
        i += 1
    _store_partials(acc0, acc1, acc2, acc3, m_i, l_i, PART_O, PART_ML, row, num_heads, num_splits, split, GROUP, M,
                    L, mma_l)


@gluon.jit
def _split_range(POSITIONS, IS_PADDING, row, split, SPLIT: gl.constexpr):
    """The split's keys ``[lo, hi)`` (empty for a padding row)."""
    lo = split * SPLIT
    hi = gl.minimum(lo + SPLIT, gl.load(POSITIONS + row) + 1).to(gl.int32)
    return lo, gl.where(gl.load(IS_PADDING + row) == 0, hi, lo)


@gluon.jit
def _ring_barriers():
    """(ready, empty) mbarriers of the two ring slots."""
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(empty.index(b), count=1)
    return ready, empty


@gluon.jit
def ds_mla_ws_kernel(
    Q_LAT, Q_PE, CACHE, SCALES, ROPE, TABLES, POSITIONS, TOKEN_TO_REQ, IS_PADDING,
    OUT, PART_O, PART_ML, qk_scale, num_splits, num_heads,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_b, stride_s, stride_table, stride_ot, stride_oh,
    BLOCK_SIZE: gl.constexpr, GROUP: gl.constexpr, M: gl.constexpr, BN: gl.constexpr, L: gl.constexpr,
    SPLIT: gl.constexpr, NBLK: gl.constexpr, DEQUANT_REGS: gl.constexpr = 192,
):
    """Warp-specialised (:func:`_mma_warps` and :func:`_dequant_warps`, 4 warps each): a ring of
    two dequantised bf16 tiles (2 x 72 KB) and one tile of codes in flight (32 KB), one program
    per SM."""
    kv_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    row = gl.program_id(0).to(gl.int64)
    split = gl.program_id(2)
    lo, hi = _split_range(POSITIONS, IS_PADDING, row, split, SPLIT)
    kv_bufs = gl.allocate_shared_memory(gl.bfloat16, [8, BN, 128], kv_sl)
    pe_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 64], kv_sl)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [4, M, 128], kv_sl)
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [M, 64], kv_sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, M], p_sl)
    raw = gl.allocate_shared_memory(gl.int32, [BN, 128], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    kv_ready, kv_empty = _ring_barriers()
    _query_to_smem(Q_LAT, Q_PE, row, stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem, GROUP, M)
    pos = gl.load(POSITIONS + row)
    table = TABLES + gl.load(TOKEN_TO_REQ + row) * stride_table
    gl.warp_specialize([
        (_mma_warps, (q_smem, qpe_smem, p_smem, kv_bufs, pe_bufs, kv_ready, kv_empty, lo, hi, pos, qk_scale,
                      PART_O, PART_ML, row, num_heads, num_splits, split, GROUP, M, BN, L)),
        (_dequant_warps, (CACHE, SCALES, ROPE, table, lo, hi, stride_b, stride_s, kv_bufs, pe_bufs, raw, raw,
                          kv_ready, kv_empty, BN, BLOCK_SIZE, L, False)),
    ], [4], [DEQUANT_REGS])


@gluon.jit
def _chunk_probs(p, sc, g, alpha, p_buf):
    """One latent chunk's probabilities times its keys' scales, over their running largest per
    head (so each is at most 1 as float16 and the largest product is exact to float16's rounding);
    stores them for the values MMA and returns (factor for the chunk's accumulator, new largest)."""
    pc = p * sc[:, None]
    n = gl.maximum(g * alpha, gl.max(pc, axis=0))
    n = gl.where(n > 0.0, n, 1.0)
    p_buf.store((pc * (1.0 / n)[None, :]).to(gl.float16))
    return g * alpha / n, n


@gluon.jit
def _mma_warps_f16(q_smem, qpe_smem, p_bufs, kv_bufs, pe_bufs, sc_bufs, kv_ready, kv_empty, lo, hi, pos,
                   qk_scale, down_buf, PART_O, PART_ML, row, num_heads, num_splits, split, GROUP: gl.constexpr,
                   M: gl.constexpr, BN: gl.constexpr, L: gl.constexpr):
    """4 warps: float16 scores per latent chunk times each key's chunk scale (and the query's
    power-of-two scale undone), softmax, chunk probabilities (:func:`_chunk_probs`) into the float16
    values MMA; the accumulators carry their chunk's running largest until the end."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    keys_s: gl.constexpr = gl.SliceLayout(1, mma_l)
    heads_s: gl.constexpr = gl.SliceLayout(0, mma_l)
    down = down_buf.load(heads_s)
    m_i = gl.full([M], float("-inf"), gl.float32, layout=heads_s)
    l_i = gl.full([M], 0.0, gl.float32, layout=heads_s)
    g0 = gl.full([M], 0.0, gl.float32, layout=heads_s)
    g1 = gl.full([M], 0.0, gl.float32, layout=heads_s)
    g2 = gl.full([M], 0.0, gl.float32, layout=heads_s)
    g3 = gl.full([M], 0.0, gl.float32, layout=heads_s)
    acc0 = gl.zeros([128, M], gl.float32, layout=mma_l)
    acc1 = gl.zeros([128, M], gl.float32, layout=mma_l)
    acc2 = gl.zeros([128, M], gl.float32, layout=mma_l)
    acc3 = gl.zeros([128, M], gl.float32, layout=mma_l)
    zero = gl.zeros([BN, M], gl.float32, layout=mma_l)
    i = 0
    for start in range(lo, hi, BN):
        slot = i % 2
        first = slot * 4
        mbarrier.wait(kv_ready.index(slot), (i // 2) & 1)
        # use_acc=False: no register of a later MMA is written while an earlier one is in flight
        s_pe = warpgroup_mma(pe_bufs.index(slot), qpe_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        x0 = warpgroup_mma(kv_bufs.index(first), q_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        x1 = warpgroup_mma(kv_bufs.index(first + 1), q_smem.index(1).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
        x2 = warpgroup_mma(kv_bufs.index(first + 2), q_smem.index(2).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
        x3 = warpgroup_mma(kv_bufs.index(first + 3), q_smem.index(3).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
        s_pe, x0, x1, x2, x3 = warpgroup_mma_wait(0, deps=(s_pe, x0, x1, x2, x3))
        c0 = sc_bufs.index(first).load(keys_s)
        c1 = sc_bufs.index(first + 1).load(keys_s)
        c2 = sc_bufs.index(first + 2).load(keys_s)
        c3 = sc_bufs.index(first + 3).load(keys_s)
        s_lat = x0 * c0[:, None] + x1 * c1[:, None] + x2 * c2[:, None] + x3 * c3[:, None]
        p, alpha, m_i, l_i = _softmax_step(s_lat * down[None, :] + s_pe, start, hi, pos, qk_scale, m_i, l_i, mma_l,
                                           BN)
        f0, g0 = _chunk_probs(p, c0, g0, alpha, p_bufs.index(0))
        f1, g1 = _chunk_probs(p, c1, g1, alpha, p_bufs.index(1))
        f2, g2 = _chunk_probs(p, c2, g2, alpha, p_bufs.index(2))
        f3, g3 = _chunk_probs(p, c3, g3, alpha, p_bufs.index(3))
        fence_async_shared()
        acc0, acc1, acc2, acc3 = _values(kv_bufs, first, p_bufs, acc0, acc1, acc2, acc3, f0, f1, f2, f3, True)
        mbarrier.arrive(kv_empty.index(slot), count=1)
        i += 1
    _store_partials(acc0 * g0[None, :], acc1 * g1[None, :], acc2 * g2[None, :], acc3 * g3[None, :], m_i, l_i,
                    PART_O, PART_ML, row, num_heads, num_splits, split, GROUP, M, L, mma_l)


@gluon.jit
def _query_to_smem_f16(Q_LAT, Q_PE, row, stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem, down_buf,
                       GROUP: gl.constexpr, M: gl.constexpr):
    """:func:`_query_to_smem` with the latent query as float16, each head scaled by the power of
    two that puts its largest value in [2^14, 2^15) (every bf16 value of the head exact); the
    factors that undo it go to ``down_buf``."""
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    qh = gl.arange(0, M, layout=gl.SliceLayout(1, q_l))
    qd = gl.arange(0, 128, layout=gl.SliceLayout(0, q_l))
    rq = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
    live = qh < GROUP
    q_at = Q_LAT + row * stride_qt + qh[:, None] * stride_qh + qd[None, :]
    q0 = gl.load(q_at, mask=live[:, None], other=0.0).to(gl.float32)
    q1 = gl.load(q_at + 128, mask=live[:, None], other=0.0).to(gl.float32)
    q2 = gl.load(q_at + 256, mask=live[:, None], other=0.0).to(gl.float32)
    q3 = gl.load(q_at + 384, mask=live[:, None], other=0.0).to(gl.float32)
    amax = gl.maximum(gl.maximum(gl.max(gl.abs(q0), axis=1), gl.max(gl.abs(q1), axis=1)),
                      gl.maximum(gl.max(gl.abs(q2), axis=1), gl.max(gl.abs(q3), axis=1)))
    up, down = pow2_scales(amax)
    q_smem.index(0).store((q0 * up[:, None]).to(gl.float16))
    q_smem.index(1).store((q1 * up[:, None]).to(gl.float16))
    q_smem.index(2).store((q2 * up[:, None]).to(gl.float16))
    q_smem.index(3).store((q3 * up[:, None]).to(gl.float16))
    down_buf.store(down)
    qpe_smem.store(gl.load(Q_PE + row * stride_pt + qh[:, None] * stride_ph + rq[None, :], mask=live[:, None],
                           other=0.0))
    fence_async_shared()


@gluon.jit
def ds_mla_ws_f16_kernel(
    Q_LAT, Q_PE, CACHE, SCALES, ROPE, TABLES, POSITIONS, TOKEN_TO_REQ, IS_PADDING,
    OUT, PART_O, PART_ML, qk_scale, num_splits, num_heads,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_b, stride_s, stride_table, stride_ot, stride_oh,
    BLOCK_SIZE: gl.constexpr, GROUP: gl.constexpr, M: gl.constexpr, BN: gl.constexpr, L: gl.constexpr,
    SPLIT: gl.constexpr, NBLK: gl.constexpr, DEQUANT_REGS: gl.constexpr = 168,
):
    """:func:`ds_mla_ws_kernel` with float16 codes (:func:`_dequant_warps` with ``F16``,
    :func:`_mma_warps_f16`)."""
    kv_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    row = gl.program_id(0).to(gl.int64)
    split = gl.program_id(2)
    lo, hi = _split_range(POSITIONS, IS_PADDING, row, split, SPLIT)
    kv_bufs = gl.allocate_shared_memory(gl.float16, [8, BN, 128], kv_sl)
    pe_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 64], kv_sl)
    sc_bufs = gl.allocate_shared_memory(gl.float32, [8, BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_smem = gl.allocate_shared_memory(gl.float16, [4, M, 128], kv_sl)
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [M, 64], kv_sl)
    p_bufs = gl.allocate_shared_memory(gl.float16, [4, BN, M], p_sl)
    down_buf = gl.allocate_shared_memory(gl.float32, [M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    raw = gl.allocate_shared_memory(gl.int32, [BN, 128], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    kv_ready, kv_empty = _ring_barriers()
    _query_to_smem_f16(Q_LAT, Q_PE, row, stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem, down_buf,
                       GROUP, M)
    pos = gl.load(POSITIONS + row)
    table = TABLES + gl.load(TOKEN_TO_REQ + row) * stride_table
    gl.warp_specialize([
        (_mma_warps_f16, (q_smem, qpe_smem, p_bufs, kv_bufs, pe_bufs, sc_bufs, kv_ready, kv_empty, lo, hi, pos,
                          qk_scale, down_buf, PART_O, PART_ML, row, num_heads, num_splits, split, GROUP, M, BN, L)),
        (_dequant_warps, (CACHE, SCALES, ROPE, table, lo, hi, stride_b, stride_s, kv_bufs, pe_bufs, sc_bufs, raw,
                          kv_ready, kv_empty, BN, BLOCK_SIZE, L, True)),
    ], [4], [DEQUANT_REGS])
