"""Triton kernels of :mod:`pcppass.engine.attention` (loaded once per Triton mode by
:func:`pcppass.engine.attention.launch.kernels`: ``triton.jit`` decides between compiling and
interpreting when it decorates).

Every attention kernel reads the paged caches through the block table, row by row of the step:

* a *program tile* is ``BM`` rows of one local request (``ROW_MODE``: one row, its request
  ``token_to_req[row]``, skipped when ``is_padding[row]``; otherwise the launcher's schedule gives
  each tile its request, first row and row count);
* the third grid axis splits the keys into ``SPLIT``-token ranges (flash-decoding); each split
  writes an unnormalised partial output with its running max and sum, and
  :func:`combine_kernel` merges them (``DIRECT``: one split, normalised output written at once).

The split boundaries depend only on ``SPLIT`` (a constant per kernel), never on the batch: a row's
result is the same whichever rows share its step, as long as the step runs per-row programs (at
most ``ROW_MODE_MAX_ROWS`` rows); tiles of rows sum in another order (and fp8 GQA's decode shape
alone runs float16 dots).

Row ``m`` of a tile's query block is (row ``m // GROUP``, head ``m % GROUP``): the heads that share
one KV head (GQA) or the latent cache (MLA) are stacked into the M dimension of one ``tl.dot``.
Scores are float32 (``exp2`` with ``log2(e)`` folded into the scale).
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


# Only triton.language's builtins here (``tl.full``, not ``tl.zeros``; reductions through ``tl.reduce``
# with combine functions of this module, which is what ``tl.max`` / ``tl.sum`` do): the library's own
# ``@triton.jit`` functions were decorated in whichever mode triton was first imported in, and an
# interpreted kernel cannot call a compiled-mode one.


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def max_along(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _maximum)


@triton.jit
def sum_along(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _add)


@triton.jit
def tile_rows(pid, TOKEN_TO_REQ, IS_PADDING, TILE_REQ, TILE_ROW0, TILE_NROWS, ROW_MODE: tl.constexpr):
    """(request, first row, number of rows) of program tile ``pid``."""
    if ROW_MODE:
        req = tl.load(TOKEN_TO_REQ + pid)
        row0 = pid.to(tl.int64)
        nrows = 1 - tl.load(IS_PADDING + pid).to(tl.int32)
    else:
        req = tl.load(TILE_REQ + pid)
        row0 = tl.load(TILE_ROW0 + pid)
        nrows = tl.load(TILE_NROWS + pid).to(tl.int32)
    return req, row0, nrows


@triton.jit
def tile_lanes(row0, nrows, block, POSITIONS, GROUP: tl.constexpr, BM: tl.constexpr, M: tl.constexpr):
    """Lane ``m`` of a tile's query block: (live, row, head, position); row ``m // GROUP`` of the
    tile, head ``m % GROUP`` of the ``block``-th group of heads."""
    m = tl.arange(0, M)
    r = m // GROUP
    live = (r < nrows) & (m < BM * GROUP)
    row = row0 + r
    head = block * GROUP + m % GROUP
    return live, row, head, tl.load(POSITIONS + row, mask=live, other=-1)


@triton.jit
def split_blocks(table, lo, hi, BLOCK_SIZE: tl.constexpr, NBLK: tl.constexpr):
    """The block ids of a split's keys ``[lo, hi)`` (``NBLK`` table entries of the row ``table``
    from block ``lo // BLOCK_SIZE``), loaded once into registers; :func:`key_blocks` picks a key
    tile's from them. With no load between a tile's keys and its cache rows, the compiler gives
    the rows' loads every pipeline stage: a block-table load inside the loop takes one, which
    leaves the rows a single shared-memory buffer, so their loads never overlap the previous
    tile's math. ``NBLK == 0``: nothing is held (``key_blocks`` loads each tile's ids)."""
    if NBLK == 0:
        blocks = table
    else:
        first = lo // BLOCK_SIZE
        b = tl.arange(0, NBLK)
        blocks = tl.load(table + first + b, mask=(first + b) * BLOCK_SIZE < hi, other=0)
    return blocks


@triton.jit
def key_blocks(table, blocks, keys, mask, lo, BLOCK_SIZE: tl.constexpr, NBLK: tl.constexpr):
    """Block ids (int64) of logical positions ``keys`` (at least ``lo``): from the registers of
    :func:`split_blocks` (``blocks``, held from ``lo``; clamped, as keys past the split are masked
    by their caller), or with ``NBLK == 0`` loaded from the row ``table`` where ``mask``."""
    if NBLK == 0:
        block = tl.load(table + keys // BLOCK_SIZE, mask=mask, other=0)
    else:
        block = tl.gather(blocks, tl.minimum(keys // BLOCK_SIZE - lo // BLOCK_SIZE, NBLK - 1), 0)
    return block.to(tl.int64)


@triton.jit
def fdot(a, b, IEEE: tl.constexpr):
    """``a @ b`` accumulated in float32 (``IEEE``: exact float32 products, for float32 inputs)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def e4m3(codes, DTYPE: tl.constexpr):
    """e4m3 bytes as ``DTYPE`` values: float16 directly (exact, one hardware conversion per two
    codes), other types through float32 (a direct e4m3 -> bf16 conversion measured slower on the
    H200)."""
    if DTYPE == tl.float16:
        return codes.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DTYPE)


