"""Dense MLA decode over an fp8_ds_mla cache on Hopper with the scores as fp8 MMAs on the raw
codes: :func:`dense_mla_fp8_kernel`.

DeepSeek-V2's 16 heads per program make dense MLA a bytes kernel, and what bounded the earlier
Gluon kernels was shared memory: :mod:`gluon_kernels`' dense kernel sends each 64-key tile through
it five times (the copy, the dequant warps' read, their float16 stores, the scores MMA's A reads, the
values MMA's A reads; about 2,900 wavefronts per tile); :mod:`gluon_dense`'s register operands halve
that but leave each warp group a chain of register-operand MMAs to wait for. Here the scores need
no conversion at all:

* **scores** ``S[key, head] = sum_d code[key, d] scale[key, d // 128] q[head, d]``: the TMA copy of
  a tile's codes is already an fp8 MMA's A operand (keys as M, each key's 128 codes of a chunk
  contiguous: K-major, 128-byte swizzled). The query is split once per program into two e4m3
  parts, ``q 2^k = hi + lo / 16`` (``2^k`` putting the head's largest value in [2^7, 2^8); ``hi``
  the e4m3 rounding, ``lo`` the rest times 16, rounded again), stacked as the MMA's N (``2H``
  columns: the heads' ``hi`` then their ``lo``). A bf16 query has 8 significant bits, ``hi`` keeps
  4 and the rest fits ``lo``'s 4, so the split is exact for every value above 2^-10 of its head's
  largest (below, ``lo`` rounds at 2^-9: 2^-21 of the largest, where the float16 query of the other
  kernels rounds at 2^-28). Each 128-dim chunk is one accumulator (four ``m64n32k32`` MMAs, fresh:
  the tensor core keeps only some 12 bits of a sum of fp8 products, so every 128 products are
  promoted), times the chunk's float32 scale in registers; the RoPE part is a
  bf16 MMA on the raw slot's RoPE values. Shared-memory reads of the scores: the codes once (32 KB
  a tile), where the float16 kernels wrote and read 64 KB.
* **values** ``O^T[d, head] = sum_key kv[key, d] p[key, head]``: :mod:`gluon_dense`'s two values
  warp groups (dims as M, 256 each; A fragments converted in registers from the raw slot, a
  code times its scale over the tile's unit in float16; float16 probabilities from the scores
  group; float32 accumulators).

One program (row, block of 16 heads, split of keys) per SM, three warp groups: the scores group
(the query, the split's boxes and every TMA copy, ``STAGES - 1`` tiles ahead; the scores and the
online softmax) and the two values groups, a tile behind, sharing ``STAGES`` raw slots (no float16
tile anywhere: four slots fit where the float16 kernels held one).

Numerics: the scores are exact products of codes and the query's two e4m3 parts, summed per chunk
by the tensor core (about 12 bits of the sum kept: 3.1 off a dot product of 9,348 on the H200),
then in float32; the values as :mod:`gluon_dense`'s. Largest per-head error against the float32
reference 3.6e-3 to 3.9e-3 in the dense GPU tests, the launcher's kernel's.

Measured on one H200 (docs/BENCH.md): 342 against the launcher's 302 µs at 32 rows, 32k, so it is
not the launcher's (``MlaTiles.dense_kernel = "fp8"`` selects it). The scores cost 11-23 µs over
what the copies and the softmax take alone (the launcher's kernel's scores alone took 128 µs); the
values groups, each converting and scaling 128 codes per thread per tile and waiting for its 16
MMAs before the next tile's rescale, add 61-75. ``PROBE`` leaves stages out for
``bench/dense_mla_regs_probe.py --kernel fp8``.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                             warpgroup_mma_wait)

from pcppass.kernels.attention import gluon_kernels
from pcppass.kernels.attention.gluon_dense import (WS_VALUES_REGS, _chunk_scales, _ws_values, key_scales_layout,
                                                   ws_scores_tiles, ws_shared_memory)
from pcppass.kernels.attention.gluon_kernels import _dense_box_slots, _exponent, _two_to, dense_program

#: keys per tile (the MMAs' M and the values' K), heads per program
BN = gl.constexpr(gluon_kernels.DENSE_BN)
HEADS = gluon_kernels.DENSE_HEADS
#: raw slots (tiles in flight beside the one being read)
FP8_STAGES = 4
#: the query's largest value per head is put in [2^QUERY_EXPONENT, 2^(QUERY_EXPONENT + 1)): its
#: e4m3 rounding stays at most 256, under e4m3's largest (448)
QUERY_EXPONENT = gl.constexpr(7)
#: ``lo`` is the query's rest after ``hi`` times LO_FACTOR
LO_FACTOR = gl.constexpr(16.0)
LO_INVERSE = gl.constexpr(1.0 / 16.0)
#: the codes of a chunk as the scores MMA's A: 64 keys x 128 e4m3 codes, the raw slot's 128-byte rows
CODES_FP8_SL = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))


@gluon.jit
def _query_parts_to_smem(Q_LAT, Q_PE, row, head0, stride_qt, stride_qh, stride_pt, stride_ph, q8_smem, qpe_smem,
                         GROUP: gl.constexpr, H: gl.constexpr, heads_l: gl.constexpr):
    """The program's ``GROUP`` heads' latent queries, each times the power of two ``2^k`` that puts
    its largest value in [2^7, 2^8), as two e4m3 parts per 128-dim chunk: ``q8_smem[c]`` rows
    ``[0, H)`` hold ``hi = e4m3(q 2^k)``, rows ``[H, 2H)`` ``lo = e4m3((q 2^k - hi) 16)`` (zero
    heads pad to ``H``); the RoPE queries as they are (bf16). Returns ``2^-k`` per head in ``heads_l``."""
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    qh = gl.arange(0, H, layout=gl.SliceLayout(1, q_l))
    qd = gl.arange(0, 128, layout=gl.SliceLayout(0, q_l))
    rq = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
    live = (qh < GROUP)[:, None]
    q_at = Q_LAT + row * stride_qt + (head0 + qh)[:, None] * stride_qh + qd[None, :]
    amax = gl.max(gl.abs(gl.load(q_at, mask=live, other=0.0).to(gl.float32)), axis=1)
    for c in gl.static_range(1, 4):
        amax = gl.maximum(amax, gl.max(gl.abs(gl.load(q_at + c * 128, mask=live, other=0.0).to(gl.float32)), axis=1))
    # the parts are stored from 16 codes per thread: stored as the split leaves them (8 per thread,
    # into row slices or joined), they read back wrong on Triton 3.6 (off by up to 0.98 on the H200)
    store_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    k = gl.minimum(gl.maximum(QUERY_EXPONENT - _exponent(amax), -126), 126)
    up = _two_to(k)
    for c in gl.static_range(4):
        q = gl.load(q_at + c * 128, mask=live, other=0.0).to(gl.float32) * up[:, None]
        hi = q.to(gl.float8e4nv)
        lo = ((q - hi.to(gl.float32)) * LO_FACTOR).to(gl.float8e4nv)
        parts = gl.reshape(gl.permute(gl.join(hi, lo), (2, 0, 1)), [2 * H, 128])
        q8_smem.index(c).store(gl.convert_layout(parts, store_l))
    qpe_smem.store(gl.load(Q_PE + row * stride_pt + (head0 + qh)[:, None] * stride_ph + rq[None, :], mask=live,
                           other=0.0))
    fence_async_shared()
    return gl.convert_layout(_two_to(-k), heads_l)


@gluon.jit
def _query_halves(acc, s_l: gl.constexpr):
    """A chunk's accumulator ``[64 keys, 2H]`` (the query's ``hi`` columns, then its ``lo``) as
    ``hi + lo / 16`` ``[64, H]`` in ``s_l`` (column ``H`` is a register bit: no data moves)."""
    H: gl.constexpr = acc.shape[1] // 2
    hi, lo = gl.split(gl.permute(gl.reshape(acc, [acc.shape[0], 2, H]), (0, 2, 1)))
    return gl.convert_layout(hi + lo * LO_INVERSE, s_l, assert_trivial=True)


@gluon.jit
def _fp8_scores(codes8, first, raw_rope, raw_scales, q8_smem, qpe_smem, H: gl.constexpr, s_l: gl.constexpr,
                PROBE: gl.constexpr):
    """A tile's scores ``[64 keys, H]`` before the query's scaling is undone: each chunk's codes
    (buffers ``first .. first + 3`` of ``codes8``) against the query's two e4m3 parts, one fresh
    accumulator per chunk, times the chunk's scales; plus the RoPE part (bf16). ``PROBE >= 2``:
    zeros, no MMA."""
    if PROBE >= 2:
        zeros = gl.zeros([64, H], gl.float32, layout=s_l)
        return zeros, zeros
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * H, 32])
    zero = gl.zeros([64, 2 * H], gl.float32, layout=acc_l)
    a0 = warpgroup_mma(codes8.index(first + 0), q8_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    a1 = warpgroup_mma(codes8.index(first + 1), q8_smem.index(1).permute((1, 0)), zero, use_acc=False, is_async=True)
    a2 = warpgroup_mma(codes8.index(first + 2), q8_smem.index(2).permute((1, 0)), zero, use_acc=False, is_async=True)
    a3 = warpgroup_mma(codes8.index(first + 3), q8_smem.index(3).permute((1, 0)), zero, use_acc=False, is_async=True)
    s_pe = warpgroup_mma(raw_rope, qpe_smem.permute((1, 0)), gl.zeros([64, H], gl.float32, layout=s_l),
                         use_acc=False, is_async=True)
    c0, c1, c2, c3 = _chunk_scales(raw_scales.load(key_scales_layout()))
    keys_l: gl.constexpr = gl.SliceLayout(1, s_l)
    a0, a1, a2, a3, s_pe = warpgroup_mma_wait(0, deps=(a0, a1, a2, a3, s_pe))
    lat = (_query_halves(a0, s_l) * gl.convert_layout(c0, keys_l, assert_trivial=True)[:, None]
           + _query_halves(a1, s_l) * gl.convert_layout(c1, keys_l, assert_trivial=True)[:, None]
           + _query_halves(a2, s_l) * gl.convert_layout(c2, keys_l, assert_trivial=True)[:, None]
           + _query_halves(a3, s_l) * gl.convert_layout(c3, keys_l, assert_trivial=True)[:, None])
    return lat, s_pe


@gluon.jit
def _fp8_scores_group(Q_LAT, Q_PE, PART_ML, codes_desc, scales_desc, rope_desc, TABLES, row, head0, lo, hi, table_row,
                      qk_scale, num_heads, num_splits, split, stride_qt, stride_qh, stride_pt, stride_ph, q8_smem,
                      qpe_smem, slots, raw_codes, raw_scales, raw_rope, raw_ready, raw_free, p_bufs, f_bufs, l_buf,
                      p_ready, p_free, done, BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr, GROUP: gl.constexpr,
                      R: gl.constexpr, H: gl.constexpr, DIRECT: gl.constexpr, STAGES: gl.constexpr,
                      PROBE: gl.constexpr):
    """The scores warp group: the query's parts and the split's boxes, then
    :func:`gluon_dense.ws_scores_tiles` with the fp8 scores (:func:`_fp8_scores`) on the raw codes."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    codes8 = raw_codes._reinterpret(gl.float8e4nv, [4 * STAGES, BN, 128], CODES_FP8_SL)
    down = _query_parts_to_smem(Q_LAT, Q_PE, row, head0, stride_qt, stride_qh, stride_pt, stride_ph, q8_smem,
                                qpe_smem, GROUP, H, gl.SliceLayout(0, s_l))
    _dense_box_slots(TABLES, table_row, lo, hi, slots, SPLIT, BLOCK_SIZE, BN, R, 4)
    ws_scores_tiles(_fp8_scores, codes8, q8_smem, qpe_smem, down, PART_ML, codes_desc, scales_desc, rope_desc, row,
                    head0, lo, hi, qk_scale, num_heads, num_splits, split, slots, raw_codes, raw_scales, raw_rope,
                    raw_ready, raw_free, p_bufs, f_bufs, l_buf, p_ready, p_free, done, GROUP, R, H, DIRECT, STAGES,
                    PROBE, s_l)


