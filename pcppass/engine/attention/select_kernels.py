"""Triton kernel of :func:`pcppass.engine.attention.select.select_topk_triton`: per row, the
positions of the ``k`` largest scores, found by radix select and written in position order (loaded
once per Triton mode by :func:`pcppass.engine.attention.launch.kernels`).

Keys: a float32 score's bits made monotonic as unsigned integers (negative scores: every bit
flipped; others: the sign bit set), so ``-0.0`` ranks below ``+0.0`` and ``-inf`` is the lowest
key a score can have (NaN never occurs). A -inf pick is a -1 whatever its position, so only the
*visible* keys (above the -inf key) are ever selected; the -1s are counted, not chosen.

Only triton.language builtins are called (reductions and scans through ``tl.reduce`` /
``tl.associative_scan``): the library's own ``@triton.jit`` functions (``tl.sum``, ``tl.cumsum``)
were decorated in whichever mode triton was first imported in, and an interpreted kernel cannot
call a compiled-mode one. Their combine function ``tl.standard._sum_combine`` is only passed, never
called from here: the compiler inlines it as it does for ``tl.sum``, and the interpreter recognises
it and sums in numpy (with any other combine function it calls the function once per element).
"""

import triton
import triton.language as tl

#: the key of a -inf score
NEG_INF_KEY = tl.constexpr(0x007FFFFF)
#: radix digits: 4 passes of 8 bits, most significant first
DIGIT_BITS = tl.constexpr(8)
BINS = tl.constexpr(256)
#: the compaction scan counts a chunk's ties in the high half of an int32, larger keys in the low half
TIE_SHIFT = tl.constexpr(16)
LOW_HALF = tl.constexpr(0xFFFF)
#: where a pass reads its keys: the row (keys at or above ``low``), the candidates a compaction
#: wrote, or every ``step``-th position of the row
FROM_ROW = tl.constexpr(0)
FROM_CANDIDATES = tl.constexpr(1)
FROM_SAMPLE = tl.constexpr(2)


@triton.jit
def total(x):
    return tl.reduce(x, 0, tl.standard._sum_combine)


@triton.jit
def prefix_sum(x, reverse: tl.constexpr):
    """Inclusive prefix sum along the only axis (``reverse``: from the end)."""
    return tl.associative_scan(x, 0, tl.standard._sum_combine, reverse)


@triton.jit
def row_keys(ROW, pos, span):
    """Ordered uint32 keys of positions ``pos`` of a row (positions from ``span`` on: -inf, the
    padding of a row shorter than ``k``)."""
    bits = tl.load(ROW + pos, mask=pos < span, other=float("-inf")).to(tl.int32, bitcast=True)
    # negative: every bit flipped (the arithmetic shift spreads the sign); others: the sign bit set
    return (bits ^ ((bits >> 31) | -0x80000000)).to(tl.uint32, bitcast=True)


@triton.jit
def source_chunk(ROW, KEYS, POS, start, n, span, low, step, SOURCE: tl.constexpr, CHUNK: tl.constexpr, first=0):
    """(keys, live, positions) of entries ``start ..`` of a source of ``n`` entries (``FROM_ROW``:
    the row's positions ``first .. first + n``)."""
    i = start + tl.arange(0, CHUNK)
    live = i < n
    if SOURCE == FROM_CANDIDATES:
        key = tl.load(KEYS + i, mask=live, other=0).to(tl.uint32, bitcast=True)
        pos = tl.load(POS + i, mask=live, other=0)
    elif SOURCE == FROM_SAMPLE:
        pos = i * step
        key = row_keys(ROW, pos, span)
    else:
        pos = first + i
        key = row_keys(ROW, pos, span)
        live = live & (key >= low)
    return key, live, pos


