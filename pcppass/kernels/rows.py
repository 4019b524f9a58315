"""Row movement for replica synchronisation: read written rows, pack, check, unpack, scatter.

The rewrite (:mod:`pcppass.rewrite.insert`) wires these ops around one functional all-gather per
step (deferred schedule) or per write site (immediate schedule)::

    packed   = pcppass.sync_pack(fingerprint, caches, cache_slots, layouts, payloads)   # this rank
    gathered = wait_tensor(all_gather_into_tensor(packed, world, group))                # every rank
    index    = pcppass.sync_read_header(gathered, world, fingerprint, num_segments, verify)
    pcppass.sync_scatter_rows_all([caches], gathered, index, rows_segs, slots_segs, layouts, ...)  # COPY_ROWS
    arg_all  = pcppass.sync_unpack(gathered, index, seg, like, group, mask_own_rows)      # RERUN

Packed buffer of one rank (uint8)::

    | "PCPSYNC1" | fingerprint (16 B) | num_segments (i64) | segment sizes (i64 each) | segments... |

Segments are, in order: the bytes of every cache's rows at its slots (``[n, bytes_per_row]``, zeros
for slot -1), then every payload tensor's raw bytes (slot mappings, re-run inputs). Every rank packs
the same segments with the same sizes (rows are padded to one count per step), so the all-gather is
equal-sized; the header lets every rank verify that before it touches its replica.

Rows are addressed through a resolved layout encoded as ints (:func:`encode_layout`):
``paged_rows`` (``cache[s // bs, s % bs]``, any strides), ``block_split`` (byte segments inside a
block, the indexer-cache layout) and ``indexed_dim`` (``cache.index_select(dim, s)``). Bytes are
moved through same-width integer views, so every dtype (fp8, bf16, fp32) is copied bit for bit.

These are opaque custom ops with plain-torch implementations (CPU and CUDA); the mutating one
declares ``mutates_args`` so functionalization orders every later read of the cache after it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pcppass.runtime.stats import SYNC_COUNTERS
from pcppass.spec import ResolvedLayout

MAGIC = b"PCPSYNC1"
FINGERPRINT_BYTES = 16
_FIXED_HEADER = len(MAGIC) + FINGERPRINT_BYTES + 8

_KIND_CODES = {"paged_rows": 0, "block_split": 1, "indexed_dim": 2}
_KIND_NAMES = {v: k for k, v in _KIND_CODES.items()}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def header_bytes(num_segments: int) -> int:
    return _FIXED_HEADER + 8 * num_segments


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


def encode_layout(layout: ResolvedLayout) -> list[int]:
    """``[kind, block_size, bytes_per_row, dim, nseg, (base, stride, length) * nseg]``."""
    out = [_KIND_CODES[layout.kind], layout.block_size, layout.bytes_per_row, layout.dim,
           len(layout.segments)]
    for seg in layout.segments:
        out.extend(int(x) for x in seg)
    return out


def decode_layouts(encoded: list[int]) -> list[ResolvedLayout]:
    """Inverse of concatenated :func:`encode_layout` results."""
    layouts, i = [], 0
    while i < len(encoded):
        kind, bs, bpr, dim, nseg = encoded[i:i + 5]
        i += 5
        segs = tuple(tuple(encoded[i + 3 * k:i + 3 * k + 3]) for k in range(nseg))
        i += 3 * nseg
        layouts.append(ResolvedLayout(_KIND_NAMES[kind], bs, bpr, segments=segs, dim=dim))
    return layouts


def num_slots(cache: torch.Tensor, layout: ResolvedLayout) -> int:
    """How many slots ``cache`` has under ``layout`` (valid slots are ``[0, num_slots)``)."""
    if layout.kind == "paged_rows":
        return cache.shape[0] * cache.shape[1]
    if layout.kind == "block_split":
        return cache.shape[0] * layout.block_size
    return cache.shape[layout.dim]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Same-width integer view: indexing and copying it moves exact bit patterns."""
    return t.view(_BITS[t.element_size()])