@triton.jit
def pow2_lane_scales(amax):
    """Per lane, ``(2^k, 2^-k)`` for the ``k`` that puts ``amax`` (the lane's largest magnitude,
    float32) in ``[2^14, 2^15)``. Scaled by ``2^k``, every bf16 value of the lane is a float16
    exactly, but for those below ``2^-28`` of the lane's largest, which round at ``2^-38`` of it.
    Both factors are built from exponent bits and ``k`` is clamped to [-126, 126], so they are
    exact normal floats: a lane whose largest value is below ``2^-112`` (or denormal, or zero) is
    scaled by ``2^126`` only, into [1, 2^14) (its values below ``2^-24`` of its largest round);
    an infinite or NaN lane stays so."""
    exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    k = tl.minimum(tl.maximum(14 - exponent, -126), 126)
    up = ((k + 127) << 23).to(tl.float32, bitcast=True)
    down = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return up, down


@triton.jit
def f16_lanes(x):
    """``x [M, N]`` as float16 dot operands, each lane (row) scaled by :func:`pow2_lane_scales`;
    returns the operands and the per-lane factor that undoes the scaling on their dots."""
    amax = max_along(tl.abs(x.to(tl.float32)), 1)
    up, down = pow2_lane_scales(amax)
    return (x.to(tl.float32) * up[:, None]).to(tl.float16), down


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """Fold one score tile ``s [M, BN]`` (log2 units, -inf masked) into the running max and sum;
    returns (p, alpha: the factor that rescales earlier accumulators, new max, new sum)."""
    m_new = tl.maximum(m_i, max_along(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + sum_along(p, 1)


@triton.jit
def store_result(acc, m_i, l_i, OUT, PART_O, PART_ML, row, head, split, num_splits, num_heads,
                 stride_ot, stride_oh, mask, col0, DV: tl.constexpr, WIDTH: tl.constexpr, DIRECT: tl.constexpr,
                 STORE_ML: tl.constexpr):
    """Columns ``[col0, col0 + DV)`` of the normalised output (``DIRECT``) or of this split's
    partial (acc, and with ``STORE_ML`` the running max and sum)."""
    dv = tl.arange(0, DV)
    if DIRECT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        ptr = OUT + row[:, None] * stride_ot + head[:, None] * stride_oh + col0 + dv[None, :]
        tl.store(ptr, out.to(OUT.dtype.element_ty), mask=mask[:, None])
    else:
        part = (row * num_heads + head) * num_splits + split
        tl.store(PART_O + part[:, None] * WIDTH + col0 + dv[None, :], acc, mask=mask[:, None])
        if STORE_ML:
            tl.store(PART_ML + part * 2, m_i, mask=mask)
            tl.store(PART_ML + part * 2 + 1, l_i, mask=mask)


@triton.jit
def gqa_kernel(
    Q, K, V, TABLES, POSITIONS, TOKEN_TO_REQ, IS_PADDING, TILE_REQ, TILE_ROW0, TILE_NROWS,
    OUT, PART_O, PART_ML, K_SCALE, V_SCALE, qk_scale, num_splits, num_heads,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_table, stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BM: tl.constexpr, M: tl.constexpr, BN: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, SPLIT: tl.constexpr, ROW_MODE: tl.constexpr, FP8: tl.constexpr,
    DIRECT: tl.constexpr, IEEE: tl.constexpr, F16_DOTS: tl.constexpr, NBLK: tl.constexpr,
):
    """Paged GQA attention: ``K``/``V`` caches ``[nb, bs, Hk, D]``; program (tile, kv head, split).

    ``FP8`` caches: the codes enter the dots as they are (per-tensor scales on the scores and the
    output). ``F16_DOTS``: the dots run on float16, the codes converted exactly (one instruction
    per two) and each query lane scaled by a power of two into float16's range
    (:func:`f16_lanes`, undone on its scores); the probabilities meet the values as float16.
    ``NBLK > 0`` (per-row splits): the split's block ids are held in registers
    (:func:`split_blocks`)."""
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    req, row0, nrows = tile_rows(pid, TOKEN_TO_REQ, IS_PADDING, TILE_REQ, TILE_ROW0, TILE_NROWS, ROW_MODE)
    if nrows > 0:
        live, row, head, pos = tile_lanes(row0, nrows, hk, POSITIONS, GROUP, BM, M)
        d = tl.arange(0, D)
        dv = tl.arange(0, DV)
        q = tl.load(Q + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=live[:, None], other=0.0)
        lane_qk = tl.full([M], qk_scale, tl.float32)
        if FP8:
            lane_qk = lane_qk * tl.load(K_SCALE)
        if F16_DOTS:
            q, down = f16_lanes(q)
            lane_qk = lane_qk * down
        lo = split * SPLIT
        hi = tl.minimum(lo + SPLIT, max_along(pos, 0) + 1).to(tl.int32)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.full([M], 0.0, tl.float32)
        acc = tl.full([M, DV], 0.0, tl.float32)
        table = TABLES + req * stride_table
        blocks = split_blocks(table, lo, hi, BLOCK_SIZE, NBLK)
        for start in range(lo, hi, BN):
            j = start + tl.arange(0, BN)
            jm = j < hi
            block = key_blocks(table, blocks, j, jm, lo, BLOCK_SIZE, NBLK)
            off = (j % BLOCK_SIZE).to(tl.int64)
            k = tl.load(K + block[:, None] * stride_kb + off[:, None] * stride_ks + hk * stride_kh + d[None, :],
                        mask=jm[:, None], other=0)
            v = tl.load(V + block[:, None] * stride_vb + off[:, None] * stride_vs + hk * stride_vh + dv[None, :],
                        mask=jm[:, None], other=0)
            if FP8:
                k = e4m3(k, q.dtype)
                v = e4m3(v, q.dtype)
            s = fdot(q, tl.trans(k), IEEE) * lane_qk[:, None]
            s = tl.where((j[None, :] <= pos[:, None]) & jm[None, :], s, float("-inf"))
            p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
            acc = acc * alpha[:, None] + fdot(p.to(v.dtype), v, IEEE)
        if FP8:
            acc = acc * tl.load(V_SCALE)
        store_result(acc, m_i, l_i, OUT, PART_O, PART_ML, row, head, split, num_splits, num_heads,
                     stride_ot, stride_oh, live, 0, DV, DV, DIRECT, True)


@triton.jit
def latent_tile(CACHE, SCALES, base, jm, c: tl.constexpr, L: tl.constexpr, TL: tl.constexpr, DS_MLA: tl.constexpr,
                DTYPE: tl.constexpr):
    """Latent dims ``[c*TL, (c+1)*TL)`` of ``BN`` cache rows (``base``: each row's byte / element
    offset) in ``DTYPE``, and each row's scale of that tile. ``DS_MLA``: e4m3 codes (converted
    as they are) and the tile's float32 scale, read from the row's scale block (``SCALES``: the same
    bytes as float32); plain caches: the values, scale 1."""
    t = tl.arange(0, TL)
    if DS_MLA:
        codes = tl.load(CACHE + base[:, None] + c * TL + t[None, :], mask=jm[:, None], other=0)
        scale = tl.load(SCALES + base // 4 + L // 4 + c, mask=jm, other=0.0)
        return e4m3(codes, DTYPE), scale
    values = tl.load(CACHE + base[:, None] + c * TL + t[None, :], mask=jm[:, None], other=0.0)
    return values.to(DTYPE), tl.full(jm.shape, 1.0, tl.float32)


@triton.jit
def dequantized_latent(CACHE, SCALES, base, jm, L: tl.constexpr, TL: tl.constexpr, DTYPE: tl.constexpr):
    """The ``L`` latent dims of ``BN`` fp8_ds_mla cache rows, each code times its tile's scale, in
    ``DTYPE``: one tile for one scores dot and one values dot (instead of a dot per 128-dim tile,
    the scale applied to the scores and the probabilities)."""
    NT: tl.constexpr = L // TL
    BN: tl.constexpr = base.shape[0]
    d = tl.arange(0, L)
    codes = tl.load(CACHE + base[:, None] + d[None, :], mask=jm[:, None], other=0)
    scale = tl.load(SCALES + (base // 4 + L // 4)[:, None] + tl.arange(0, NT)[None, :], mask=jm[:, None], other=0.0)
    values = tl.reshape(e4m3(codes, tl.float32), [BN, NT, TL]) * scale[:, :, None]
    return tl.reshape(values, [BN, L]).to(DTYPE)


@triton.jit
def latent_scores(q, kv, scale, CACHE, base, jm, c: tl.constexpr, TL: tl.constexpr, DS_MLA: tl.constexpr,
                  IEEE: tl.constexpr, SEPARATE_LOADS: tl.constexpr):
    """``q_tile . kv_tile`` per (query, key), times each key's tile scale. ``SEPARATE_LOADS``
    (fp8_ds_mla): the scores' dot reads tile ``c``'s codes from a load of its own, dims x keys
    (a load that feeds two dots in different layouts, here the scores' and the values', is not
    pipelined by the compiler: each tile's codes were waited for where they are used)."""
    if SEPARATE_LOADS:
        t = tl.arange(0, TL)
        codes = tl.load(CACHE + base[None, :] + c * TL + t[:, None], mask=jm[None, :], other=0)
        s = fdot(q, e4m3(codes, q.dtype), IEEE)
    else:
        s = fdot(q, tl.trans(kv), IEEE)
    if DS_MLA:
        s = s * scale[None, :]
    return s


@triton.jit
def latent_values(acc, alpha, p, kv, scale, DS_MLA: tl.constexpr, IEEE: tl.constexpr):
    """``acc * alpha + p @ (kv * scale)``, the scale folded into ``p`` (per key)."""
    if DS_MLA:
        p = p * scale[None, :]
    return acc * alpha[:, None] + fdot(p.to(kv.dtype), kv, IEEE)


@triton.jit
def mla_kernel(
    Q_LAT, Q_PE, CACHE, SCALES, ROPE, TABLES, POSITIONS, TOKEN_TO_REQ, IS_PADDING, TILE_REQ, TILE_ROW0,
    TILE_NROWS, INDEX, OUT, PART_O, PART_ML, qk_scale, num_splits, num_heads, index_len, table_cols,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_b, stride_s, stride_table, stride_it, stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BM: tl.constexpr, M: tl.constexpr, BN: tl.constexpr,
    L: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, SPLIT: tl.constexpr, ROW_MODE: tl.constexpr,
    DS_MLA: tl.constexpr, SPARSE: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr, NBLK: tl.constexpr,
    SEPARATE_LOADS: tl.constexpr, DEQUANT: tl.constexpr = False,
):
    """MLA attention in the latent space over a paged latent cache; program (tile, head block, split).

    Dense: keys are the positions ``<= positions[row]``. ``SPARSE`` (``BM == 1``): keys are the
    logical positions ``INDEX[row, :index_len]``, ``-1`` marking an unused pick.
    Output ``[T, H, L]``: ``softmax(q_lat . kv_c + q_pe . k_pe) @ kv_c``.

    The latent dims are processed in ``NT`` tiles of ``TL = min(L, 128)`` (the fp8_ds_mla
    quantisation tiles; at most 4): fp8 codes enter the dots as they are, their tile scale
    multiplies the scores and the probabilities instead of every value.
    ``DS_MLA`` rows: ``L`` e4m3 codes, ``L/128`` float32 scales, ``R`` bf16 RoPE values
    (``SCALES`` / ``ROPE``: the same bytes as float32 / bf16; strides in bytes).
    ``NBLK > 0`` (per-row splits): block ids come from registers (:func:`split_blocks`); sparse
    rows hold their whole block-table row (``table_cols`` entries) and their split's picks there.
    ``DEQUANT`` (fp8_ds_mla): each key tile's codes are dequantised whole, times their scales, into
    one tile of the query's dtype (:func:`dequantized_latent`), so the scores are one latent dot and
    the values one dot, where per 128-dim tile they are a dot each (on Hopper every dot is waited
    for before the next starts).
    """
    TL: tl.constexpr = L if L < 128 else 128
    NT: tl.constexpr = L // TL
    pid = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    req, row0, nrows = tile_rows(pid, TOKEN_TO_REQ, IS_PADDING, TILE_REQ, TILE_ROW0, TILE_NROWS, ROW_MODE)
    if nrows > 0:
        live, row, head, pos = tile_lanes(row0, nrows, hb, POSITIONS, GROUP, BM, M)
        t = tl.arange(0, TL)
        rot = tl.arange(0, RP)
        q_at = Q_LAT + row[:, None] * stride_qt + head[:, None] * stride_qh + t[None, :]
        q0 = tl.load(q_at, mask=live[:, None], other=0.0)
        acc0 = tl.full([M, TL], 0.0, tl.float32)
        if NT > 1:
            q1 = tl.load(q_at + TL, mask=live[:, None], other=0.0)
            acc1 = tl.full([M, TL], 0.0, tl.float32)
        if NT > 2:
            q2 = tl.load(q_at + 2 * TL, mask=live[:, None], other=0.0)
            q3 = tl.load(q_at + 3 * TL, mask=live[:, None], other=0.0)
            acc2 = tl.full([M, TL], 0.0, tl.float32)
            acc3 = tl.full([M, TL], 0.0, tl.float32)
        if DEQUANT:
            q_lat = tl.load(Q_LAT + row[:, None] * stride_qt + head[:, None] * stride_qh + tl.arange(0, L)[None, :],
                            mask=live[:, None], other=0.0)
            acc = tl.full([M, L], 0.0, tl.float32)
        q_pe = tl.load(Q_PE + row[:, None] * stride_pt + head[:, None] * stride_ph + rot[None, :],
                       mask=live[:, None] & (rot < R)[None, :], other=0.0)
        lo = split * SPLIT
        if SPARSE:
            hi = tl.minimum(lo + SPLIT, index_len).to(tl.int32)
        else:
            hi = tl.minimum(lo + SPLIT, max_along(pos, 0) + 1).to(tl.int32)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.full([M], 0.0, tl.float32)
        table = TABLES + req * stride_table
        if SPARSE:  # picks anywhere in the row: its whole table
            blocks = split_blocks(table, 0, table_cols * BLOCK_SIZE, BLOCK_SIZE, NBLK)
            if NBLK > 0:
                nth = tl.arange(0, SPLIT)
                picks = tl.load(INDEX + row0 * stride_it + lo + nth, mask=lo + nth < hi, other=-1)
        else:
            blocks = split_blocks(table, lo, hi, BLOCK_SIZE, NBLK)
        for start in range(lo, hi, BN):
            j = start + tl.arange(0, BN)
            jm = j < hi
            if SPARSE:
                if NBLK > 0:
                    key = tl.where(jm, tl.gather(picks, tl.minimum(j - lo, SPLIT - 1), 0), -1)
                else:
                    key = tl.load(INDEX + row0 * stride_it + j, mask=jm, other=-1)
                jm = jm & (key >= 0)
                visible = jm[None, :] & live[:, None]
            else:
                key = j
                visible = (j[None, :] <= pos[:, None]) & jm[None, :]
            safe_key = tl.where(jm, key, 0)
            if SPARSE:
                block = key_blocks(table, blocks, safe_key, jm, 0, BLOCK_SIZE, NBLK)
            else:
                block = key_blocks(table, blocks, j, jm, lo, BLOCK_SIZE, NBLK)
            base = block * stride_b + (safe_key % BLOCK_SIZE).to(tl.int64) * stride_s
            if DEQUANT:
                kv = dequantized_latent(CACHE, SCALES, base, jm, L, TL, q0.dtype)
                s = fdot(q_lat, tl.trans(kv), IEEE)
            else:
                kv0, sc0 = latent_tile(CACHE, SCALES, base, jm, 0, L, TL, DS_MLA, q0.dtype)
                s = latent_scores(q0, kv0, sc0, CACHE, base, jm, 0, TL, DS_MLA, IEEE, SEPARATE_LOADS)
                if NT > 1:
                    kv1, sc1 = latent_tile(CACHE, SCALES, base, jm, 1, L, TL, DS_MLA, q0.dtype)
                    s += latent_scores(q1, kv1, sc1, CACHE, base, jm, 1, TL, DS_MLA, IEEE, SEPARATE_LOADS)
                if NT > 2:
                    kv2, sc2 = latent_tile(CACHE, SCALES, base, jm, 2, L, TL, DS_MLA, q0.dtype)
                    kv3, sc3 = latent_tile(CACHE, SCALES, base, jm, 3, L, TL, DS_MLA, q0.dtype)
                    s += latent_scores(q2, kv2, sc2, CACHE, base, jm, 2, TL, DS_MLA, IEEE, SEPARATE_LOADS)
                    s += latent_scores(q3, kv3, sc3, CACHE, base, jm, 3, TL, DS_MLA, IEEE, SEPARATE_LOADS)
            if DS_MLA:
                pe_at = ROPE + (base // 2)[:, None] + ((L + 4 * NT) // 2 + rot)[None, :]
            else:
                pe_at = CACHE + base[:, None] + L + rot[None, :]
            pe = tl.load(pe_at, mask=jm[:, None] & (rot < R)[None, :], other=0.0).to(q0.dtype)
            s = (s + fdot(q_pe, tl.trans(pe), IEEE)) * qk_scale
            s = tl.where(visible, s, float("-inf"))
            p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
            if DEQUANT:
                acc = acc * alpha[:, None] + fdot(p.to(kv.dtype), kv, IEEE)
            else:
                acc0 = latent_values(acc0, alpha, p, kv0, sc0, DS_MLA, IEEE)
                if NT > 1:
                    acc1 = latent_values(acc1, alpha, p, kv1, sc1, DS_MLA, IEEE)
                if NT > 2:
                    acc2 = latent_values(acc2, alpha, p, kv2, sc2, DS_MLA, IEEE)
                    acc3 = latent_values(acc3, alpha, p, kv3, sc3, DS_MLA, IEEE)
        if DEQUANT:
            store_result(acc, m_i, l_i, OUT, PART_O, PART_ML, row, head, split, num_splits, num_heads,
                         stride_ot, stride_oh, live, 0, L, L, DIRECT, True)
        else:
            store_result(acc0, m_i, l_i, OUT, PART_O, PART_ML, row, head, split, num_splits, num_heads,
                         stride_ot, stride_oh, live, 0, TL, L, DIRECT, True)
            if NT > 1:
                store_result(acc1, m_i, l_i, OUT, PART_O, PART_ML, row, head, split, num_splits, num_heads,
                             stride_ot, stride_oh, live, TL, TL, L, DIRECT, False)
            if NT > 2:
                store_result(acc2, m_i, l_i, OUT, PART_O, PART_ML, row, head, split, num_splits, num_heads,
                             stride_ot, stride_oh, live, 2 * TL, TL, L, DIRECT, False)
                store_result(acc3, m_i, l_i, OUT, PART_O, PART_ML, row, head, split, num_splits, num_heads,
                             stride_ot, stride_oh, live, 3 * TL, TL, L, DIRECT, False)


@triton.jit
def combine_kernel(PART_O, PART_ML, IS_PADDING, OUT, num_splits, num_heads, stride_ot, stride_oh,
                   DV: tl.constexpr, SP: tl.constexpr):
    """Merge the splits of (row, head): ``sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``;
    padding rows (and rows that saw no key) get zeros."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dv = tl.arange(0, DV)
    s = tl.arange(0, SP)
    sm = s < num_splits
    part = (row * num_heads + head) * num_splits + s
    pad = tl.load(IS_PADDING + row)
    m_s = tl.load(PART_ML + part * 2, mask=sm & (pad == 0), other=float("-inf"))
    l_s = tl.load(PART_ML + part * 2 + 1, mask=sm & (pad == 0), other=0.0)
    m_max = max_along(m_s, 0)
    w = tl.exp2(m_s - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = sum_along(w * l_s, 0)
    acc = tl.load(PART_O + part[:, None] * DV + dv[None, :], mask=(sm & (pad == 0))[:, None], other=0.0)
    out = sum_along(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + row * stride_ot + head * stride_oh + dv, out.to(OUT.dtype.element_ty))


@triton.jit
def indexer_kernel(
    Q, WEIGHTS, CACHE, SCALES, TABLES, POSITIONS, TOKEN_TO_REQ, IS_PADDING, SCORES, span,
    stride_qt, stride_qh, stride_wt, stride_b, stride_table, stride_st,
    BLOCK_SIZE: tl.constexpr, HI: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, QBS: tl.constexpr,
    BN: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr, Q_FP8: tl.constexpr, NBLK: tl.constexpr,
):
    """Lightning-indexer scores of one row over one ``CHUNK`` of its positions (program (row, chunk)):
    ``sum_h w[h] * relu(q[h] . k)`` with ``k`` = e4m3 codes * block scales read from the
    block-split cache ``[nb, bs * (D + 4 * D / QBS)]`` (codes of all tokens, then their float32
    scales; ``SCALES`` is the same bytes as float32). Only visible positions are written; the
    launcher fills the rest with -inf. ``Q_FP8`` (one scale per token, as DeepSeek-V3.2 runs it):
    ``Q`` holds e4m3 codes, each head's scale already folded into its weight, and the dot runs on
    the fp8 codes of both sides (accumulated in float32), no conversion, as keys x heads: the
    weighted sum over heads runs along the accumulator's rows (within a thread and its quad)
    instead of across warps (heads x keys measured slower at every launch shape). ``NBLK > 0``:
    the chunk's block ids are held in registers (:func:`split_blocks`)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if tl.load(IS_PADDING + row) == 0:
        req = tl.load(TOKEN_TO_REQ + row)
        pos = tl.load(POSITIONS + row)
        h = tl.arange(0, HP)  # heads padded to a tl.dot size; padded heads weigh 0
        d = tl.arange(0, D)
        q = tl.load(Q + row * stride_qt + h[:, None] * stride_qh + d[None, :], mask=(h < HI)[:, None], other=0.0)
        w = tl.load(WEIGHTS + row * stride_wt + h, mask=h < HI, other=0.0).to(tl.float32)
        table = TABLES + req * stride_table
        lo = chunk * CHUNK
        hi = tl.minimum(tl.minimum(lo + CHUNK, pos + 1), span).to(tl.int32)
        NQ: tl.constexpr = D // QBS
        blocks = split_blocks(table, lo, hi, BLOCK_SIZE, NBLK)
        for start in range(lo, hi, BN):
            j = start + tl.arange(0, BN)
            jm = j < hi
            block = key_blocks(table, blocks, j, jm, lo, BLOCK_SIZE, NBLK)
            off = (j % BLOCK_SIZE).to(tl.int64)
            codes = tl.load(CACHE + block[:, None] * stride_b + off[:, None] * D + d[None, :], mask=jm[:, None], other=0)
            scale_at = (block * stride_b + BLOCK_SIZE * D) // 4 + off * NQ
            if Q_FP8:
                keys = codes.to(tl.float8e4nv, bitcast=True)
                st = tl.dot(keys, tl.trans(q.to(tl.float8e4nv, bitcast=True)))
                score = sum_along(tl.maximum(st, 0.0) * w[None, :], 1)
                score = score * tl.load(SCALES + scale_at, mask=jm, other=0.0)
            else:
                if NQ == 1:  # one scale per token (DeepSeek: D = QBS = 128): on the scores
                    s = fdot(q, tl.trans(e4m3(codes, q.dtype)), IEEE)
                    s = s * tl.load(SCALES + scale_at, mask=jm, other=0.0)[None, :]
                else:
                    scale = tl.load(SCALES + scale_at[:, None] + (d // QBS)[None, :], mask=jm[:, None], other=0.0)
                    k = (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(q.dtype)
                    s = fdot(q, tl.trans(k), IEEE)
                s = tl.maximum(s, 0.0)
                score = sum_along(s * w[:, None], 0)
            tl.store(SCORES + row * stride_st + j, score, mask=jm)
