"""Triton kernels of :mod:`pcppass.kernels.row_kernels` (imported there on first use, once per
Triton mode: ``triton.jit`` decides between compiling and interpreting when it decorates).

Table entry fields (int64): 0 cache address, 1 rows, 2 row offset, 3 slot offset, 4 bytes per row,
5 block size, 6 block stride, 7 number of slots, then (base, stride, length, offset in the packed
row) per segment from field ``HEAD``.
"""

import triton
import triton.language as tl


@triton.jit
def copy_segments(dst_row, src_row, cache, slot, valid, entry, TO_CACHE: tl.constexpr,
                  MAXSEG: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """Copy one row's segments between a packed row and the cache (direction TO_CACHE)."""
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
def scatter_kernel(buf, table, ENTRY: tl.constexpr, MAXSEG: tl.constexpr, HEAD: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Program (entry, row): row ``row`` one rank sent for one cache, from ``buf`` to the cache.
    The slot is read byte by byte: a slot segment need not be 8-byte aligned in ``buf``."""
    entry = table + tl.program_id(0) * ENTRY
    row = tl.program_id(1).to(tl.int64)
    n = tl.load(entry + 1)
    if row < n:
        cache = tl.load(entry).to(tl.pointer_type(tl.uint8))
        bpr = tl.load(entry + 4)
        src = buf + tl.load(entry + 2) + row * bpr
        slot_at = buf + tl.load(entry + 3) + row * 8
        slot = tl.load(slot_at).to(tl.int64)
        for k in tl.static_range(1, 8):
            slot = slot | (tl.load(slot_at + k).to(tl.int64) << (8 * k))
        valid = (slot >= 0) & (slot < tl.load(entry + 7))
        copy_segments(src, src, cache, slot, valid, entry, True, MAXSEG, HEAD, BLOCK)

@triton.jit
def pack_kernel(out, slots, table, ENTRY: tl.constexpr, MAXSEG: tl.constexpr, HEAD: tl.constexpr,
                BLOCK: tl.constexpr):
    """Program (entry, row): the cache's row at ``slots[...]`` into ``out`` (zeros for -1)."""
    entry = table + tl.program_id(0) * ENTRY
    row = tl.program_id(1).to(tl.int64)
    n = tl.load(entry + 1)
    if row < n:
        cache = tl.load(entry).to(tl.pointer_type(tl.uint8))
        dst = out + tl.load(entry + 2) + row * tl.load(entry + 4)
        slot = tl.load(slots + tl.load(entry + 3) + row)
        valid = (slot >= 0) & (slot < tl.load(entry + 7))
        copy_segments(dst, dst, cache, slot, valid, entry, False, MAXSEG, HEAD, BLOCK)

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