@gluon.jit
def dense_mla_fp8_kernel(
    Q_LAT, Q_PE, codes_desc, scales_desc, rope_desc, TABLES, POSITIONS, TOKEN_TO_REQ, IS_PADDING, OUT, PART_O, PART_ML,
    qk_scale, num_splits, num_heads,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_table, stride_ot, stride_oh,
    BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr, GROUP: gl.constexpr, DIRECT: gl.constexpr, R: gl.constexpr,
    H: gl.constexpr = HEADS, STAGES: gl.constexpr = FP8_STAGES, VALUES_WARP_REGS: gl.constexpr = WS_VALUES_REGS,
    PROBE: gl.constexpr = 0,
):
    """Dense MLA decode over fp8_ds_mla rows, program (row, block of ``GROUP`` heads, split of
    ``SPLIT`` keys): ``softmax(q_lat . kv + q_pe . k_pe) @ kv`` over the row's positions up to its
    own, the rows through :func:`gluon_kernels.dense_descriptors` (boxes of ``R`` rows); the scores
    as fp8 MMAs on the raw codes, the values in two warp groups. See the module docstring.
    ``PROBE`` leaves stages out for ``bench/dense_mla_regs_probe.py`` (its output is then wrong):
    1 the values, 2 the scores' MMAs, 3 both (the copies, the softmax and the hand-overs remain)."""
    row, head0, split, lo, hi, table_row = dense_program(POSITIONS, TOKEN_TO_REQ, IS_PADDING, stride_table, SPLIT,
                                                         GROUP)
    q8_smem = gl.allocate_shared_memory(gl.float8e4nv, [4, 2 * H, 128], CODES_FP8_SL)
    (qpe_smem, p_bufs, f_bufs, l_buf, slots, raw_codes, raw_scales, raw_rope, raw_ready, raw_free, p_ready, p_free,
     done) = ws_shared_memory(SPLIT, H, R, STAGES)
    gl.warp_specialize([
        (_fp8_scores_group, (Q_LAT, Q_PE, PART_ML, codes_desc, scales_desc, rope_desc, TABLES, row, head0, lo, hi,
                             table_row, qk_scale, num_heads, num_splits, split, stride_qt, stride_qh, stride_pt,
                             stride_ph, q8_smem, qpe_smem, slots, raw_codes, raw_scales, raw_rope, raw_ready, raw_free,
                             p_bufs, f_bufs, l_buf, p_ready, p_free, done, BLOCK_SIZE, SPLIT, GROUP, R, H, DIRECT,
                             STAGES, PROBE)),
        (_ws_values, (OUT, PART_O, row, head0, lo, hi, num_heads, num_splits, split, stride_ot, stride_oh, raw_codes,
                      raw_scales, raw_ready, raw_free, p_bufs, f_bufs, l_buf, p_ready, p_free, done, 0, GROUP, H,
                      DIRECT, STAGES, PROBE % 2 == 1)),
        (_ws_values, (OUT, PART_O, row, head0, lo, hi, num_heads, num_splits, split, stride_ot, stride_oh, raw_codes,
                      raw_scales, raw_ready, raw_free, p_bufs, f_bufs, l_buf, p_ready, p_free, done, 1, GROUP, H,
                      DIRECT, STAGES, PROBE % 2 == 1)),
    ], [4, 4], [VALUES_WARP_REGS, VALUES_WARP_REGS])
