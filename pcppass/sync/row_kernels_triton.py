"""Triton kernels of :mod:`pcppass.sync.row_kernels` (imported there on first use, once per
Triton mode: ``triton.jit`` decides between compiling and interpreting when it decorates).

Tile kernels (``pack_kernel``, ``scatter_kernel``, ``peer_kernel``) run one program per tile: a
range of ``BLOCK`` words of one table entry, a word being ``width`` bytes (16, 8, 4, 2 or 1: the
widest that every address of the entry allows, chosen on the host). A word ``w`` of an entry is
byte ``(w % wpr) * width`` of row ``w // wpr``, so one program moves many rows, and a 16-byte word
is one vector load and one vector store per lane. Every address is taken relative to an aligned
pointer argument (``anchor``) so the compiler can prove the alignment and emit 16-byte accesses.

Entry fields (int64; ``row_kernels.Entry`` builds them):

====  ============  ==========================================================================
 0    kind          0: rows of a cache at slots; 1: bytes of argument tensor ``x[arg]``;
                    2: bytes at an absolute address (a cached header)
 1    cache         cache address + the segment's base (kind 0); source address (kind 2)
 2    rows          rows of this entry (kinds 1 and 2: one)
 3    buf           byte offset in the packed buffer / mailbox chunk of row 0 of this piece
 4    slot          kind 0: index of the first slot in ``x[arg]`` (pack, peer) or byte offset of
                    the slots in the gathered buffer (scatter); kind 1: byte offset in ``x[arg]``
 5    bpr           bytes per packed row (the buffer's row stride)
 6    block_size
 7    block_stride  bytes
 8    slot_stride   bytes between two slots of one block, in this segment
 9    num_slots     valid slots are ``[0, num_slots)``
10    wpr           words per row
11    width         bytes per word
12    arg           argument index (pack, peer) / alignment of the slots in the buffer (scatter)
13    label         site label id for error reports (``pcppass.sync.device_checks``)
14    check         scatter: index of row 0's check flag (-1: no checks)
15    rank          scatter: the rank that sent the rows
16    segment       the slot segment the rows' slots come from (check_kernel zeroes by it)
17..  deltas        peer: byte distance from this rank's address to each rank's replica
====  ============  ==========================================================================

Status words (an int64 array, host-mapped on CUDA so the host reads it without a sync) are
written with plain stores, never read back on the device; see ``pcppass.sync.device_checks``.
"""

import triton
import triton.language as tl

from pcppass.sync import device_checks as status_words
from pcppass.sync import mailbox

F_KIND = tl.constexpr(0)
F_CACHE = tl.constexpr(1)
F_ROWS = tl.constexpr(2)
F_BUF = tl.constexpr(3)
F_SLOT = tl.constexpr(4)
F_BPR = tl.constexpr(5)
F_BS = tl.constexpr(6)
F_BSTRIDE = tl.constexpr(7)
F_SSTRIDE = tl.constexpr(8)
F_NSLOTS = tl.constexpr(9)
F_WPR = tl.constexpr(10)
F_WIDTH = tl.constexpr(11)
F_ARG = tl.constexpr(12)
F_LABEL = tl.constexpr(13)
F_CHECK = tl.constexpr(14)
F_RANK = tl.constexpr(15)
F_SEGMENT = tl.constexpr(16)
F_DELTAS = tl.constexpr(17)

S_HEADER = tl.constexpr(status_words.HEADER)
S_RANGE = tl.constexpr(status_words.RANGE)
S_RANGE_SLOT = tl.constexpr(status_words.RANGE_SLOT)
S_RANGE_RANK = tl.constexpr(status_words.RANGE_RANK)
S_CONFLICT = tl.constexpr(status_words.CONFLICT)
S_CONFLICT_SLOT = tl.constexpr(status_words.CONFLICT_SLOT)
S_CONFLICT_RANK = tl.constexpr(status_words.CONFLICT_RANK)
S_TIMEOUT = tl.constexpr(status_words.TIMEOUT)
S_EPOCH = tl.constexpr(status_words.EPOCH)
S_INPUT = tl.constexpr(status_words.INPUT)
S_INPUT_VALUE = tl.constexpr(status_words.INPUT_VALUE)
S_OUT_OF_STEP = tl.constexpr(status_words.OUT_OF_STEP)