def _block_bytes(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, bytes_per_block]`` uint8 view of a block-split cache (must be a view)."""
    return cache.view(torch.uint8).view(cache.shape[0], -1)


def _segment_columns(offsets: torch.Tensor, base: int, stride: int, length: int) -> torch.Tensor:
    return base + offsets[:, None] * stride + torch.arange(length, device=offsets.device)[None, :]


def read_rows(cache: torch.Tensor, slots: torch.Tensor, layout: ResolvedLayout) -> torch.Tensor:
    """Bytes of the rows at ``slots`` (all valid) as ``[n, layout.bytes_per_row]`` uint8."""
    n = slots.numel()
    if layout.kind == "paged_rows":
        bs = cache.shape[1]
        rows = _bits(cache)[slots // bs, slots % bs]
        return rows.reshape(n, -1).contiguous().view(torch.uint8)
    if layout.kind == "indexed_dim":
        rows = _bits(cache).index_select(layout.dim, slots).movedim(layout.dim, 0)
        return rows.reshape(n, -1).contiguous().view(torch.uint8)
    flat = _block_bytes(cache)
    bs = layout.block_size
    blocks, offsets = slots // bs, slots % bs
    parts = [flat[blocks[:, None], _segment_columns(offsets, *seg)] for seg in layout.segments]
    return torch.cat(parts, dim=1)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
               layout: ResolvedLayout) -> None:
    """Inverse of :func:`read_rows`: store ``rows`` (``[n, bytes_per_row]`` uint8) at ``slots``."""
    n = slots.numel()
    rows = rows.contiguous()
    if layout.kind == "paged_rows":
        bits = _bits(cache)
        bs = cache.shape[1]
        values = rows.view(bits.dtype).reshape(n, *cache.shape[2:])
        bits[slots // bs, slots % bs] = values
        return
    if layout.kind == "indexed_dim":
        bits = _bits(cache)
        rest = [d for i, d in enumerate(cache.shape) if i != layout.dim]
        values = rows.view(bits.dtype).reshape(n, *rest).movedim(0, layout.dim)
        bits.index_copy_(layout.dim, slots, values)
        return
    flat = _block_bytes(cache)
    bs = layout.block_size
    blocks, offsets = slots // bs, slots % bs
    start = 0
    for seg in layout.segments:
        length = seg[2]
        flat[blocks[:, None], _segment_columns(offsets, *seg)] = rows[:, start:start + length]
        start += length


# ---------------------------------------------------------------------------------------------
# Header
# ---------------------------------------------------------------------------------------------


def _fingerprint_bytes(fingerprint: str) -> bytes:
    raw = bytes.fromhex(fingerprint[: 2 * FINGERPRINT_BYTES]) if fingerprint else b""
    return raw.ljust(FINGERPRINT_BYTES, b"\0")


def _encode_header(fingerprint: str, sizes: list[int], device: torch.device) -> torch.Tensor:
    fixed = MAGIC + _fingerprint_bytes(fingerprint)
    ints = torch.tensor([len(sizes), *sizes], dtype=torch.int64)
    head = torch.cat([torch.frombuffer(bytearray(fixed), dtype=torch.uint8), ints.view(torch.uint8)])
    return head.to(device)


def _group_rank(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_rank(_resolve_process_group(group_name))


# ---------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------


def _rows_segment_sizes(slots: list[torch.Tensor], layouts: list[ResolvedLayout]) -> list:
    return [s.numel() * lay.bytes_per_row for s, lay in zip(slots, layouts)]


def decode_pack_layouts(caches: list[torch.Tensor], cache_slots: list[torch.Tensor],
                        layouts: list[int]) -> list[ResolvedLayout]:
    """The resolved layouts of a ``sync_pack`` call, one per cache (checked to line up)."""
    decoded = decode_layouts(layouts)
    if not (len(caches) == len(cache_slots) == len(decoded)):
        raise ValueError("sync_pack: caches, cache_slots and layouts differ in length")
    return decoded


def payload_bytes(t: torch.Tensor) -> torch.Tensor:
    """A payload tensor's raw bytes, flat (rows first, as the rewrite hands them over)."""
    if not t.numel():
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8).reshape(-1)