@triton.jit
def kth_largest(ROW, KEYS, POS, n, span, low, step, need, SOURCE: tl.constexpr, CHUNK: tl.constexpr):
    """Radix select over a source: ``(threshold, above, ties)``, ``threshold`` the ``need``-th
    largest key (with multiplicity; ``need`` capped at the number of keys), ``above`` keys larger
    than it, ``ties = need - above`` of the keys equal to it complete the ``need`` largest.

    Digit by digit from the most significant: a histogram of the keys that share the digits found
    so far, then the digit where the count from the top reaches the number still needed.
    """
    bins = tl.arange(0, BINS)
    prefix = tl.full([], 0, tl.uint32)
    high = tl.full([], 0, tl.uint32)
    above = tl.full([], 0, tl.int32)
    for p in tl.static_range(32 // DIGIT_BITS):
        shift = 32 - DIGIT_BITS * (p + 1)
        hist = tl.full([BINS], 0, tl.int32)
        for start in range(0, n, CHUNK):
            key, live, _ = source_chunk(ROW, KEYS, POS, start, n, span, low, step, SOURCE, CHUNK)
            live = live & ((key & high) == prefix)
            hist += tl.histogram(((key >> shift) & (BINS - 1)).to(tl.int32), BINS, mask=live)
        if p == 0:
            need = tl.minimum(need, total(hist))
        at_or_above = prefix_sum(hist, True)
        digit = total((at_or_above >= need).to(tl.int32)) - 1
        skipped = total(tl.where(bins > digit, hist, 0))
        above += skipped
        need -= skipped
        prefix |= digit.to(tl.uint32) << shift
        high |= tl.full([], BINS - 1, tl.uint32) << shift
    return prefix, above, need


@triton.jit
def compact(ROW, KEYS, POS, n, span, low, step, threshold, ties, OUT_POS, OUT_KEYS, base, cap,
            SOURCE: tl.constexpr, TIES: tl.constexpr, CANDIDATES: tl.constexpr, CHUNK: tl.constexpr, first=0):
    """Walks a source in order and writes, at slots ``base ..``, the positions of its keys above
    ``threshold`` and (``TIES``) of the first ``ties`` keys equal to it. Returns how many it took.
    ``CANDIDATES``: also writes the keys, and only into the slots below ``cap`` (it counts on).
    ``first``: see :func:`source_chunk`."""
    taken = tl.full([], 0, tl.int32)
    ties_seen = tl.full([], 0, tl.int32)
    for start in range(0, n, CHUNK):
        key, live, pos = source_chunk(ROW, KEYS, POS, start, n, span, low, step, SOURCE, CHUNK, first)
        larger = (live & (key > threshold)).to(tl.int32)
        if TIES:
            # one scan counts both: ties in the high half, larger keys in the low half
            equal = (live & (key == threshold)).to(tl.int32)
            counts = (equal << TIE_SHIFT) | larger
            upto = prefix_sum(counts, False)
            ties_left = tl.maximum(ties - ties_seen, 0)
            equal_upto = upto >> TIE_SHIFT
            slot = base + taken + (upto & LOW_HALF) + tl.minimum(equal_upto, ties_left) - 1
            take = (larger != 0) | ((equal != 0) & (equal_upto <= ties_left))
            chunk = total(counts)
            taken += (chunk & LOW_HALF) + tl.minimum(chunk >> TIE_SHIFT, ties_left)
            ties_seen += chunk >> TIE_SHIFT
        else:
            slot = base + taken + prefix_sum(larger, False) - 1
            take = larger != 0
            taken += total(larger)
        if CANDIDATES:
            take = take & (slot < cap)
            tl.store(OUT_KEYS + slot, key.to(tl.int32, bitcast=True), mask=take)
        tl.store(OUT_POS + slot, pos.to(OUT_POS.dtype.element_ty), mask=take)
    return taken


@triton.jit
def select_into(ROW, KEYS, POS, OUT_ROW, n, span, low, k, SOURCE: tl.constexpr, CHUNK: tl.constexpr):
    """``OUT_ROW[:k]`` from a source of visible keys: ``k - picks`` -1s, then the positions of its
    ``picks = min(k, n)`` largest keys (the lowest positions first among equal keys) in order."""
    threshold, above, ties = kth_largest(ROW, KEYS, POS, n, span, low, 0, k, SOURCE, CHUNK)
    first = k - above - ties
    for start in range(0, first, CHUNK):
        slot = start + tl.arange(0, CHUNK)
        tl.store(OUT_ROW + slot, tl.full([CHUNK], -1, tl.int64), mask=slot < first)
    compact(ROW, KEYS, POS, n, span, low, 0, threshold, ties, OUT_ROW, OUT_ROW, first, k, SOURCE, True, False,
            CHUNK)


@triton.jit
def sampled_bound(ROW, KEYS, POS, span, step, sample_rank, SAMPLE: tl.constexpr):
    """The lower bound ``low`` of a sampled row: the ``sample_rank``-th largest key of ``SAMPLE``
    positions ``step`` apart, and never below the smallest visible key."""
    low = tl.full([], NEG_INF_KEY + 1, tl.uint32)
    sampled, _, _ = kth_largest(ROW, KEYS, POS, SAMPLE, span, low, step, sample_rank, FROM_SAMPLE, SAMPLE)
    return tl.maximum(low, sampled)


@triton.jit
def topk_candidates_kernel(SCORES, PART_KEYS, PART_POS, COUNTS, LOWS, span, length, stride_s, stride_p, num_parts,
                           part_len, step, sample_rank, SAMPLE: tl.constexpr, ROW_CHUNK: tl.constexpr):
    """Row ``program_id(0)``, part ``program_id(1)`` (positions ``part * part_len ..``): the
    candidates of a sampled row, a part per program. Each program of the row takes the same bound
    (:func:`sampled_bound`: the same sample, the same arithmetic) and writes its part's keys at or
    above it, in position order, into the part's ``part_len`` slots of ``PART_KEYS`` / ``PART_POS``
    (room for every key of the part) and their number into ``COUNTS[row, part]``; part 0 writes
    the bound to ``LOWS[row]``. :func:`topk_select_kernel` then joins the parts in order."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    ROW = SCORES + row * stride_s
    KEYS = PART_KEYS + row * stride_p + part * part_len
    POS = PART_POS + row * stride_p + part * part_len
    low = sampled_bound(ROW, KEYS, POS, span, step, sample_rank, SAMPLE)
    first = part * part_len
    n = tl.maximum(tl.minimum(part_len, length - first), 0)
    count = compact(ROW, KEYS, POS, n, span, low, 0, low - 1, 0, POS, KEYS, 0, part_len, FROM_ROW, False, True,
                    ROW_CHUNK, first)
    tl.store(COUNTS + row * num_parts + part, count)
    if part == 0:
        tl.store(LOWS + row, low.to(tl.int32, bitcast=True))


@triton.jit
def join_parts(PART_KEYS, PART_POS, COUNTS, KEYS, POS, row, stride_p, num_parts, part_len, cap, CHUNK: tl.constexpr):
    """The candidates of :func:`topk_candidates_kernel`'s parts, copied in part order into the
    row's ``cap`` candidate slots ``KEYS`` / ``POS`` (so in position order); returns their number
    (copied only if it fits)."""
    total = tl.full([], 0, tl.int32)
    for part in range(0, num_parts):
        total += tl.load(COUNTS + row * num_parts + part)
    if total <= cap:
        base = tl.full([], 0, tl.int32)
        for part in range(0, num_parts):
            count = tl.load(COUNTS + row * num_parts + part)
            src = row * stride_p + part * part_len
            for start in range(0, count, CHUNK):
                i = start + tl.arange(0, CHUNK)
                live = i < count
                tl.store(KEYS + base + i, tl.load(PART_KEYS + src + i, mask=live), mask=live)
                tl.store(POS + base + i, tl.load(PART_POS + src + i, mask=live), mask=live)
            base += count
    return total


@triton.jit
def topk_select_kernel(SCORES, OUT, CAND_KEYS, CAND_POS, PART_KEYS, PART_POS, COUNTS, LOWS, span, length, k,
                       stride_s, stride_o, stride_c, stride_p, cap, num_parts, part_len, step, sample_rank,
                       SAMPLED: tl.constexpr, PARTS: tl.constexpr, SAMPLE: tl.constexpr,
                       ROW_CHUNK: tl.constexpr, CAND_CHUNK: tl.constexpr):
    """Row ``program_id(0)``: ``OUT[row, :k]`` = the positions of the ``k`` largest keys among the
    ``length = max(span, k)`` first (positions from ``span`` on: -inf), the lowest positions first
    among equal keys, ascending; picks with a -inf score are -1 and come first.

    ``SAMPLED`` (rows much longer than ``k``): the ``sample_rank``-th largest key of ``SAMPLE``
    positions ``step`` apart is a lower bound ``low`` that most likely leaves a little more than
    ``k`` keys; a compaction pass writes the keys at or above it (in position order) into the
    row's ``cap`` candidate slots (``PARTS``: :func:`topk_candidates_kernel` did, a part of the row
    per program, and left ``low`` in ``LOWS``; its parts are joined here). The selection then reads
    the candidates only, unless they are fewer than ``k`` (``low`` falls back to every visible key)
    or more than ``cap`` (it reads the row, keeping the keys at or above ``low``). Either way the
    ``k`` largest keys are all at or above ``low``, so the result is the same; only the time differs.
    """
    row = tl.program_id(0).to(tl.int64)
    ROW = SCORES + row * stride_s
    OUT_ROW = OUT + row * stride_o
    low = tl.full([], NEG_INF_KEY + 1, tl.uint32)
    candidates = cap + 1
    if SAMPLED:
        KEYS = CAND_KEYS + row * stride_c
        POS = CAND_POS + row * stride_c
        if PARTS:
            low = tl.load(LOWS + row).to(tl.uint32, bitcast=True)
            candidates = join_parts(PART_KEYS, PART_POS, COUNTS, KEYS, POS, row, stride_p, num_parts, part_len, cap,
                                    CAND_CHUNK)
        else:
            low = sampled_bound(ROW, KEYS, POS, span, step, sample_rank, SAMPLE)
            candidates = compact(ROW, KEYS, POS, length, span, low, 0, low - 1, 0, POS, KEYS, 0, cap,
                                 FROM_ROW, False, True, ROW_CHUNK)
        if (candidates < k) & (low > NEG_INF_KEY + 1):
            low = tl.full([], NEG_INF_KEY + 1, tl.uint32)
            candidates = compact(ROW, KEYS, POS, length, span, low, 0, low - 1, 0, POS, KEYS, 0, cap,
                                 FROM_ROW, False, True, ROW_CHUNK)
        if candidates <= cap:
            select_into(ROW, KEYS, POS, OUT_ROW, candidates, span, low, k, FROM_CANDIDATES, CAND_CHUNK)
    if candidates > cap:
        select_into(ROW, ROW, ROW, OUT_ROW, length, span, low, k, FROM_ROW, ROW_CHUNK)