#: a row's check flag: 0 apply it, 1 its slot has two owners, 2 the headers differ
CONFLICT = tl.constexpr(1)
HEADERS_DIFFER = tl.constexpr(2)
#: bytes before the data of a mailbox: one int64 epoch flag per rank (written by that rank)
MAILBOX_FLAGS = tl.constexpr(mailbox.MAILBOX_FLAGS)
MOST_NEGATIVE = tl.constexpr(-9223372036854775807)


# ---------------------------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------------------------


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _largest(x, axis):
    """``tl.max`` through ``tl.reduce``: the kernels use no ``@jit`` helper of triton.language,
    whose mode (compiled or interpreted) is fixed when triton.language is first imported (under
    ``TRITON_INTERPRET=1`` set later, as the tests do, calling one fails)."""
    return tl.reduce(x, axis, _max2)


# ---------------------------------------------------------------------------------------------
# Words
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_words(anchor, src, mask, W: tl.constexpr):
    """``[BLOCK, max(W // 4, 1)]`` words at absolute byte addresses ``src`` (W-aligned)."""
    a = anchor.to(tl.int64)
    if W >= 4:
        base = anchor.to(tl.pointer_type(tl.int32), bitcast=True)
        s = tl.multiple_of((src - a) // 4, W // 4)
        return tl.load(base + s[:, None] + tl.arange(0, W // 4)[None, :], mask=mask[:, None], other=0)
    elif W == 2:
        base = anchor.to(tl.pointer_type(tl.int16), bitcast=True)
        return tl.load(base + ((src - a) // 2)[:, None] + tl.arange(0, 1)[None, :], mask=mask[:, None], other=0)
    else:
        base = anchor.to(tl.pointer_type(tl.uint8), bitcast=True)
        return tl.load(base + (src - a)[:, None] + tl.arange(0, 1)[None, :], mask=mask[:, None], other=0)


@triton.jit
def _store_words(anchor, dst, v, mask, W: tl.constexpr):
    a = anchor.to(tl.int64)
    if W >= 4:
        base = anchor.to(tl.pointer_type(tl.int32), bitcast=True)
        d = tl.multiple_of((dst - a) // 4, W // 4)
        tl.store(base + d[:, None] + tl.arange(0, W // 4)[None, :], v, mask=mask[:, None])
    elif W == 2:
        base = anchor.to(tl.pointer_type(tl.int16), bitcast=True)
        tl.store(base + ((dst - a) // 2)[:, None] + tl.arange(0, 1)[None, :], v, mask=mask[:, None])
    else:
        base = anchor.to(tl.pointer_type(tl.uint8), bitcast=True)
        tl.store(base + (dst - a)[:, None] + tl.arange(0, 1)[None, :], v, mask=mask[:, None])


@triton.jit
def _move(anchor, src, dst, load_mask, store_mask, W: tl.constexpr):
    """Copy a word per lane; lanes in ``store_mask`` but not ``load_mask`` write zeros."""
    _store_words(anchor, dst, _load_words(anchor, src, load_mask, W), store_mask, W)


@triton.jit
def _zero(anchor, dst, mask, W: tl.constexpr):
    if W >= 4:
        _store_words(anchor, dst, tl.full((dst.shape[0], W // 4), 0, tl.int32), mask, W)
    elif W == 2:
        _store_words(anchor, dst, tl.full((dst.shape[0], 1), 0, tl.int16), mask, W)
    else:
        _store_words(anchor, dst, tl.full((dst.shape[0], 1), 0, tl.uint8), mask, W)


@triton.jit
def _slot_at(anchor, addr, mask, align):
    """int64 slots at absolute byte addresses ``addr`` (-1 off ``mask``); ``align``: the addresses'
    alignment (a scalar: they differ by multiples of 8). Two 4-byte loads when 4-aligned, else
    eight byte loads, chosen by masks (no branch: its two results could get different layouts)."""
    a = anchor.to(tl.int64)
    wide = align % 4 == 0
    words = anchor.to(tl.pointer_type(tl.int32), bitcast=True) + (addr - a) // 4
    lo = tl.load(words, mask=mask & wide, other=0).to(tl.int64) & 0xFFFFFFFF
    hi = tl.load(words + 1, mask=mask & wide, other=0).to(tl.int64)
    byte_slot = tl.full(addr.shape, 0, tl.int64)
    bytes_ = anchor.to(tl.pointer_type(tl.uint8), bitcast=True) + (addr - a)
    for k in tl.static_range(8):
        byte = tl.load(bytes_ + k, mask=mask & ~wide, other=0).to(tl.int64)
        byte_slot = byte_slot | (byte << (8 * k))
    return tl.where(mask, tl.where(wide, lo | (hi << 32), byte_slot), -1)


@triton.jit
def _arg(k, x0, x1, x2, x3, x4, x5, x6, x7):
    p = x0
    if k == 1:
        p = x1
    elif k == 2:
        p = x2
    elif k == 3:
        p = x3
    elif k == 4:
        p = x4
    elif k == 5:
        p = x5
    elif k == 6:
        p = x6
    elif k == 7:
        p = x7
    return p


@triton.jit
def _cache_address(entry, slot, col, W: tl.constexpr):
    """Byte address of word ``col`` of the row at ``slot`` (a valid slot: below 2**31, so the
    block arithmetic runs in 32 bits; a 64-bit division costs a hundred instructions a lane)."""
    bs = tl.load(entry + F_BS).to(tl.int32)
    s = slot.to(tl.int32)
    block = s // bs
    return (tl.load(entry + F_CACHE) + block.to(tl.int64) * tl.load(entry + F_BSTRIDE)
            + (s - block * bs).to(tl.int64) * tl.load(entry + F_SSTRIDE) + col.to(tl.int64) * W)


@triton.jit
def _words(entry, first, BLOCK: tl.constexpr):
    """Row, column (int32) and liveness of the ``BLOCK`` words of a tile starting at word ``first``."""
    wpr = tl.load(entry + F_WPR).to(tl.int32)
    w = first.to(tl.int32) + tl.arange(0, BLOCK)
    live = w < tl.load(entry + F_ROWS).to(tl.int32) * wpr
    row = w // wpr
    return row, w - row * wpr, live


@triton.jit
def _report_range(status, bad, slot, entry, rank):
    """Record an out-of-range slot (``slot < -1`` or ``>= num_slots``) of this entry."""
    if _largest(bad.to(tl.int32), axis=0) > 0:
        tl.store(status + S_RANGE_SLOT, _largest(tl.where(bad, slot, MOST_NEGATIVE), axis=0))
        tl.store(status + S_RANGE_RANK, rank)
        tl.store(status + S_RANGE, tl.load(entry + F_LABEL) + 1)


@triton.jit
def _checked_slots(entry, slot, live, status, rank):
    """(valid lanes, slots clamped to 0 elsewhere); out-of-range slots are reported and dropped."""
    num_slots = tl.load(entry + F_NSLOTS)
    valid = live & (slot >= 0) & (slot < num_slots)
    _report_range(status, live & ((slot < -1) | (slot >= num_slots)), slot, entry, rank)
    return valid, tl.where(valid, slot, 0)


# ---------------------------------------------------------------------------------------------
# Pack: caches' rows at this rank's slots, header and payloads -> one buffer
# ---------------------------------------------------------------------------------------------


@triton.jit
def _pack_tile(entry, first, out, anchor, x0, x1, x2, x3, x4, x5, x6, x7, status, me,
               W: tl.constexpr, BLOCK: tl.constexpr):
    row, col, live = _words(entry, first, BLOCK)
    dst = out.to(tl.int64) + tl.load(entry + F_BUF) + row.to(tl.int64) * tl.load(entry + F_BPR) + col * W
    kind = tl.load(entry + F_KIND)
    x = _arg(tl.load(entry + F_ARG), x0, x1, x2, x3, x4, x5, x6, x7)
    if kind == 0:
        slots = x.to(tl.pointer_type(tl.int64), bitcast=True) + tl.load(entry + F_SLOT)
        slot = tl.load(slots + row, mask=live, other=-1)
        valid, safe = _checked_slots(entry, slot, live, status, me)
        _move(anchor, _cache_address(entry, safe, col, W), dst, valid, live, W)
    elif kind == 1:
        _move(anchor, x.to(tl.int64) + tl.load(entry + F_SLOT) + col.to(tl.int64) * W, dst, live, live, W)
    else:
        _move(anchor, tl.load(entry + F_CACHE) + col.to(tl.int64) * W, dst, live, live, W)


@triton.jit
def pack_kernel(out, table, tiles, x0, x1, x2, x3, x4, x5, x6, x7, status, me,
                ENTRY: tl.constexpr, BLOCK: tl.constexpr):
    """Program t: tile ``tiles[t] = (entry, first word)``; padding rows (slot -1) pack zeros."""
    t = tl.program_id(0)
    entry = table + tl.load(tiles + 2 * t) * ENTRY
    first = tl.load(tiles + 2 * t + 1)
    width = tl.load(entry + F_WIDTH)
    if width == 16:
        _pack_tile(entry, first, out, table, x0, x1, x2, x3, x4, x5, x6, x7, status, me, 16, BLOCK)
    elif width == 8:
        _pack_tile(entry, first, out, table, x0, x1, x2, x3, x4, x5, x6, x7, status, me, 8, BLOCK)
    elif width == 4:
        _pack_tile(entry, first, out, table, x0, x1, x2, x3, x4, x5, x6, x7, status, me, 4, BLOCK)
    elif width == 2:
        _pack_tile(entry, first, out, table, x0, x1, x2, x3, x4, x5, x6, x7, status, me, 2, BLOCK)
    else:
        _pack_tile(entry, first, out, table, x0, x1, x2, x3, x4, x5, x6, x7, status, me, 1, BLOCK)


# ---------------------------------------------------------------------------------------------
# Checks of a gathered buffer: headers and cross-rank slot conflicts
# ---------------------------------------------------------------------------------------------


@triton.jit
def _headers_differ(base, stride, me, world, head_len, BLOCK: tl.constexpr):
    """The first rank whose header bytes (rank r's chunk at ``base + r * stride``) differ from
    this rank's, -1 if none. Every rank's header is loaded at once (independent loads)."""
    found = -1
    mine_at = (base + me * stride).to(tl.pointer_type(tl.uint8))
    for r in range(world):
        theirs_at = (base + r * stride).to(tl.pointer_type(tl.uint8))
        for h in range(0, head_len, BLOCK):
            o = h + tl.arange(0, BLOCK)
            m = o < head_len
            differ = tl.load(theirs_at + o, mask=m, other=0) != tl.load(mine_at + o, mask=m, other=0)
            if (found < 0) & (_largest(differ.to(tl.int32), axis=0) > 0):
                found = r
    return found


@triton.jit
def _conflicting_rows(anchor, mine, mi, theirs_at, align, rank, world, stride, n, BLOCK_K: tl.constexpr):
    """Per row of ``mine`` (this rank ``rank``'s slots), 1 when another rank holds the same slot
    (>= 0) among the ``n`` slots of a segment whose rank-0 copy starts at ``theirs_at`` (rank r's
    at ``theirs_at + r * stride``)."""
    hit = tl.full(mine.shape, 0, tl.int32)
    for other in range(world):
        if other != rank:
            for k0 in range(0, n, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                mk = k < n
                theirs = _slot_at(anchor, theirs_at + other * stride + 8 * k.to(tl.int64), mk, align)
                eq = (mine[:, None] == theirs[None, :]) & mk[None, :] & (mine[:, None] >= 0)
                hit = hit | _largest(eq.to(tl.int32), axis=1)
    return hit & mi.to(tl.int32)


@triton.jit
def _zero_rows(table, num_entries, anchor, segment, slot, rows, ENTRY: tl.constexpr, BLOCK_C: tl.constexpr):
    """Zero, in this rank's caches, the rows at ``slot`` where ``rows``: every table entry of
    rows whose slots come from ``segment`` (several entries per cache are harmless: zeros)."""
    base = anchor.to(tl.pointer_type(tl.uint8), bitcast=True)
    for e in range(num_entries):
        entry = table + e * ENTRY
        if (tl.load(entry + F_KIND) == 0) & (tl.load(entry + F_SEGMENT) == segment):
            valid = rows & (slot >= 0) & (slot < tl.load(entry + F_NSLOTS))
            at = _cache_address(entry, tl.where(valid, slot, 0), tl.full(slot.shape, 0, tl.int32), 1)
            length = tl.load(entry + F_WPR) * tl.load(entry + F_WIDTH)
            for c0 in range(0, length, BLOCK_C):
                c = c0 + tl.arange(0, BLOCK_C)
                dst = at[:, None] + c[None, :]
                tl.store(base + (dst - anchor.to(tl.int64)), tl.full(dst.shape, 0, tl.uint8),
                         mask=valid[:, None] & (c < length)[None, :])


@triton.jit
def check_kernel(anchor, base_offset, stride, half, counters, segs, num_segs, flags, verdict, table, num_entries,
                 status, me, world, head_len, conflicts, zero, chunks_per_rank,
                 ENTRY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """After an exchange, on every rank: headers equal, slots in range, one owner per row.

    Rank r's chunk (header, then segments) lies at ``anchor + base_offset + r * stride`` (the
    gathered buffer), or, with ``half`` > 0, in the mailbox half of the last sync (``counters[0] %
    2``). Program (j, q): slot segment ``segs[j] = (rows, label, flag index of rank 0's row 0,
    byte offset of the slots in a chunk, alignment, group, slots of its cache or -1)``, rows
    ``BLOCK_N * (q % chunks_per_rank)...`` of rank ``q // chunks_per_rank``. Each row's flag: 2
    when any rank's header differs from this rank's (nothing may be read by offset), else 1 when
    another rank holds its slot in any segment of the same group (one cache written by several
    sites), with ``conflicts``; with ``zero`` that slot is zeroed in this rank's caches here, on
    every rank alike (peer stores, whose rows are already in every replica). ``verdict[0]`` (zeroed
    by the caller) becomes 1 when anything is found: the headers differ, a slot is outside its
    cache (where its slot count is given), or a row has two owners."""
    j = tl.program_id(0)
    q = tl.program_id(1)
    r = q // chunks_per_rank
    i = (q % chunks_per_rank) * BLOCK_N + tl.arange(0, BLOCK_N)
    seg = segs + 7 * j
    n = tl.load(seg).to(tl.int32)
    base = anchor.to(tl.int64) + base_offset + (tl.load(counters) % 2) * half
    differs = _headers_differ(base, stride, me, world, head_len, BLOCK_H)
    if (j == 0) & (q == 0) & (differs >= 0):
        tl.store(verdict, 1)
        tl.store(status + S_HEADER, differs + 1)
    mi = i < n
    flag_at = flags + tl.load(seg + 2) + r * n + i
    if differs >= 0:
        tl.store(flag_at, HEADERS_DIFFER, mask=mi)
    else:
        align = tl.load(seg + 4)
        slot = _slot_at(anchor, base + tl.load(seg + 3) + r * stride + 8 * i.to(tl.int64), mi, align)
        limit = tl.load(seg + 6)
        outside = mi & (limit >= 0) & ((slot < -1) | (slot >= limit))
        if _largest(outside.to(tl.int32), axis=0) > 0:
            tl.store(verdict, 1)
            tl.store(status + S_RANGE_SLOT, _largest(tl.where(outside, slot, MOST_NEGATIVE), axis=0))
            tl.store(status + S_RANGE_RANK, r)
            tl.store(status + S_RANGE, tl.load(seg + 1) + 1)
        hit = tl.full(i.shape, 0, tl.int32)
        if conflicts != 0:
            group = tl.load(seg + 5)
            for k in range(num_segs):
                other = segs + 7 * k
                if tl.load(other + 5) == group:
                    hit = hit | _conflicting_rows(anchor, slot, mi, base + tl.load(other + 3), tl.load(other + 4),
                                                  r, world, stride, tl.load(other).to(tl.int32), BLOCK_K)
        tl.store(flag_at, hit.to(tl.uint8), mask=mi)
        if _largest(hit, axis=0) > 0:
            tl.store(verdict, 1)
            tl.store(status + S_CONFLICT_SLOT, _largest(tl.where(hit > 0, slot, MOST_NEGATIVE), axis=0))
            tl.store(status + S_CONFLICT_RANK, r)
            tl.store(status + S_CONFLICT, tl.load(seg + 1) + 1)
            if zero != 0:
                _zero_rows(table, num_entries, anchor, j, slot, hit > 0, ENTRY, 64)


# ---------------------------------------------------------------------------------------------
# Scatter: the other ranks' rows from the gathered buffer into this rank's caches
# ---------------------------------------------------------------------------------------------


@triton.jit
def _scatter_tile(entry, first, buf, anchor, flags, status, apply_all, W: tl.constexpr, BLOCK: tl.constexpr):
    row, col, live = _words(entry, first, BLOCK)
    slot_addr = buf.to(tl.int64) + tl.load(entry + F_SLOT) + row.to(tl.int64) * 8
    slot = _slot_at(anchor, slot_addr, live, tl.load(entry + F_ARG))
    valid, safe = _checked_slots(entry, slot, live, status, tl.load(entry + F_RANK))
    flag_at = tl.load(entry + F_CHECK)
    skip = tl.load(flags + flag_at + row, mask=live & (flag_at >= 0), other=0) != 0
    src = buf.to(tl.int64) + tl.load(entry + F_BUF) + row.to(tl.int64) * tl.load(entry + F_BPR) + col * W
    apply = valid & ~skip & apply_all
    _move(anchor, src, _cache_address(entry, safe, col, W), apply, apply, W)


@triton.jit
def scatter_kernel(buf, table, tiles, flags, verdict, when_refused, status, ENTRY: tl.constexpr, BLOCK: tl.constexpr):
    """Program t: tile ``tiles[t] = (entry, first word)`` of rows from ``buf`` (rows another rank
    sent; with ``when_refused``, this rank's snapshot of its own rows); rows whose check flag is
    set (two owners, headers differ) are skipped. The whole table applies only when the step's
    verdict (``verdict[0]`` != 0: refused) equals ``when_refused``."""
    t = tl.program_id(0)
    entry = table + tl.load(tiles + 2 * t) * ENTRY
    first = tl.load(tiles + 2 * t + 1)
    apply_all = (tl.load(verdict) != 0) == (when_refused != 0)
    width = tl.load(entry + F_WIDTH)
    if width == 16:
        _scatter_tile(entry, first, buf, table, flags, status, apply_all, 16, BLOCK)
    elif width == 8:
        _scatter_tile(entry, first, buf, table, flags, status, apply_all, 8, BLOCK)
    elif width == 4:
        _scatter_tile(entry, first, buf, table, flags, status, apply_all, 4, BLOCK)
    elif width == 2:
        _scatter_tile(entry, first, buf, table, flags, status, apply_all, 2, BLOCK)
    else:
        _scatter_tile(entry, first, buf, table, flags, status, apply_all, 1, BLOCK)


# ---------------------------------------------------------------------------------------------
# Slot inputs: range checks on the device
# ---------------------------------------------------------------------------------------------


@triton.jit
def _slots_of(x, code, i, mask, other):
    """int64 slots ``i`` of argument tensor ``x`` (bytes) holding integers of dtype ``code``
    (``device_checks.SLOT_DTYPE_CODES``: int64, int32, int16, int8, uint8)."""
    s = tl.load(x.to(tl.pointer_type(tl.int64), bitcast=True) + i, mask=mask & (code == 0), other=other)
    s32 = tl.load(x.to(tl.pointer_type(tl.int32), bitcast=True) + i, mask=mask & (code == 1), other=0)
    s16 = tl.load(x.to(tl.pointer_type(tl.int16), bitcast=True) + i, mask=mask & (code == 2), other=0)
    s8 = tl.load(x.to(tl.pointer_type(tl.int8), bitcast=True) + i, mask=mask & (code == 3), other=0)
    u8 = tl.load(x.to(tl.pointer_type(tl.uint8), bitcast=True) + i, mask=mask & (code == 4), other=0)
    s = tl.where(code == 1, s32.to(tl.int64), s)
    s = tl.where(code == 2, s16.to(tl.int64), s)
    s = tl.where(code == 3, s8.to(tl.int64), s)
    s = tl.where(code == 4, u8.to(tl.int64), s)
    return tl.where(mask, s, other)


@triton.jit
def input_kernel(checks, x0, x1, x2, x3, x4, x5, x6, x7, status, BLOCK: tl.constexpr):
    """Program c: ``checks[c] = (argument, count, lowest, limit, id, dtype code)``: every slot of
    argument tensor ``x[argument]`` (integers, see :func:`_slots_of`) must lie in ``[lowest, limit)``."""
    c = checks + tl.program_id(0) * 6
    x = _arg(tl.load(c), x0, x1, x2, x3, x4, x5, x6, x7)
    n = tl.load(c + 1)
    low = tl.load(c + 2)
    high = tl.load(c + 3)
    code = tl.load(c + 5)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        s = _slots_of(x, code, i, i < n, low)
        bad = (s < low) | (s >= high)
        if _largest(bad.to(tl.int32), axis=0) > 0:
            tl.store(status + S_INPUT_VALUE, _largest(tl.where(bad, s, MOST_NEGATIVE), axis=0))
            tl.store(status + S_INPUT, tl.load(c + 4) + 1)


# ---------------------------------------------------------------------------------------------
# Peer stores: this rank's rows straight into every peer's replica, then one epoch barrier
# ---------------------------------------------------------------------------------------------


@triton.jit
def _now(USE_TIMER: tl.constexpr):
    if USE_TIMER:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)
    else:
        return tl.full([], 0, tl.int64)


@triton.jit
def _peer_tile(entry, first, anchor, x0, x1, x2, x3, x4, x5, x6, x7, chunk_addr, status, me, world,
               W: tl.constexpr, BLOCK: tl.constexpr):
    row, col, live = _words(entry, first, BLOCK)
    kind = tl.load(entry + F_KIND)
    x = _arg(tl.load(entry + F_ARG), x0, x1, x2, x3, x4, x5, x6, x7)
    if kind == 0:  # cache rows: the same address in every peer's replica
        slots = x.to(tl.pointer_type(tl.int64), bitcast=True) + tl.load(entry + F_SLOT)
        slot = tl.load(slots + row, mask=live, other=-1)
        valid, safe = _checked_slots(entry, slot, live, status, me)
        src = _cache_address(entry, safe, col, W)
        v = _load_words(anchor, src, valid, W)
        for q in range(world):
            if q != me:
                _store_words(anchor, src + tl.load(entry + F_DELTAS + q), v, valid, W)
    else:  # header and payload bytes: this rank's chunk of every rank's mailbox (its own too)
        start = tl.where(kind == 1, x.to(tl.int64) + tl.load(entry + F_SLOT), tl.load(entry + F_CACHE))
        v = _load_words(anchor, start + col.to(tl.int64) * W, live, W)
        dst = chunk_addr + tl.load(entry + F_BUF) + col.to(tl.int64) * W
        for q in range(world):
            _store_words(anchor, dst + tl.load(entry + F_DELTAS + q), v, live, W)


@triton.jit
def _signal_and_wait(mailbox, mailbox_deltas, epoch, status, me, world, limit, USE_TIMER: tl.constexpr):
    """Raise this rank's epoch flag in every peer's mailbox (release), then wait (acquire) until
    every peer's flag in this rank's mailbox reached ``epoch``; give up after ``limit`` ns (spins
    when interpreting) and report it. Returns 1 when every peer arrived."""
    flags = mailbox.to(tl.pointer_type(tl.int64), bitcast=True)
    for q in range(world):
        if q != me:
            peer_flags = (mailbox.to(tl.int64) + tl.load(mailbox_deltas + q)).to(tl.pointer_type(tl.int64))
            tl.atomic_max(peer_flags + me, epoch, sem="release", scope="sys")
    arrived = 1
    for q in range(world):
        if q != me:
            seen = tl.atomic_add(flags + q, 0, sem="acquire", scope="sys")
            if USE_TIMER:
                start = _now(USE_TIMER)
                while (seen < epoch) & (_now(USE_TIMER) - start < limit):
                    seen = tl.atomic_add(flags + q, 0, sem="acquire", scope="sys")
            else:
                spins = 0
                while (seen < epoch) & (spins < limit):
                    seen = tl.atomic_add(flags + q, 0, sem="acquire", scope="sys")
                    spins += 1
            if seen < epoch:
                tl.store(status + S_EPOCH, epoch)
                tl.store(status + S_TIMEOUT, q + 1)
                arrived = 0
            elif seen > epoch + 1:  # a peer two syncs ahead ran syncs this rank did not
                tl.store(status + S_EPOCH, epoch)
                tl.store(status + S_OUT_OF_STEP, q + 1)
                arrived = 0
    return arrived


@triton.jit
def peer_kernel(table, tiles, x0, x1, x2, x3, x4, x5, x6, x7, mailbox, mailbox_deltas, counters, status,
                me, world, capacity, limit, ENTRY: tl.constexpr, BLOCK: tl.constexpr, USE_TIMER: tl.constexpr):
    """Program t stores tile ``tiles[t]`` into every peer; the last program to finish raises the
    epoch flag in every peer's mailbox and waits for theirs (``check_kernel`` then checks).

    ``counters``: [epoch, programs arrived] in this rank's memory. The epoch of this call is
    ``counters[0] + 1`` for every program: only the last program advances it, after all arrived.
    Mailbox chunks alternate between two halves by epoch parity, so a peer one sync ahead never
    overwrites a chunk this rank still reads.
    """
    t = tl.program_id(0)
    entry = table + tl.load(tiles + 2 * t) * ENTRY
    first = tl.load(tiles + 2 * t + 1)
    epoch = tl.load(counters) + 1
    chunk_addr = mailbox.to(tl.int64) + MAILBOX_FLAGS + ((epoch % 2) * world + me) * capacity
    width = tl.load(entry + F_WIDTH)
    if width == 16:
        _peer_tile(entry, first, table, x0, x1, x2, x3, x4, x5, x6, x7, chunk_addr, status, me, world, 16, BLOCK)
    elif width == 8:
        _peer_tile(entry, first, table, x0, x1, x2, x3, x4, x5, x6, x7, chunk_addr, status, me, world, 8, BLOCK)
    elif width == 4:
        _peer_tile(entry, first, table, x0, x1, x2, x3, x4, x5, x6, x7, chunk_addr, status, me, world, 4, BLOCK)
    elif width == 2:
        _peer_tile(entry, first, table, x0, x1, x2, x3, x4, x5, x6, x7, chunk_addr, status, me, world, 2, BLOCK)
    else:
        _peer_tile(entry, first, table, x0, x1, x2, x3, x4, x5, x6, x7, chunk_addr, status, me, world, 1, BLOCK)
    tl.debug_barrier()
    done = tl.atomic_add(counters + 1, 1, sem="acq_rel", scope="sys")
    if done == tl.num_programs(0) - 1:
        tl.store(counters + 1, 0)
        tl.store(counters, epoch)
        _signal_and_wait(mailbox, mailbox_deltas, epoch, status, me, world, limit, USE_TIMER)


# ---------------------------------------------------------------------------------------------
# Cache-write store: one program per row (the cache-write ops, pcppass.ops.cache_ops)
# ---------------------------------------------------------------------------------------------


@triton.jit
def copy_segments(dst_row, src_row, cache, slot, valid, entry, TO_CACHE: tl.constexpr,
                  MAXSEG: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """Copy one row's segments between a packed row and the cache (direction TO_CACHE).
    ``entry``: ``row_kernels.RowAddressing.fields()`` behind ``HEAD`` leading fields."""
    bs = tl.load(entry + 5)
    block_stride = tl.load(entry + 6)
    safe = tl.where(valid, slot, 0)
    row_base = cache + (safe // bs) * block_stride
    offset_in_block = safe % bs
    for k in tl.static_range(MAXSEG):
        base = tl.load(entry + HEAD + 4 * k)
        stride = tl.load(entry + HEAD + 4 * k + 1)
        length = tl.load(entry + HEAD + 4 * k + 2)
        packed = tl.load(entry + HEAD + 4 * k + 3)
        in_cache = row_base + base + offset_in_block * stride
        for start in range(0, length, BLOCK):
            o = start + tl.arange(0, BLOCK)
            m = o < length
            if TO_CACHE:
                tl.store(in_cache + o, tl.load(src_row + packed + o, mask=m), mask=m & valid)
            else:
                v = tl.load(in_cache + o, mask=m & valid, other=0)
                tl.store(dst_row + packed + o, v, mask=m)


@triton.jit
def store_kernel(rows, slots, cache_address, entry, ENTRY: tl.constexpr, MAXSEG: tl.constexpr,
                 HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """Program t: dense row t of ``rows`` into the cache at ``slots[t]`` (skipped if < 0)."""
    cache = cache_address.to(tl.pointer_type(tl.uint8))
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    valid = (slot >= 0) & (slot < tl.load(entry + 7))
    src = rows + t * tl.load(entry + 4)
    copy_segments(src, src, cache, slot, valid, entry, True, MAXSEG, HEAD, BLOCK)