@torch.library.custom_op("pcppass::sync_pack", mutates_args=())
def sync_pack(
    fingerprint: str,
    caches: list[torch.Tensor],
    cache_slots: list[torch.Tensor],
    layouts: list[int],
    payloads: list[torch.Tensor],
) -> torch.Tensor:
    """One rank's sync buffer: header, the rows each cache holds at its slots, raw payloads."""
    decoded = decode_pack_layouts(caches, cache_slots, layouts)
    anchor = caches[0] if caches else payloads[0]
    segments: list[torch.Tensor] = []
    for cache, slots, layout in zip(caches, cache_slots, decoded):
        slots = slots.reshape(-1)
        rows = torch.zeros(slots.numel(), layout.bytes_per_row, dtype=torch.uint8, device=cache.device)
        valid = slots >= 0
        if bool(valid.any()):
            rows[valid] = read_rows(cache, slots[valid], layout)
        segments.append(rows.reshape(-1))
    segments.extend(payload_bytes(t) for t in payloads)
    head = _encode_header(fingerprint, [s.numel() for s in segments], anchor.device)
    return torch.cat([head, *segments])


@sync_pack.register_fake
def _sync_pack_fake(fingerprint, caches, cache_slots, layouts, payloads):
    decoded = decode_layouts(layouts)
    total = header_bytes(len(caches) + len(payloads))
    for size in _rows_segment_sizes(cache_slots, decoded):
        total = total + size
    for t in payloads:
        total = total + t.numel() * t.element_size()
    anchor = caches[0] if caches else payloads[0]
    return anchor.new_empty((total,), dtype=torch.uint8)


@torch.library.custom_op("pcppass::sync_read_header", mutates_args=())
def sync_read_header(
    gathered: torch.Tensor, world_size: int, fingerprint: str, num_segments: int, verify: bool
) -> torch.Tensor:
    """``[world, num_segments, 2]`` (offset, size) of every rank's segments in ``gathered``.

    With ``verify``, every rank's header must carry this rank's fingerprint and segment sizes:
    ranks that traced different graphs fail here, before any replica is touched.
    """
    chunk = gathered.numel() // world_size
    SYNC_COUNTERS.record(chunk, world_size)
    head_len = header_bytes(num_segments)
    heads = gathered.view(world_size, chunk)[:, :head_len].cpu()
    index = torch.empty(world_size, num_segments, 2, dtype=torch.int64)
    mine = _fingerprint_bytes(fingerprint)
    fingerprints, sizes_by_rank = [], []
    for r in range(world_size):
        head = heads[r]
        magic = bytes(head[: len(MAGIC)].tolist())
        fp = bytes(head[len(MAGIC): len(MAGIC) + FINGERPRINT_BYTES].tolist())
        ints = head[len(MAGIC) + FINGERPRINT_BYTES:].clone().view(torch.int64)
        fingerprints.append(fp.hex())
        sizes_by_rank.append(ints.tolist())
        if verify and (magic != MAGIC or int(ints[0]) != num_segments):
            raise _sync_error(
                f"rank {r}'s sync buffer has no valid pcppass header (magic {magic!r}, "
                f"{int(ints[0])} segments, expected {num_segments})", fingerprints)
        sizes = ints[1:1 + num_segments]
        offsets = torch.cumsum(sizes, 0) - sizes + r * chunk + head_len
        index[r, :, 0] = offsets
        index[r, :, 1] = sizes
    if verify:
        if any(fp != mine.hex() for fp in fingerprints):
            raise _sync_error("ranks traced different graphs: their sync fingerprints differ",
                              fingerprints)
        if any(s != sizes_by_rank[0] for s in sizes_by_rank):
            raise _sync_error(f"ranks packed different segment sizes: {sizes_by_rank}", fingerprints)
    return index.to(gathered.device)


def _sync_error(what: str, fingerprints: list[str]):
    from pcppass.errors import PcpSyncError

    listing = ", ".join(f"rank {r}: {fp}" for r, fp in enumerate(fingerprints))
    return PcpSyncError(
        f"pcppass replica sync: {what} [{listing}]. Every rank must compile and run the same step "
        "graph (same model, same pcppass configuration, same step kind)."
    )


