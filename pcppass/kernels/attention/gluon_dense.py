"""Dense MLA decode over an fp8_ds_mla cache on Hopper with both MMAs' A operands in registers,
converted straight from the raw key tile: :func:`dense_mla_regs_kernel`.

DeepSeek-V2's 16 heads per program make dense MLA a bytes kernel (656 bytes against 16 x 1088 MMA
lanes per key), and what bounded the warp-specialised kernel of :mod:`gluon_kernels` was shared
memory, not HBM: each 64-key tile's codes went through it five times (the copy, the dequant warps'
read, their float16 stores, the scores MMA's A reads, the values MMA's A reads; about 2,900
wavefronts per tile). Here each tile's raw bytes are copied into shared memory once (TMA) and read
once by each MMA's warps, who convert them in registers into the MMA's A fragments: about 1,200
wavefronts per tile.

The trick is an order of the reduction dimension that puts a thread's fragment elements next to
each other in the cache row, so a fragment is filled by 16-byte loads:

* **scores** ``S[key, head] = sum_d kv[key, d] q[head, d]``, keys as M (64), heads as N (16): the
  A fragment of ``m64n16k16`` gives lane ``4g + t`` of warp ``w`` the keys ``16w + g (+8)`` and the
  reduction positions ``16s + 8q + 2t + e``. Within each 128-dim chunk, position
  ``k = 16w' + 8b1 + 2t + b0`` is taken to be the cache's dim ``32t + 4w' + 2b1 + b0`` (the query's
  dims are laid out in the same order once per program), so lane ``t`` reads dims
  ``[32t, 32t + 32)`` of its two keys: two 16-byte loads per key and chunk. Every chunk has an
  accumulator of its own, so the chunk's scale multiplies the float32 scores of its keys: the codes
  go into the MMA as they are (one ``cvt`` per two codes; every e4m3 value is a float16).
* **values** ``O^T[d, head] = sum_key kv[key, d] p[key, head]``, dims as M (8 x 64), keys as K:
  the A fragment gives lane ``4g + t`` of warp ``w`` the M rows ``64mb + 16w + g + 8h`` and the keys
  ``16s + 8q + 2t + e``. Row ``64mb + 16w + 8h + g`` is taken to be dim ``128w + 16g + 4(mb // 2)
  + 2(mb % 2) + h``: warp ``w`` holds chunk ``w``, lane ``g`` its 16 bytes ``[16g, 16g + 16)`` of
  each of its keys (one 16-byte load per key). The scale varies along K here, so the codes are
  multiplied by ``scale / F`` in float16 (``F`` the tile's unit, :func:`gluon_kernels._tile_unit`)
  and the accumulators carry ``F``, as in the warp-specialised kernel. The output rows are written
  back to their dims through the same map.

Both loads are free of bank conflicts in the TMA copy's 128-byte swizzle (the eight 16-byte units of
a quarter-warp's loads fall in eight different bank groups); the layout conversions into the MMA
fragments move no data (``assert_trivial``). Program (row, block of 16 heads, split of keys), one
warp group, two raw slots (the next tile's TMA copies in flight while this one is computed), about
100 KB of shared memory, so two programs share an SM.

Numerics: the scores are exact products of codes and float16 queries summed in float32, times the
float32 scale; the values as :func:`gluon_kernels.dense_mla_kernel` (a value's code times its scale
over the tile's unit, rounded to float16; float16 probabilities; float32 accumulation).

Measured on one H200 (docs/BENCH.md): the shared-memory pipe half as busy as the warp-specialised
kernel's, yet 331 against 306 µs at 32 rows, 32k, so it is not the launcher's (``MlaTiles.dense_kernel``
selects it). Its 255 registers (the values' 64 accumulator registers, two fragments in flight on
each side) leave two programs of one warp group per SM, and one warp group's MMA chain, each group
waited for before its registers are reused, is then the time: with zero fragments and no codes read
the kernel still takes 296 µs. ``PROBE`` leaves a stage out for ``bench/dense_mla_regs_probe.py``.

:func:`dense_mla_regs_ws_kernel` splits the same conversions over three warp groups of one program
per SM (scores with the TMA copies; two values groups of 256 dims each, a tile behind): no spills,
but 380 µs, its one scores warp group's MMA chain and softmax per tile being the bound.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_wait)

from pcppass.kernels.attention import gluon_kernels
from pcppass.kernels.attention.gluon_kernels import (RAW_CODES_SL, RAW_ROPE_SL, RAW_SCALES_SL, _dense_box_slots,
                                                     _dense_load_tile, _dense_tile_unit, _half2_bits, _hand_over,
                                                     _query_to_smem, dense_program, dense_split_stats,
                                                     e4m3_words_f16, e4m3_words_scaled_f16, keys_softmax_step)

#: keys per tile (the scores MMA's M, the values MMA's K), heads per program (both MMAs' N)
BN = gl.constexpr(gluon_kernels.DENSE_BN)
HEADS = gluon_kernels.DENSE_HEADS
LATENT = gl.constexpr(gluon_kernels.LATENT)


@gluon.constexpr_function
def scores_codes_layout():
    """One 128-dim chunk's codes ``[64 keys, 32 words]`` as the scores' A fragments need them:
    lane ``4g + t`` of warp ``w`` holds keys ``16w + g`` and ``16w + g + 8``, words ``[8t, 8t + 8)``
    (two 16-byte loads per key)."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
                                      lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32])