@sync_read_header.register_fake
def _sync_read_header_fake(gathered, world_size, fingerprint, num_segments, verify):
    return gathered.new_empty((world_size, num_segments, 2), dtype=torch.int64)


def _segment(gathered: torch.Tensor, index: torch.Tensor, rank: int, segment: int) -> torch.Tensor:
    offset, size = (int(x) for x in index[rank, segment].tolist())
    return gathered[offset:offset + size]


def every_rank_slots(gathered: torch.Tensor, index: torch.Tensor, slots_segment: int) -> list[torch.Tensor]:
    """Each rank's slot mapping of segment ``slots_segment`` (int64 copies), in rank order."""
    return [_segment(gathered, index, r, slots_segment).clone().view(torch.int64)
            for r in range(index.shape[0])]


def scatter_rows_reference(
    cache: torch.Tensor,
    gathered: torch.Tensor,
    index: torch.Tensor,
    rows_segment: int,
    slots_segment: int,
    layout: list[int],
    group_name: str,
    site: str,
    check_conflicts: bool,
) -> str | None:
    """Write every other rank's rows (from ``gathered``) into this rank's replica of ``cache``.

    Slot -1 rows are skipped and this rank's own rows are left as its local op wrote them. With
    ``check_conflicts``, slots outside the cache are skipped and a slot written by two ranks in
    one step gets the lowest such rank's row on EVERY replica (its other writers included), so
    the replicas stay identical; the problem is returned (None if there is none) for the caller
    to raise once every cache of the op is written.
    """
    (lay,) = decode_layouts(layout)
    world = index.shape[0]
    me = _group_rank(group_name)
    all_slots = every_rank_slots(gathered, index, slots_segment)
    problem = None
    if check_conflicts:
        applied, problem = _one_writer_per_slot(all_slots, num_slots(cache, lay), site)
    else:
        applied = [slots >= 0 for slots in all_slots]
    for r in range(world):
        if r == me or not bool(applied[r].any()):
            continue
        slots = all_slots[r]
        rows = _segment(gathered, index, r, rows_segment).view(slots.numel(), lay.bytes_per_row)
        write_rows(cache, slots[applied[r]], rows[applied[r]], lay)
    return problem


def _raise_sync_problems(problems: list[str | None]) -> None:
    found = [p for p in problems if p is not None]
    if found:
        from pcppass.errors import PcpSyncError

        raise PcpSyncError("; ".join(found))


@torch.library.custom_op("pcppass::sync_scatter_rows", mutates_args=("cache",))
def sync_scatter_rows(
    cache: torch.Tensor,
    gathered: torch.Tensor,
    index: torch.Tensor,
    rows_segment: int,
    slots_segment: int,
    layout: list[int],
    group_name: str,
    site: str,
    check_conflicts: bool,
) -> None:
    """One cache's scatter (:func:`scatter_rows_reference`)."""
    _raise_sync_problems([scatter_rows_reference(cache, gathered, index, rows_segment, slots_segment,
                                                 layout, group_name, site, check_conflicts)])


@sync_scatter_rows.register_fake
def _sync_scatter_rows_fake(cache, gathered, index, rows_segment, slots_segment, layout,
                            group_name, site, check_conflicts):
    return None


@torch.library.custom_op("pcppass::sync_scatter_rows_all", mutates_args=("caches",))
def sync_scatter_rows_all(
    caches: list[torch.Tensor],
    gathered: torch.Tensor,
    index: torch.Tensor,
    rows_segments: list[int],
    slots_segments: list[int],
    layouts: list[int],
    group_name: str,
    sites: str,
    check_conflicts: bool,
) -> None:
    """:func:`sync_scatter_rows` for many caches in one op: cache ``i`` receives the rows of
    segment ``rows_segments[i]`` at the slots of segment ``slots_segments[i]`` through the i-th
    layout of ``layouts`` (concatenated :func:`encode_layout` results); ``sites`` holds the i-th
    cache's site label on line ``i`` (for errors). One op per collective lets a device
    implementation move every cache's rows in one launch; the caches are distinct tensors.
    """
    problems = _scatter_every_cache(caches, gathered, index, rows_segments, slots_segments, layouts,
                                    group_name, sites, check_conflicts)
    _raise_sync_problems(problems)  # after every cache is written: the replicas stay identical


def _scatter_every_cache(caches: list[torch.Tensor], gathered: torch.Tensor, index: torch.Tensor,
                         rows_segments: list[int], slots_segments: list[int], layouts: list[int],
                         group_name: str, sites: str, check_conflicts: bool) -> list[str | None]:
    """:func:`scatter_rows_reference` for every cache of one scatter op; each one's problem."""
    decoded = decode_layouts(layouts)
    labels = site_labels(sites, len(caches))
    if not (len(caches) == len(rows_segments) == len(slots_segments) == len(decoded)):
        raise ValueError("sync_scatter_rows_all: caches, segments and layouts differ in length")
    return [
        scatter_rows_reference(cache, gathered, index, rows_segment, slots_segment, encode_layout(lay),
                               group_name, site, check_conflicts)
        for cache, rows_segment, slots_segment, lay, site in zip(caches, rows_segments, slots_segments,
                                                                 decoded, labels)
    ]


@torch.library.custom_op("pcppass::sync_scatter_rows_all_quiet", mutates_args=("caches",))
def sync_scatter_rows_all_quiet(
    caches: list[torch.Tensor],
    gathered: torch.Tensor,
    index: torch.Tensor,
    rows_segments: list[int],
    slots_segments: list[int],
    layouts: list[int],
    group_name: str,
    sites: str,
) -> None:
    """:func:`sync_scatter_rows_all` with the slot checks' choice of rows (out-of-range slots
    skipped, the lowest writing rank's row for a slot two ranks wrote) but no raise: one batch of
    a collective that a re-run site splits into several, whose problems
    ``pcppass::sync_raise_slot_problems`` raises once every batch and re-run has run (raising
    here would leave the later batches' rows on their owners only)."""
    _scatter_every_cache(caches, gathered, index, rows_segments, slots_segments, layouts, group_name, sites,
                         check_conflicts=True)


@sync_scatter_rows_all_quiet.register_fake
def _sync_scatter_rows_all_quiet_fake(caches, gathered, index, rows_segments, slots_segments, layouts,
                                      group_name, sites):
    return None


@torch.library.custom_op("pcppass::sync_raise_slot_problems", mutates_args=())
def sync_raise_slot_problems(
    caches: list[torch.Tensor],
    gathered: torch.Tensor,
    index: torch.Tensor,
    slots_segments: list[int],
    layouts: list[int],
    sites: str,
) -> None:
    """Raise what the slot checks find in every rank's slots of ``caches`` (the same
    :class:`~pcppass.errors.PcpSyncError` on every rank, which all read the same gathered slots).
    ``caches`` are read only to order this after the scatters that wrote them."""
    decoded = decode_layouts(layouts)
    problems = []
    for cache, slots_segment, lay, site in zip(caches, slots_segments, decoded, site_labels(sites, len(caches))):
        all_slots = every_rank_slots(gathered, index, slots_segment)
        problems.append(_one_writer_per_slot(all_slots, num_slots(cache, lay), site)[1])
    _raise_sync_problems(problems)


@sync_raise_slot_problems.register_fake
def _sync_raise_slot_problems_fake(caches, gathered, index, slots_segments, layouts, sites):
    return None


# It only raises: keep it through dead-code elimination (no mutated argument, no result).
torch.fx.node.has_side_effect(torch.ops.pcppass.sync_raise_slot_problems.default)


def site_labels(sites: str, count: int) -> list[str]:
    """The per-cache labels of ``sync_scatter_rows_all``'s ``sites`` (one per line)."""
    labels = sites.split("\n") if count else []
    if len(labels) != count:
        raise ValueError(f"sync_scatter_rows_all: {len(labels)} site labels for {count} caches")
    return labels