@gluon.constexpr_function
def key_scales_layout():
    """A tile's scales ``[64 keys, 4 chunks]`` held by the threads that hold the keys' scores (as
    :func:`scores_codes_layout`'s keys), all four chunks in registers."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                      lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 4])


@gluon.constexpr_function
def values_codes_layout():
    """A tile's codes ``[4 chunks, 64 keys, 32 words]`` as the values' A fragments need them: warp
    ``w`` holds chunk ``w``; lane ``4g + t`` the words ``[4g, 4g + 4)`` (one 16-byte load) of keys
    ``16s + 8q + 2t + e``."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 8, 0], [0, 16, 0], [0, 32, 0]],
                                      lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
                                      warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 64, 32])


@gluon.constexpr_function
def values_scales_layout():
    """A tile's scales ``[64 keys, 4 chunks]`` held as :func:`values_codes_layout` holds the keys'
    codes (warp ``w`` chunk ``w``), read as they lie in shared memory and then transposed in
    registers."""
    return gl.DistributedLinearLayout(reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]],
                                      lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[[0, 1], [0, 2]], block_bases=[], shape=[64, 4])


@gluon.constexpr_function
def values_rows_layout():
    """:func:`values_codes_layout` over the slot's codes seen as ``[4 x 64 rows, 32 words]`` (what a
    shared-memory load of the swizzled rows takes: chunk ``c``'s key ``k`` is row ``64c + k``)."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0], [16, 0], [32, 0]],
                                      lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]],
                                      warp_bases=[[64, 0], [128, 0]], block_bases=[], shape=[256, 32])


@gluon.jit
def _scores_operand(raw_codes, c, a_layout: gl.constexpr, PROBE: gl.constexpr):
    """Chunk buffer ``c`` of ``raw_codes`` as the scores' A fragment ``[64 keys, 128]`` (float16, the
    reduction in the permuted order of the module docstring)."""
    if PROBE == 3:
        return gl.zeros([64, 128], gl.float16, layout=a_layout)
    words = raw_codes.index(c).load(scores_codes_layout())
    b0, b1, b2, b3 = e4m3_words_f16(words)
    v = gl.join(gl.join(b0, b1), gl.join(b2, b3))  # [64, 32 words = 8t + w', b0, b1]
    v = gl.permute(gl.reshape(v, [64, 4, 8, 2, 2]), (0, 2, 4, 1, 3))  # [64, w', b1, t, b0]
    return gl.convert_layout(gl.reshape(v, [64, 128]), a_layout, assert_trivial=True)


@gluon.jit
def _values_operand(words, scale, a_layout: gl.constexpr, PROBE: gl.constexpr):
    """A quarter of a tile's codes ``words [4 chunks, 16 keys, 32 words]`` times ``scale`` (float16x2
    bits, the same shape) as the values' A fragment ``[512 rows, 16 keys]`` (rows in the order of
    the module docstring)."""
    if PROBE == 3:
        return gl.zeros([512, 16], gl.float16, layout=a_layout)
    b0, b1, b2, b3 = e4m3_words_scaled_f16(words, scale)
    v = gl.join(gl.join(b0, b1), gl.join(b2, b3))  # [c, key, word = 4g + wd, b0, b1]
    v = gl.permute(gl.reshape(v, [4, 16, 8, 4, 2, 2]), (3, 5, 0, 4, 2, 1))  # [wd, b1, c, b0, g, key]
    return gl.convert_layout(gl.reshape(v, [512, 16]), a_layout, assert_trivial=True)


@gluon.jit
def _key_halves(x):
    """``x [c, 2n, 32]`` as its keys ``[0, n)`` and ``[n, 2n)`` (the top key bit a register's in
    :func:`values_codes_layout` and :func:`pair_codes_layout`: no data moves)."""
    n: gl.constexpr = x.shape[1] // 2
    return gl.split(gl.permute(gl.reshape(x, [x.shape[0], 2, n, 32]), (0, 2, 3, 1)))


@gluon.jit
def _key_quarters(x):
    """``x [c, 64, 32]`` as its four quarters of 16 keys."""
    lo, hi = _key_halves(x)
    q0, q1 = _key_halves(lo)
    q2, q3 = _key_halves(hi)
    return q0, q1, q2, q3


@gluon.jit
def _chunk_scales(scales):
    """A tile's scales ``[64, 4]`` (:func:`key_scales_layout`) as four ``[64]`` columns."""
    lo, hi = gl.split(gl.reshape(scales, [64, 2, 2]))
    s0, s2 = gl.split(lo)
    s1, s3 = gl.split(hi)
    return s0, s1, s2, s3