@sync_scatter_rows_all.register_fake
def _sync_scatter_rows_all_fake(caches, gathered, index, rows_segments, slots_segments, layouts,
                                group_name, sites, check_conflicts):
    return None


def _one_writer_per_slot(all_slots: list[torch.Tensor], limit: int,
                         site: str) -> tuple[list[torch.Tensor], str | None]:
    """Per rank, which of its rows every other replica applies, and what was wrong (or None).

    A row is applied if its slot is in ``[0, limit)`` and no lower rank wrote the same slot in
    this step: every replica makes the same choice from the same gathered slots.
    """
    problems = []
    writers: dict[int, list[int]] = {}
    applied = []
    for r, slots in enumerate(all_slots):
        outside = (slots < -1) | (slots >= limit)
        if bool(outside.any()):
            problems.append(f"rank {r} wrote slot {int(slots[outside][0])}, outside [-1, {limit}): "
                            "no replica applied it")
        keep = (slots >= 0) & ~outside
        for i in keep.nonzero().flatten().tolist():
            ranks = writers.setdefault(int(slots[i]), [])
            if ranks and ranks[0] != r:
                keep[i] = False
            if r not in ranks:
                ranks.append(r)
        applied.append(keep)
    conflicts = {s: ranks for s, ranks in writers.items() if len(ranks) > 1}
    if conflicts:
        slot, ranks = min(conflicts.items())
        more = f" (and {len(conflicts) - 1} more slot(s))" if len(conflicts) > 1 else ""
        problems.append(
            f"slot {slot} was written by ranks {ranks} in the same step{more}; every row must have "
            f"exactly one owner per step. Every replica now holds rank {ranks[0]}'s row for it (the "
            "lowest writing rank's), so the replicas are identical, but this step's outputs are "
            "not to be trusted"
        )
    return applied, (f"{site}: " + "; ".join(problems)) if problems else None


@torch.library.custom_op("pcppass::sync_unpack", mutates_args=())
def sync_unpack(
    gathered: torch.Tensor,
    index: torch.Tensor,
    segment: int,
    like: torch.Tensor,
    group_name: str,
    mask_own_rows: bool,
) -> torch.Tensor:
    """Every rank's copy of a payload, concatenated along dim 0: ``[world * n, *like.shape[1:]]``.

    With ``mask_own_rows`` (slot mappings of a re-run) this rank's own rows become -1, so the
    re-run skips the rows the local op already wrote.
    """
    world = index.shape[0]
    parts = [_segment(gathered, index, r, segment).clone().view(like.dtype).view(like.shape)
             for r in range(world)]
    if mask_own_rows:
        parts[_group_rank(group_name)] = torch.full_like(parts[0], -1)
    return torch.cat(parts, dim=0)


@sync_unpack.register_fake
def _sync_unpack_fake(gathered, index, segment, like, group_name, mask_own_rows):
    return like.new_empty((index.shape[0] * like.shape[0], *like.shape[1:]))


# ---------------------------------------------------------------------------------------------
# Context-addressed caches: fetched at run time through a registered resolver
# ---------------------------------------------------------------------------------------------
#
# An op such as vLLM's ``unified_kv_cache_update(key, value, layer_name)`` writes a cache the
# graph never sees: it fetches it (and its slot mapping) from the engine's per-step context by
# the handle. Its sync resolves the same handle through the pattern's resolver, at run time:
#
#     rows, slots = pcppass.sync_context_rows(resolver, handle, cache, slots, layout, key, [token])
#     packed      = pcppass.sync_pack(fp, ..., payloads=[..., rows, slots])     # as payloads
#     ...all-gather, read header...
#     token2      = pcppass.sync_scatter_context(gathered, index, after, resolver, handle, cache, ...)
#
# ``token`` (the op's own dependency result) orders the read after the owner's write; ``after``
# orders the scatter after what must read the caches first. The scatter mutates no graph tensor,
# so it is registered as side-effectful: functionalization and dead-code elimination (AOT,
# Inductor) keep it; it returns an empty token that later readers of the cache can wait on.