@gluon.jit
def _scores(raw_codes, first, raw_rope, raw_scales, q_smem, qpe_smem, H: gl.constexpr, s_l: gl.constexpr,
            PROBE: gl.constexpr):
    """A tile's scores ``[64 keys, H]`` before the query's scaling is undone (its codes the chunk
    buffers ``first .. first + 3`` of ``raw_codes``): each chunk's codes
    against the permuted query into an accumulator of its own, times the chunk's scales, plus the
    RoPE part (bf16, A from shared memory)."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
    zero = gl.zeros([64, H], gl.float32, layout=s_l)
    a0 = _scores_operand(raw_codes, first + 0, a_l, PROBE)
    s0 = warpgroup_mma(a0, q_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    a1 = _scores_operand(raw_codes, first + 1, a_l, PROBE)
    s1 = warpgroup_mma(a1, q_smem.index(1).permute((1, 0)), zero, use_acc=False, is_async=True)
    s0, a0 = warpgroup_mma_wait(1, deps=(s0, a0))
    a2 = _scores_operand(raw_codes, first + 2, a_l, PROBE)
    s2 = warpgroup_mma(a2, q_smem.index(2).permute((1, 0)), zero, use_acc=False, is_async=True)
    s1, a1 = warpgroup_mma_wait(1, deps=(s1, a1))
    a3 = _scores_operand(raw_codes, first + 3, a_l, PROBE)
    s3 = warpgroup_mma(a3, q_smem.index(3).permute((1, 0)), zero, use_acc=False, is_async=True)
    s_pe = warpgroup_mma(raw_rope, qpe_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
    c0, c1, c2, c3 = _chunk_scales(raw_scales.load(key_scales_layout()))
    keys_l: gl.constexpr = gl.SliceLayout(1, s_l)
    s2, s3, s_pe, a2, a3 = warpgroup_mma_wait(0, deps=(s2, s3, s_pe, a2, a3))
    lat = (s0 * gl.convert_layout(c0, keys_l, assert_trivial=True)[:, None]
           + s1 * gl.convert_layout(c1, keys_l, assert_trivial=True)[:, None]
           + s2 * gl.convert_layout(c2, keys_l, assert_trivial=True)[:, None]
           + s3 * gl.convert_layout(c3, keys_l, assert_trivial=True)[:, None])
    return lat, s_pe


@gluon.jit
def _quarter_mmas(o, words, factor, p_buf, operand: gl.constexpr, a_l: gl.constexpr, PROBE: gl.constexpr):
    """``o`` plus the values MMAs of a tile's four quarters of 16 keys (``words`` and their
    ``factor`` split by :func:`_key_quarters`, each converted by ``operand`` into an A fragment):
    two quarters' MMAs in flight, a quarter's fragment converted while the one before runs."""
    w0, w1, w2, w3 = _key_quarters(words)
    f0, f1, f2, f3 = _key_quarters(factor)
    a0 = operand(w0, f0, a_l, PROBE)
    o = warpgroup_mma(a0, p_buf.slice(0, 16), o, is_async=True)
    a1 = operand(w1, f1, a_l, PROBE)
    o = warpgroup_mma(a1, p_buf.slice(16, 16), o, is_async=True)
    o, a0 = warpgroup_mma_wait(1, deps=(o, a0))
    a2 = operand(w2, f2, a_l, PROBE)
    o = warpgroup_mma(a2, p_buf.slice(32, 16), o, is_async=True)
    o, a1 = warpgroup_mma_wait(1, deps=(o, a1))
    a3 = operand(w3, f3, a_l, PROBE)
    o = warpgroup_mma(a3, p_buf.slice(48, 16), o, is_async=True)
    o, a2, a3 = warpgroup_mma_wait(0, deps=(o, a2, a3))
    return o


@gluon.jit
def _values(o, raw_codes, raw_scales, p_buf, first_key, hi, inverse, o_l: gl.constexpr, PROBE: gl.constexpr):
    """``o + kv^T @ p`` over the slot's tile (dims as M, in the order of the module docstring), the
    codes times their scales over the tile's unit; keys from ``hi`` on contribute nothing (their
    codes and scales are zeroed: whatever bytes they hold)."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    codes_l: gl.constexpr = values_codes_layout()
    scales_l: gl.constexpr = gl.SliceLayout(2, codes_l)
    keys = first_key + gl.arange(0, 64, layout=gl.SliceLayout(0, scales_l))
    live = (keys < hi)[None, :]
    by_key = raw_scales.load(values_scales_layout())
    scale = gl.where(live, gl.convert_layout(gl.permute(by_key, (1, 0)), scales_l, assert_trivial=True), 0.0) * inverse
    rows = raw_codes._reinterpret(gl.int32, [256, 32], RAW_CODES_SL).load(values_rows_layout())
    words = gl.where(live[:, :, None], gl.convert_layout(gl.reshape(rows, [4, 64, 32]), codes_l, assert_trivial=True),
                     0)
    factor, words = gl.broadcast(_half2_bits(scale)[:, :, None], words)
    return _quarter_mmas(o, words, factor, p_buf, _values_operand, a_l, PROBE)


@gluon.jit
def _output_dims(o_l: gl.constexpr):
    """The cache dim of each of the values accumulator's 512 rows (module docstring), ``[512, 1]``."""
    r = gl.arange(0, 512, layout=gl.SliceLayout(1, o_l))
    mb = r >> 6
    return (128 * ((r >> 4) & 3) + 16 * (r & 7) + 4 * (mb >> 1) + 2 * (mb & 1) + ((r >> 3) & 1))[:, None]


@gluon.jit
def _tile_softmax(lat, s_pe, down, qk_scale, first_key, hi, m_i, l_rows, s_l: gl.constexpr):
    """A tile's scores (the latent part's query scaling undone, keys from ``hi`` on at -inf) through
    :func:`gluon_kernels.keys_softmax_step`."""
    s = (lat * down[None, :] + s_pe) * qk_scale
    s = gl.where((first_key + gl.arange(0, BN, layout=gl.SliceLayout(1, s_l)) < hi)[:, None], s, float("-inf"))
    return keys_softmax_step(s, m_i, l_rows)


@gluon.jit
def _load_tile(codes_desc, scales_desc, rope_desc, slots, tile, n_tiles, raw, R: gl.constexpr):
    """TMA copies of tile ``tile`` (when there is one) into the raw slot ``raw`` (codes, scales,
    RoPE values, mbarrier)."""
    if tile < n_tiles:
        codes, scales, rope, bar = raw
        _dense_load_tile(codes_desc, scales_desc, rope_desc, slots, tile, codes, scales, rope, bar, BN, R, LATENT, 4)


@gluon.jit
def _raw_slot(R: gl.constexpr):
    """One raw slot: a tile's codes (four 128-dim chunks), scales and RoPE values as the TMA copies
    write them, and the mbarrier they complete."""
    codes = gl.allocate_shared_memory(gl.int32, [4, BN, 32], RAW_CODES_SL)
    scales = gl.allocate_shared_memory(gl.float32, [BN, 4], RAW_SCALES_SL)
    rope = gl.allocate_shared_memory(gl.bfloat16, [BN, 64], RAW_ROPE_SL)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    return codes, scales, rope, bar


@gluon.jit
def _attend_tile(state, raw, phase, first_key, hi, q_smem, qpe_smem, p_buf, down, qk_scale, H: gl.constexpr,
                 s_l: gl.constexpr, PROBE: gl.constexpr):
    """One key tile of the online softmax: ``state`` (running max, the accumulators' unit, per-row
    running sums, output accumulators) updated with the tile in slot ``raw`` once its copies land."""
    m_i, g, l_rows, o = state
    codes, scales, rope, bar = raw
    mbarrier.wait(bar, phase)
    if PROBE == 2:
        lat = gl.zeros([BN, H], gl.float32, layout=s_l)
        s_pe = lat
    else:
        lat, s_pe = _scores(codes, 0, rope, scales, q_smem, qpe_smem, H, s_l, PROBE)
    unit, inverse = _dense_tile_unit(scales, first_key, hi, BN, 4)
    m_new, alpha, p, l_rows = _tile_softmax(lat, s_pe, down, qk_scale, first_key, hi, m_i, l_rows, s_l)
    p_buf.store(p.to(gl.float16))
    fence_async_shared()
    o = o * (alpha * (g / unit))[None, :]
    if PROBE != 1:
        o = _values(o, codes, scales, p_buf, first_key, hi, inverse, s_l, PROBE)
    return m_new, gl.zeros_like(g) + unit, l_rows, o