def context_tensors(resolver: str, handle: str) -> dict[str, torch.Tensor]:
    """The tensors the resolver registered as ``resolver`` returns for ``handle`` at run time."""
    from pcppass.errors import PcpSyncError
    from pcppass.registry import get_resolver

    found = get_resolver(resolver)
    if found is None:
        raise PcpSyncError(f"pcppass: no resolver {resolver!r} is registered to fetch the caches of "
                           f"handle {handle!r} (the integration that registers it was not imported)")
    return dict(found.resolve(handle))


def context_cache(tensors: dict[str, torch.Tensor], role: str, layout: ResolvedLayout,
                  where: str) -> torch.Tensor | None:
    """The cache ``role`` of a resolved context, checked against the layout compiled for it.

    None when the resolver returns no cache and no tensor at all: the engine has no cache for the
    handle yet (a warm-up run), so its op wrote nothing."""
    from pcppass.errors import PcpSyncError

    cache = tensors.get(role)
    if cache is None and not tensors:
        return None
    if not isinstance(cache, torch.Tensor):
        raise PcpSyncError(f"{where}: the resolver returned no tensor for cache role {role!r} "
                           f"(got {sorted(tensors)})")
    problem = layout_mismatch(cache, layout)
    if problem:
        raise PcpSyncError(f"{where}: cache role {role!r} {list(cache.shape)} {cache.dtype} does not "
                           f"match the layout the graph was compiled for ({layout}): {problem}")
    return cache


def layout_mismatch(cache: torch.Tensor, layout: ResolvedLayout) -> str:
    """Why ``cache`` cannot hold rows of ``layout`` (empty when it can).

    A paged cache's block size is read from the cache itself (an engine may size its blocks only
    after it compiled the graph): the bytes of one row must match. A block-split layout addresses
    bytes inside a block, so its block must hold every segment.
    """
    if layout.kind == "paged_rows":
        if cache.dim() < 2:
            return "a paged cache is [num_blocks, block_size, ...]"
        row = cache.element_size()
        for d in cache.shape[2:]:
            row *= int(d)
        return "" if row == layout.bytes_per_row else \
            f"{row} B per row, compiled for {layout.bytes_per_row}"
    if layout.kind == "block_split":
        block = cache.element_size()
        for d in cache.shape[1:]:
            block *= int(d)
        end = max((base + (layout.block_size - 1) * stride + length
                   for base, stride, length in layout.segments), default=0)
        return "" if end <= block and cache.is_contiguous() else \
            f"a block holds {block} B (contiguous: {cache.is_contiguous()}), the rows need {end} B"
    return f"a {layout.kind} layout cannot address a context cache"


def context_slots(tensors: dict[str, torch.Tensor], role: str, rows: int, where: str) -> torch.Tensor:
    """The slot mapping ``role`` as ``[rows]`` int64, padded with -1 (absent: every row -1, the
    op wrote nothing)."""
    from pcppass.errors import PcpSyncError

    slots = tensors.get(role)
    if slots is None:
        return torch.full((rows,), -1, dtype=torch.int64)
    slots = slots.reshape(-1)
    if slots.dtype not in (torch.int64, torch.int32) or slots.numel() > rows:
        raise PcpSyncError(f"{where}: slot mapping {role!r} is {slots.dtype} with {slots.numel()} "
                           f"entries for {rows} rows (int64, at most one per row expected)")
    out = torch.full((rows,), -1, dtype=torch.int64, device=slots.device)
    out[: slots.numel()] = slots
    return out


def _context_where(resolver: str, handle: str) -> str:
    return f"pcppass replica sync of {handle!r} (resolver {resolver!r})"