@gluon.jit
def dense_mla_regs_kernel(
    Q_LAT, Q_PE, codes_desc, scales_desc, rope_desc, TABLES, POSITIONS, TOKEN_TO_REQ, IS_PADDING, OUT, PART_O, PART_ML,
    qk_scale, num_splits, num_heads,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_table, stride_ot, stride_oh,
    BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr, GROUP: gl.constexpr, DIRECT: gl.constexpr, R: gl.constexpr,
    H: gl.constexpr = HEADS, PROBE: gl.constexpr = 0,
):
    """Dense MLA decode over fp8_ds_mla rows, program (row, block of ``GROUP`` heads, split of
    ``SPLIT`` keys), one warp group: ``softmax(q_lat . kv + q_pe . k_pe) @ kv`` over the row's
    positions up to its own, the rows through :func:`gluon_kernels.dense_descriptors` (boxes of
    ``R`` rows). See the module docstring."""
    row, head0, split, lo, hi, table_row = dense_program(POSITIONS, TOKEN_TO_REQ, IS_PADDING, stride_table, SPLIT,
                                                         GROUP)
    f16_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * H, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.float16, [4, H, 128], f16_sl)
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [H, 64], f16_sl)
    p_buf = gl.allocate_shared_memory(gl.float16, [BN, H], p_sl)
    slots = gl.allocate_shared_memory(gl.int32, [SPLIT // BN, BN // R], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    raw0 = _raw_slot(R)
    raw1 = _raw_slot(R)

    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    o_l: gl.constexpr = s_l
    heads_s: gl.constexpr = gl.SliceLayout(0, s_l)
    down = _query_to_smem(Q_LAT, Q_PE, row, head0, stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem,
                          GROUP, H, heads_s, PERMUTED=True)
    _dense_box_slots(TABLES, table_row, lo, hi, slots, SPLIT, BLOCK_SIZE, BN, R, 4)
    n_tiles = gl.cdiv(hi - lo, BN)
    _load_tile(codes_desc, scales_desc, rope_desc, slots, 0, n_tiles, raw0, R)

    m_i = gl.full([H], float("-inf"), gl.float32, layout=heads_s)
    g = gl.full([H], 1.0, gl.float32, layout=heads_s)  # the unit the accumulators are in
    state = (m_i, g, gl.zeros([BN, H], gl.float32, layout=s_l), gl.zeros([LATENT, H], gl.float32, layout=o_l))
    # two tiles per iteration, so each slot is a buffer of its own (a slot's view cannot be chosen
    # at run time); the other slot held the tile before, whose MMAs every warp has waited for
    for i in range(0, n_tiles, 2):
        phase = (i // 2) & 1
        _load_tile(codes_desc, scales_desc, rope_desc, slots, i + 1, n_tiles, raw1, R)
        state = _attend_tile(state, raw0, phase, lo + i * BN, hi, q_smem, qpe_smem, p_buf, down, qk_scale, H, s_l,
                             PROBE)
        if i + 1 < n_tiles:
            _load_tile(codes_desc, scales_desc, rope_desc, slots, i + 2, n_tiles, raw0, R)
            state = _attend_tile(state, raw1, phase, lo + (i + 1) * BN, hi, q_smem, qpe_smem, p_buf, down, qk_scale,
                                 H, s_l, PROBE)
    m_i, g, l_rows, o = state
    l_i = gl.sum(l_rows, axis=0)
    heads = gl.arange(0, H, layout=heads_s)
    live = (heads < GROUP)[None, :]
    dims = _output_dims(o_l)
    if DIRECT:
        f = g / gl.where(l_i == 0.0, 1.0, l_i)
        at = OUT + row * stride_ot + (head0 + heads)[None, :] * stride_oh
        gl.store(at + dims, (o * f[None, :]).to(OUT.dtype.element_ty), mask=live)
    else:
        part = (row * num_heads + head0 + heads) * num_splits + split
        gl.store(PART_O + part[None, :] * LATENT + dims, o * g[None, :], mask=live)
        gl.store(PART_ML + part * 2, m_i, mask=heads < GROUP)
        gl.store(PART_ML + part * 2 + 1, l_i, mask=heads < GROUP)


# --- the same conversions in three warp groups: scores, and the values split by dims -------------

#: registers of each values thread of :func:`dense_mla_regs_ws_kernel` (the scores warps take the rest)
WS_VALUES_REGS = 152
#: raw slots of :func:`dense_mla_regs_ws_kernel` (two tiles in flight beside the one being read)
WS_STAGES = gl.constexpr(3)


@gluon.constexpr_function
def pair_rows_layout():
    """A values warp group's half of a tile's codes, chunks ``2k`` and ``2k + 1`` as ``[2 x 64 rows,
    32 words]``: warp ``w`` holds chunk ``2k + (w >> 1)``, words ``[16 (w & 1), + 16)``; lane
    ``4g + t`` the two words ``2g`` (one 8-byte load) of keys ``16s + 8q + 2t + e``."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [1, 0], [8, 0], [16, 0], [32, 0]],
                                      lane_bases=[[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]],
                                      warp_bases=[[0, 16], [64, 0]], block_bases=[], shape=[128, 32])


@gluon.constexpr_function
def pair_codes_layout():
    """:func:`pair_rows_layout` as ``[2 chunks, 64 keys, 32 words]``."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 1, 0], [0, 8, 0], [0, 16, 0], [0, 32, 0]],
                                      lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 2], [0, 0, 4], [0, 0, 8]],
                                      warp_bases=[[0, 0, 16], [1, 0, 0]], block_bases=[], shape=[2, 64, 32])


@gluon.constexpr_function
def pair_scales_layout():
    """A tile's scales ``[64 keys, 4 chunks]`` as a values warp group needs them: the keys as
    :func:`pair_codes_layout`'s, chunk bit 0 the warp's (``w >> 1``), chunk bit 1 in registers."""
    return gl.DistributedLinearLayout(reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0], [0, 2]],
                                      lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[[0, 0], [0, 1]], block_bases=[], shape=[64, 4])


@gluon.jit
def _pair_operand(words, scale, a_layout: gl.constexpr, PROBE: gl.constexpr):
    """A quarter of the group's codes ``words [2 chunks, 16 keys, 32 words]`` times ``scale`` as the
    values' A fragment ``[256 rows, 16 keys]``: row ``64mb + 16w + 8h + g`` is the dim
    ``128 (2k + (w >> 1)) + 64 (w & 1) + 8g + 2mb + h`` (:func:`_pair_dims`). ``PROBE`` as
    :func:`_values_operand`'s."""
    if PROBE == 3:
        return gl.zeros([256, 16], gl.float16, layout=a_layout)
    b0, b1, b2, b3 = e4m3_words_scaled_f16(words, scale)
    v = gl.join(gl.join(b0, b1), gl.join(b2, b3))  # [c', key, word = 16 w1 + 2g + wd, b0, b1]
    v = gl.permute(gl.reshape(v, [2, 16, 2, 8, 2, 2, 2]), (4, 6, 0, 2, 5, 3, 1))  # [wd, b1, c', w1, b0, g, key]
    return gl.convert_layout(gl.reshape(v, [256, 16]), a_layout, assert_trivial=True)


@gluon.jit
def _pair_values(o, pair_rows, scales, p_buf, first_key, hi, inverse, K: gl.constexpr, o_l: gl.constexpr):
    """``o + kv^T @ p`` over chunks ``2K`` and ``2K + 1`` of a tile (``pair_rows``: their codes as
    ``[128, 32]``), the codes times their scales over the tile's unit; keys from ``hi`` on zeroed."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    codes_l: gl.constexpr = pair_codes_layout()
    scales_l: gl.constexpr = gl.SliceLayout(2, codes_l)
    keys = first_key + gl.arange(0, 64, layout=gl.SliceLayout(0, scales_l))
    live = (keys < hi)[None, :]
    by_key = gl.permute(gl.reshape(scales.load(pair_scales_layout()), [64, 2, 2]), (0, 2, 1))  # [key, c', k]
    mine, theirs = gl.split(by_key)
    if K == 1:
        mine = theirs
    scale = gl.where(live, gl.convert_layout(gl.permute(mine, (1, 0)), scales_l, assert_trivial=True), 0.0) * inverse
    rows = pair_rows.load(pair_rows_layout())
    words = gl.where(live[:, :, None], gl.convert_layout(gl.reshape(rows, [2, 64, 32]), codes_l, assert_trivial=True),
                     0)
    factor, words = gl.broadcast(_half2_bits(scale)[:, :, None], words)
    return _quarter_mmas(o, words, factor, p_buf, _pair_operand, a_l, 0)


@gluon.jit
def _pair_dims(K: gl.constexpr, o_l: gl.constexpr):
    """The cache dim of each of a values group's 256 accumulator rows (:func:`_pair_operand`)."""
    r = gl.arange(0, 256, layout=gl.SliceLayout(1, o_l))
    w = (r >> 4) & 3
    return (128 * (2 * K + (w >> 1)) + 64 * (w & 1) + 8 * (r & 7) + 2 * (r >> 6) + ((r >> 3) & 1))[:, None]