@torch.library.custom_op("pcppass::sync_context_rows", mutates_args=())
def sync_context_rows(
    resolver: str,
    handle: str,
    cache_role: str,
    slots_role: str,
    layout: list[int],
    rows_like: torch.Tensor,
    after: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows a context-addressed op wrote: ``([n, bytes_per_row]`` uint8, zeros at slot -1;
    ``[n]`` int64 slots, -1-padded), ``n = rows_like.shape[0]``. ``after`` (the op's token)
    only orders this read after the write."""
    (lay,) = decode_layouts(layout)
    where = _context_where(resolver, handle)
    tensors = context_tensors(resolver, handle)
    cache = context_cache(tensors, cache_role, lay, where)
    n = rows_like.shape[0]
    if cache is None:  # nothing written
        return (torch.zeros(n, lay.bytes_per_row, dtype=torch.uint8, device=rows_like.device),
                torch.full((n,), -1, dtype=torch.int64, device=rows_like.device))
    slots = context_slots(tensors, slots_role, n, where).to(cache.device)
    limit = num_slots(cache, lay)
    bad = slots[(slots < -1) | (slots >= limit)]
    if bad.numel():
        from pcppass.errors import PcpSyncError

        raise PcpSyncError(f"{where}: slot {int(bad[0])} of {slots_role!r} is outside [-1, {limit})")
    rows = torch.zeros(n, lay.bytes_per_row, dtype=torch.uint8, device=cache.device)
    valid = slots >= 0
    if bool(valid.any()):
        rows[valid] = read_rows(cache, slots[valid], lay)
    return rows, slots


@sync_context_rows.register_fake
def _sync_context_rows_fake(resolver, handle, cache_role, slots_role, layout, rows_like, after):
    (lay,) = decode_layouts(layout)
    n = rows_like.shape[0]
    return (rows_like.new_empty((n, lay.bytes_per_row), dtype=torch.uint8),
            rows_like.new_empty((n,), dtype=torch.int64))


@torch.library.custom_op("pcppass::sync_scatter_context", mutates_args=())
def sync_scatter_context(
    gathered: torch.Tensor,
    index: torch.Tensor,
    after: list[torch.Tensor],
    resolvers: str,
    handles: str,
    cache_roles: str,
    rows_segments: list[int],
    slots_segments: list[int],
    layouts: list[int],
    group_name: str,
    sites: str,
    check_conflicts: bool,
) -> torch.Tensor:
    """:func:`sync_scatter_rows_all` for context-addressed caches: cache ``i`` is resolved at run
    time through line ``i`` of ``resolvers``, ``handles`` and ``cache_roles`` (one per line, like
    ``sites``) and checked against the i-th layout before any row is written. ``after`` only
    orders the scatter after what produced those tensors (no graph edge says it reads the caches).
    Returns an empty token."""
    decoded = decode_layouts(layouts)
    count = len(decoded)
    lines = [site_labels(text, count) for text in (resolvers, handles, cache_roles, sites)]
    if not (len(rows_segments) == len(slots_segments) == count):
        raise ValueError("sync_scatter_context: segments and layouts differ in length")
    caches = [
        context_cache(context_tensors(r, h), role, lay, _context_where(r, h))
        for r, h, role, lay in zip(lines[0], lines[1], lines[2], decoded)
    ]
    for cache, rows_segment, slots_segment, lay, site in zip(caches, rows_segments, slots_segments,
                                                             decoded, lines[3]):
        if cache is None:
            _require_no_rows(gathered, index, slots_segment, site)
            continue
        scatter_rows_reference(cache, gathered, index, rows_segment, slots_segment,
                               encode_layout(lay), group_name, site, check_conflicts)
    return gathered.new_empty((0,))


def _require_no_rows(gathered: torch.Tensor, index: torch.Tensor, slots_segment: int, site: str) -> None:
    """This rank has no cache for a handle: no rank may have written a row into it."""
    from pcppass.errors import PcpSyncError

    for r, slots in enumerate(every_rank_slots(gathered, index, slots_segment)):
        if bool((slots >= 0).any()):
            raise PcpSyncError(f"{site}: rank {r} wrote rows into a cache this rank does not have yet")


@sync_scatter_context.register_fake
def _sync_scatter_context_fake(gathered, index, after, resolvers, handles, cache_roles, rows_segments,
                               slots_segments, layouts, group_name, sites, check_conflicts):
    return gathered.new_empty((0,))


# It writes state no graph tensor stands for: keep it through AOT's and Inductor's dead-code
# elimination (an op with no mutated argument and an unused result is otherwise dropped).
torch.fx.node.has_side_effect(torch.ops.pcppass.sync_scatter_context.default)