@gluon.jit
def _ws_load(codes_desc, scales_desc, rope_desc, slots, tile, n_tiles, raw_codes, raw_scales, raw_rope, raw_ready,
             raw_free, R: gl.constexpr, STAGES: gl.constexpr = WS_STAGES):
    """TMA copies of tile ``tile`` (when there is one) into its slot of ``STAGES``, once both values
    groups are done with the tile that slot held before."""
    if tile < n_tiles:
        s = tile % STAGES
        mbarrier.wait(raw_free.index(s), ((tile // STAGES) & 1) ^ 1)
        _dense_load_tile(codes_desc, scales_desc, rope_desc, slots, tile, raw_codes, raw_scales.index(s),
                         raw_rope.index(s), raw_ready.index(s), BN, R, LATENT, 4, 4 * s)


@gluon.jit
def _ws_scores(Q_LAT, Q_PE, PART_ML, codes_desc, scales_desc, rope_desc, TABLES, row, head0, lo, hi, table_row,
               qk_scale, num_heads, num_splits, split, stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem,
               slots, raw_codes, raw_scales, raw_rope, raw_ready, raw_free, p_bufs, f_bufs, l_buf, p_ready, p_free,
               done, BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr, GROUP: gl.constexpr, R: gl.constexpr,
               H: gl.constexpr, DIRECT: gl.constexpr):
    """The scores warp group: the query and the split's boxes, then :func:`ws_scores_tiles` with the
    scores from register operands (:func:`_scores`, the TMA copies two tiles ahead)."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    down = _query_to_smem(Q_LAT, Q_PE, row, head0, stride_qt, stride_qh, stride_pt, stride_ph, q_smem, qpe_smem,
                          GROUP, H, gl.SliceLayout(0, s_l), PERMUTED=True)
    _dense_box_slots(TABLES, table_row, lo, hi, slots, SPLIT, BLOCK_SIZE, BN, R, 4)
    ws_scores_tiles(_scores, raw_codes, q_smem, qpe_smem, down, PART_ML, codes_desc, scales_desc, rope_desc, row,
                    head0, lo, hi, qk_scale, num_heads, num_splits, split, slots, raw_codes, raw_scales, raw_rope,
                    raw_ready, raw_free, p_bufs, f_bufs, l_buf, p_ready, p_free, done, GROUP, R, H, DIRECT, WS_STAGES,
                    0, s_l)


@gluon.jit
def ws_scores_tiles(scores: gl.constexpr, codes, q_smem, qpe_smem, down, PART_ML, codes_desc, scales_desc, rope_desc,
                    row, head0, lo, hi, qk_scale, num_heads, num_splits, split, slots, raw_codes, raw_scales,
                    raw_rope, raw_ready, raw_free, p_bufs, f_bufs, l_buf, p_ready, p_free, done, GROUP: gl.constexpr,
                    R: gl.constexpr, H: gl.constexpr, DIRECT: gl.constexpr, STAGES: gl.constexpr,
                    PROBE: gl.constexpr, s_l: gl.constexpr):
    """A scores warp group's tiles, once its query is in shared memory (``down`` undoes its
    scaling): the TMA copies ``STAGES - 1`` tiles ahead, then per tile ``scores(codes, first chunk,
    RoPE values, scales, q_smem, qpe_smem, H, s_l, PROBE)``, the online softmax, the probabilities
    and the accumulators' factor for the values groups; at the end the running max and sum."""
    heads_s: gl.constexpr = gl.SliceLayout(0, s_l)
    n_tiles = gl.cdiv(hi - lo, BN)
    for t in gl.static_range(STAGES - 1):
        _ws_load(codes_desc, scales_desc, rope_desc, slots, t, n_tiles, raw_codes, raw_scales, raw_rope, raw_ready,
                 raw_free, R, STAGES)
    m_i = gl.full([H], float("-inf"), gl.float32, layout=heads_s)
    g = gl.full([H], 1.0, gl.float32, layout=heads_s)
    l_rows = gl.zeros([BN, H], gl.float32, layout=s_l)
    for i in range(n_tiles):
        _ws_load(codes_desc, scales_desc, rope_desc, slots, i + STAGES - 1, n_tiles, raw_codes, raw_scales, raw_rope,
                 raw_ready, raw_free, R, STAGES)
        s = i % STAGES
        mbarrier.wait(raw_ready.index(s), (i // STAGES) & 1)
        tile_scales = raw_scales.index(s)
        lat, s_pe = scores(codes, 4 * s, raw_rope.index(s), tile_scales, q_smem, qpe_smem, H, s_l, PROBE)
        first_key = lo + i * BN
        unit, inverse = _dense_tile_unit(tile_scales, first_key, hi, BN, 4)
        m_i, alpha, p, l_rows = _tile_softmax(lat, s_pe, down, qk_scale, first_key, hi, m_i, l_rows, s_l)
        factor = alpha * (g / unit)
        g = gl.zeros_like(g) + unit
        _hand_over(p, factor, p_bufs, f_bufs, p_ready, p_free, i % 2, (i // 2) & 1)
    dense_split_stats(l_rows, m_i, l_buf, done, PART_ML, row, head0, num_heads, num_splits, split, GROUP, H, DIRECT,
                      heads_s)


@gluon.jit
def _ws_values(OUT, PART_O, row, head0, lo, hi, num_heads, num_splits, split, stride_ot, stride_oh, raw_codes,
               raw_scales, raw_ready, raw_free, p_bufs, f_bufs, l_buf, p_ready, p_free, done, K: gl.constexpr,
               GROUP: gl.constexpr, H: gl.constexpr, DIRECT: gl.constexpr, STAGES: gl.constexpr = WS_STAGES,
               NO_VALUES: gl.constexpr = False):
    """A values warp group: ``kv^T @ p`` over latent chunks ``2K`` and ``2K + 1`` from the raw slots
    (register operands, :func:`_pair_values`) and the scores group's probabilities and factors,
    then those dims of the split's output (normalised into ``OUT`` with one split, else its partial
    output)."""
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    heads_o: gl.constexpr = gl.SliceLayout(0, o_l)
    pairs = raw_codes._reinterpret(gl.int32, [2 * STAGES, 2 * BN, 32], RAW_CODES_SL)
    g = gl.full([H], 1.0, gl.float32, layout=heads_o)
    o = gl.zeros([256, H], gl.float32, layout=o_l)
    for i in range(gl.cdiv(hi - lo, BN)):
        s = i % STAGES
        b = i % 2
        mbarrier.wait(raw_ready.index(s), (i // STAGES) & 1)
        mbarrier.wait(p_ready.index(b), (i // 2) & 1)
        scales = raw_scales.index(s)
        first_key = lo + i * BN
        unit, inverse = _dense_tile_unit(scales, first_key, hi, BN, 4)
        o = o * f_bufs.index(b).load(heads_o)[None, :]
        g = gl.zeros_like(g) + unit
        if not NO_VALUES:  # a probe's stage left out
            o = _pair_values(o, pairs.index(2 * s + K), scales, p_bufs.index(b), first_key, hi, inverse, K, o_l)
        mbarrier.arrive(p_free.index(b), count=1)
        mbarrier.arrive(raw_free.index(s), count=1)
    heads = gl.arange(0, H, layout=heads_o)
    live = (heads < GROUP)[None, :]
    dims = _pair_dims(K, o_l)
    if DIRECT:
        mbarrier.wait(done, 0)
        l_i = l_buf.load(heads_o)
        f = g / gl.where(l_i == 0.0, 1.0, l_i)
        at = OUT + row * stride_ot + (head0 + heads)[None, :] * stride_oh
        gl.store(at + dims, (o * f[None, :]).to(OUT.dtype.element_ty), mask=live)
    else:
        part = (row * num_heads + head0 + heads) * num_splits + split
        gl.store(PART_O + part[None, :] * LATENT + dims, o * g[None, :], mask=live)


@gluon.jit
def ws_shared_memory(SPLIT: gl.constexpr, H: gl.constexpr, R: gl.constexpr, STAGES: gl.constexpr):
    """Every shared buffer and mbarrier a scores warp group and two values warp groups share but the
    latent query's (the RoPE query, the probabilities' and factors' double buffers, the split's
    boxes, ``STAGES`` raw slots), the mbarriers initialised (a raw slot and a probabilities buffer
    are freed by both values groups)."""
    f16_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * H, element_bitwidth=16, rank=2)
    plain1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [H, 64], f16_sl)
    p_bufs = gl.allocate_shared_memory(gl.float16, [2, BN, H], p_sl)
    f_bufs = gl.allocate_shared_memory(gl.float32, [2, H], plain1)
    l_buf = gl.allocate_shared_memory(gl.float32, [H], plain1)
    slots = gl.allocate_shared_memory(gl.int32, [SPLIT // BN, BN // R], plain1)
    raw_codes = gl.allocate_shared_memory(gl.int32, [4 * STAGES, BN, 32], RAW_CODES_SL)
    raw_scales = gl.allocate_shared_memory(gl.float32, [STAGES, BN, 4], RAW_SCALES_SL)
    raw_rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, 64], RAW_ROPE_SL)
    raw_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    raw_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(raw_ready.index(b), count=1)
        mbarrier.init(raw_free.index(b), count=2)
    for b in gl.static_range(2):
        mbarrier.init(p_ready.index(b), count=1)
        mbarrier.init(p_free.index(b), count=2)
    mbarrier.init(done, count=1)
    return (qpe_smem, p_bufs, f_bufs, l_buf, slots, raw_codes, raw_scales, raw_rope, raw_ready, raw_free, p_ready,
            p_free, done)


@gluon.jit
def dense_mla_regs_ws_kernel(
    Q_LAT, Q_PE, codes_desc, scales_desc, rope_desc, TABLES, POSITIONS, TOKEN_TO_REQ, IS_PADDING, OUT, PART_O, PART_ML,
    qk_scale, num_splits, num_heads,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_table, stride_ot, stride_oh,
    BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr, GROUP: gl.constexpr, DIRECT: gl.constexpr, R: gl.constexpr,
    H: gl.constexpr = HEADS, VALUES_WARP_REGS: gl.constexpr = WS_VALUES_REGS,
):
    """:func:`dense_mla_regs_kernel`'s conversions in three warp groups sharing three raw slots:
    the scores group (the TMA copies, the scores, the softmax) and two values groups, each the
    values of two latent chunks (256 dims as M), a tile behind the scores."""
    row, head0, split, lo, hi, table_row = dense_program(POSITIONS, TOKEN_TO_REQ, IS_PADDING, stride_table, SPLIT,
                                                         GROUP)
    f16_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.float16, [4, H, 128], f16_sl)
    (qpe_smem, p_bufs, f_bufs, l_buf, slots, raw_codes, raw_scales, raw_rope, raw_ready, raw_free, p_ready, p_free,
     done) = ws_shared_memory(SPLIT, H, R, WS_STAGES)
    gl.warp_specialize([
        (_ws_scores, (Q_LAT, Q_PE, PART_ML, codes_desc, scales_desc, rope_desc, TABLES, row, head0, lo, hi, table_row,
                      qk_scale, num_heads, num_splits, split, stride_qt, stride_qh, stride_pt, stride_ph, q_smem,
                      qpe_smem, slots, raw_codes, raw_scales, raw_rope, raw_ready, raw_free, p_bufs, f_bufs, l_buf,
                      p_ready, p_free, done, BLOCK_SIZE, SPLIT, GROUP, R, H, DIRECT)),
        (_ws_values, (OUT, PART_O, row, head0, lo, hi, num_heads, num_splits, split, stride_ot, stride_oh, raw_codes,
                      raw_scales, raw_ready, raw_free, p_bufs, f_bufs, l_buf, p_ready, p_free, done, 0, GROUP, H,
                      DIRECT)),
        (_ws_values, (OUT, PART_O, row, head0, lo, hi, num_heads, num_splits, split, stride_ot, stride_oh, raw_codes,
                      raw_scales, raw_ready, raw_free, p_bufs, f_bufs, l_buf, p_ready, p_free, done, 1, GROUP, H,
                      DIRECT)),
    ], [4, 4], [VALUES_WARP_REGS, VALUES_WARP_REGS])
