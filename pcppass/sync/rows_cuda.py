"""CUDA kernels for the replica-sync ops with no host synchronisation (CUDA-graph capturable).

The reference implementations in :mod:`pcppass.sync.rows` read sizes and offsets back to the
host (``bool(valid.any())``, ``index.tolist()``, ``gathered[:head].cpu()``), select rows with
boolean masks and raise on bad slots or headers. Each of those waits for the GPU, and none can be
recorded in a CUDA graph. The kernels here produce the same bytes with device-side selection
only, and do the same checks on the device (:mod:`pcppass.sync.device_checks`: errors are
recorded in host-mapped status words and raised before the next step):

* ``sync_pack`` (:func:`pack_batched`): ONE Triton launch writes the header, every cache's rows
  (16-byte words where the layout allows, many rows per program; zeros for slot -1; a slot out of
  range is recorded and packed as zeros) and the payloads (:mod:`pcppass.sync.row_kernels`);
* ``sync_read_header``: the segment table comes from the sizes this rank packed (every rank packs
  the same sizes: that is what the header check enforces), as a cached device tensor whose host
  copy stays known, so the ops after it slice ``gathered`` without reading the device. With
  ``verify`` the ops that read the table compare every rank's header with this rank's on the
  device. If the sizes are unknown or ambiguous, the table is computed on the device from the
  gathered headers and the later ops read it back (correct, not capturable; with ``verify`` the
  reference checks on the host);
* ``sync_scatter_rows_all`` (:func:`scatter_rows_all`): with checks, one launch compares headers
  and every slot with the other ranks' (two owners of one row), then ONE launch writes every
  other rank's rows into every cache: nothing at all if a header differs, zeros on every replica
  for a slot two ranks wrote, never a slot out of range;
* ``sync_scatter_rows`` (one cache, ``check_conflicts=False``): plain torch; padding rows are
  redirected to repeat a real row of the same rank (same slot, same bytes), or, when the rank sent
  no real row, to rewrite slot 0 with the bytes it already holds;
* ``sync_unpack``: the reference computation with host-known offsets (slot mappings of a verified
  sync whose headers differ read -1).

Caches the kernels cannot address, or more than ``row_kernels.MAX_ARGS`` distinct slot and
payload tensors, take the plain-torch paths (the reference ops where a check is on). Warm the step
up once before capturing it (tables, headers and index constants are created on first use).

Importing this module registers the kernels for the ``cuda`` device type; :func:`kernels_enabled`
switches them off and on (the reference implementations run while they are off).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from pcppass.sync import row_kernels, rows
from pcppass.sync.rows import (
    _encode_header,
    _group_rank,
    decode_layouts,
    decode_pack_layouts,
    encode_layout,
    header_bytes,
    payload_bytes,
    read_rows,
    write_rows,
)
from pcppass.sync import device_checks
from pcppass.sync.stats import SYNC_COUNTERS
from pcppass.spec import ResolvedLayout

#: (device, fingerprint, segment sizes) -> header bytes on that device
_HEADERS: dict[tuple, torch.Tensor] = {}
#: (fingerprint, num_segments, packed bytes) -> every segment-size tuple packed under that key
_PACKED_SIZES: dict[tuple[str, int, int], set[tuple[int, ...]]] = {}
#: (device, world, chunk, segment sizes) -> [world, num_segments, 2] segment table on the device
_INDEX: dict[tuple, torch.Tensor] = {}
#: data_ptr of a cached segment table -> the same table as nested lists on the host
_INDEX_HOST: dict[int, list[list[list[int]]]] = {}


# ---------------------------------------------------------------------------------------------
# Implementations (plain torch on whatever device the tensors live; no host reads)
# ---------------------------------------------------------------------------------------------


def cached_header(fingerprint: str, sizes: list[int], device: torch.device) -> torch.Tensor:
    """The sync header of ``sizes`` on ``device``, built once (a captured graph replays it)."""
    key = (device, fingerprint, tuple(sizes))
    head = _HEADERS.get(key)
    if head is None:
        head = _HEADERS[key] = _encode_header(fingerprint, sizes, device)
    return head


def _padded_rows(cache: torch.Tensor, slots: torch.Tensor, layout: ResolvedLayout) -> torch.Tensor:
    """``[n, bytes_per_row]``: the row at each slot, zeros where the slot is negative."""
    if slots.numel() == 0:
        return torch.zeros(0, layout.bytes_per_row, dtype=torch.uint8, device=cache.device)
    valid = slots >= 0
    found = read_rows(cache, slots.clamp(min=0), layout)
    return torch.where(valid[:, None], found, torch.zeros((), dtype=torch.uint8, device=cache.device))


def pack(
    fingerprint: str,
    caches: list[torch.Tensor],
    cache_slots: list[torch.Tensor],
    layouts: list[int],
    payloads: list[torch.Tensor],
) -> torch.Tensor:
    """``sync_pack`` without host reads (same bytes as :func:`pcppass.sync.rows.sync_pack`)."""
    decoded = decode_pack_layouts(caches, cache_slots, layouts)
    anchor = caches[0] if caches else payloads[0]
    segments = [_padded_rows(c, s.reshape(-1), lay).reshape(-1)
                for c, s, lay in zip(caches, cache_slots, decoded)]
    segments.extend(payload_bytes(t) for t in payloads)
    sizes = [s.numel() for s in segments]
    total = header_bytes(len(sizes)) + sum(sizes)
    _PACKED_SIZES.setdefault((fingerprint, len(sizes), total), set()).add(tuple(sizes))
    return torch.cat([cached_header(fingerprint, sizes, anchor.device), *segments])


def _host_table(world: int, chunk: int, head_len: int, sizes: tuple[int, ...]) -> list:
    table = []
    for r in range(world):
        offset, per_rank = r * chunk + head_len, []
        for size in sizes:
            per_rank.append([offset, size])
            offset += size
        table.append(per_rank)
    return table


def _device_table(gathered: torch.Tensor, world: int, chunk: int, num_segments: int) -> torch.Tensor:
    """The segment table computed on the device from every rank's header."""
    head_len = header_bytes(num_segments)
    first = head_len - 8 * num_segments
    sizes = gathered.view(world, chunk)[:, first:head_len].contiguous().view(torch.int64)
    starts = torch.arange(world, device=gathered.device, dtype=torch.int64)[:, None] * chunk + head_len
    offsets = torch.cumsum(sizes, 1) - sizes + starts
    return torch.stack([offsets, sizes], dim=-1)


def read_header(
    gathered: torch.Tensor, world_size: int, fingerprint: str, num_segments: int, verify: bool
) -> torch.Tensor:
    """``sync_read_header`` without host reads: the segment table of the sizes this rank packed.
    With ``verify`` the ops reading the table check every rank's header on the device
    (:func:`scatter_rows_all`, :func:`unpack`); if the sizes packed under this fingerprint are not
    known (or ambiguous), the table comes from the device, and with ``verify`` the reference
    implementation checks on the host."""
    chunk = gathered.numel() // world_size
    known = _PACKED_SIZES.get((fingerprint, num_segments, chunk), set())
    if len(known) != 1:
        if verify:
            return rows.sync_read_header._init_fn(gathered, world_size, fingerprint, num_segments, verify)
        SYNC_COUNTERS.record(chunk, world_size)
        return _device_table(gathered, world_size, chunk, num_segments)
    SYNC_COUNTERS.record(chunk, world_size)
    (sizes,) = known
    key = (gathered.device, world_size, chunk, sizes)
    index = _INDEX.get(key)
    if index is None:
        table = _host_table(world_size, chunk, header_bytes(num_segments), sizes)
        index = _INDEX[key] = torch.tensor(table, dtype=torch.int64, device=gathered.device)
        _INDEX_HOST[index.data_ptr()] = table
    _VERIFY[index.data_ptr()] = verify
    return index


def _table(index: torch.Tensor) -> list:
    table = _INDEX_HOST.get(index.data_ptr())
    return table if table is not None else index.tolist()


def scatter_rows(
    cache: torch.Tensor,
    gathered: torch.Tensor,
    index: torch.Tensor,
    rows_segment: int,
    slots_segment: int,
    layout: list[int],
    group_name: str,
    site: str,
    check_conflicts: bool,
    verdict: torch.Tensor | None = None,
) -> None:
    """``sync_scatter_rows``; checking its own slots (no ``verdict``, ``check_conflicts``), the
    reference implementation. With a verdict, nothing is applied where it refused the step
    (decided on the device: padding rows and refused steps rewrite a row with its own bytes)."""
    if verdict is None and check_conflicts:
        rows.sync_scatter_rows._init_fn(cache, gathered, index, rows_segment, slots_segment, layout,
                                        group_name, site, check_conflicts)
        return
    (lay,) = decode_layouts(layout)
    table = _table(index)
    me = _group_rank(group_name)
    stands = verdict[:1] == 0 if verdict is not None else None
    for r in range(len(table)):
        if r == me:
            continue
        offset, size = table[r][slots_segment]
        slots = gathered[offset:offset + size].clone().view(torch.int64)
        n = slots.numel()
        if n == 0:
            continue
        offset, size = table[r][rows_segment]
        sent = gathered[offset:offset + size].view(n, lay.bytes_per_row)
        valid = slots >= 0
        if stands is not None:
            valid = valid & stands
        first = valid.to(torch.int8).argmax().reshape(1)  # first real row (0 when there is none)
        any_valid = valid.index_select(0, first)
        zero = torch.zeros(1, dtype=torch.int64, device=slots.device)
        filler_slot = torch.where(any_valid, slots.index_select(0, first), zero)
        filler_row = torch.where(any_valid[:, None], sent.index_select(0, first), read_rows(cache, zero, lay))
        write_rows(cache, torch.where(valid, slots, filler_slot),
                   torch.where(valid[:, None], sent, filler_row), lay)


def unpack(
    gathered: torch.Tensor,
    index: torch.Tensor,
    segment: int,
    like: torch.Tensor,
    group_name: str,
    mask_own_rows: bool,
    verdict: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sync_unpack`` slicing with host-known offsets. A slot mapping (``mask_own_rows``) reads
    -1 for every rank when the ``verdict`` refused the step, or (no verdict) when the sync is
    verified and its headers differ (checked on the device): the re-run then writes nothing, on
    every rank."""
    table = _table(index)
    parts = []
    for r in range(len(table)):
        offset, size = table[r][segment]
        parts.append(gathered[offset:offset + size].clone().view(like.dtype).view(like.shape))
    if mask_own_rows:
        parts[_group_rank(group_name)] = torch.full_like(parts[0], -1)
    every_rank = torch.cat(parts, dim=0)
    if mask_own_rows and verdict is not None:
        every_rank = torch.where(verdict[:1] != 0, torch.full_like(every_rank, -1), every_rank)
    elif mask_own_rows and _VERIFY.get(index.data_ptr(), False):
        differs = _headers_differ(gathered, index, _group_rank(group_name))
        every_rank = torch.where(differs, torch.full_like(every_rank, -1), every_rank)
    return every_rank


def _headers_differ(gathered: torch.Tensor, index: torch.Tensor, me: int) -> torch.Tensor:
    """A device bool: does any rank's header differ from this rank's (also recorded in the status)."""
    world = index.shape[0]
    key = ("headers", gathered.device, world, index.data_ptr())
    tiles = row_kernels.tile_table(key, gathered.device, lambda: ([], row_kernels.check_tables([], world)))
    row_kernels.check(row_kernels.Chunks(gathered, 0, gathered.numel() // world), tiles, me, world,
                      header_bytes(index.shape[1]), False)
    return tiles.extra["verdict"][:1] != 0


# ---------------------------------------------------------------------------------------------
# One launch for all caches (Triton, pcppass.sync.row_kernels)
# ---------------------------------------------------------------------------------------------


def pack_batched(
    fingerprint: str,
    caches: list[torch.Tensor],
    cache_slots: list[torch.Tensor],
    layouts: list[int],
    payloads: list[torch.Tensor],
) -> torch.Tensor:
    """``sync_pack`` in ONE kernel launch: header, every cache's rows (16-byte words where the
    layout allows, many rows per program, out-of-range slots recorded in the device status) and
    the payloads (same bytes as :func:`pack`); caches the kernel cannot address, or more than
    ``row_kernels.MAX_ARGS`` distinct slot and payload tensors, go through :func:`pack`."""
    decoded = decode_pack_layouts(caches, cache_slots, layouts)
    addressings = [row_kernels.addressing(c, lay) for c, lay in zip(caches, decoded)]
    args = row_kernels.ArgTable()
    slot_args = [args.add(s) for s in cache_slots]
    payload_args = [args.add(p) for p in payloads]
    devices = {t.device for t in (*caches, *args.tensors)}
    if (not caches or any(a is None for a in addressings) or len(devices) != 1
            or len(args.tensors) > row_kernels.MAX_ARGS or any(s.dtype != torch.int64 for s in cache_slots)):
        return pack(fingerprint, caches, cache_slots, layouts, payloads)
    (device,) = devices
    counts = [s.numel() for s in cache_slots]
    sizes = [n * lay.bytes_per_row for n, lay in zip(counts, decoded)]
    sizes += [p.numel() * p.element_size() for p in payloads]
    head = cached_header(fingerprint, sizes, device)
    offsets, total = [], head.numel()
    for size in sizes:
        offsets.append(total)
        total += size
    _PACKED_SIZES.setdefault((fingerprint, len(sizes), total), set()).add(tuple(sizes))
    out = torch.empty(total, dtype=torch.uint8, device=device)
    launch_args = row_kernels.byte_args(args.tensors, out)
    key = ("pack", row_kernels.cache_key(caches), tuple(layouts), tuple(counts), tuple(slot_args),
           tuple(payload_args), tuple(sizes[len(caches):]), row_kernels.alignment_key(launch_args),
           head.data_ptr(), out.data_ptr() % 16)

    def build():
        entries = [row_kernels.bytes_entry(kind=row_kernels.ADDRESS_BYTES, source=head.data_ptr(),
                                           nbytes=head.numel(), buf=0, aligned_with=(out.data_ptr(),))]
        for i, (cache, addr) in enumerate(zip(caches, addressings)):
            what = device_checks.label(f"sync_pack: cache #{i} {tuple(cache.shape)} {cache.dtype}")
            for piece in row_kernels.pieces(cache, addr):
                entries.append(row_kernels.rows_entry(
                    piece, rows=counts[i], buf=offsets[i] + piece.packed, arg=slot_args[i], label=what,
                    aligned_with=(out.data_ptr(), offsets[i] + piece.packed, piece.bytes_per_row)))
        for k, arg in enumerate(payload_args):
            o = offsets[len(caches) + k]
            if sizes[len(caches) + k]:
                entries.append(row_kernels.bytes_entry(
                    kind=row_kernels.ARG_BYTES, arg=arg, nbytes=sizes[len(caches) + k], buf=o,
                    aligned_with=(out.data_ptr(), launch_args[arg].data_ptr())))
        return entries, {}

    row_kernels.pack(out, row_kernels.tile_table(key, device, build), launch_args, -1)
    return out


#: data_ptr of a cached segment table -> whether its headers are verified (sync_read_header's flag)
_VERIFY: dict[int, bool] = {}


def _slot_segments(slots_segments: list[int]) -> list[int]:
    """Distinct slot segments in order of first use."""
    return list(dict.fromkeys(slots_segments))


def _received_rows_entries(caches, addressings, decoded, labels, rows_segments, slots_segments, table, me,
                           gathered: torch.Tensor) -> list[list[int]]:
    """Scatter-table entries of every other rank's rows of every cache, from the gathered buffer."""
    entries = []
    for cache, addr, rs, ss, lay, site in zip(caches, addressings, rows_segments, slots_segments, decoded, labels):
        what = device_checks.label(site)
        for r in range(len(table)):
            if r == me:
                continue
            rows_offset, rows_size = table[r][rs]
            slots_offset, slots_size = table[r][ss]
            n = slots_size // 8
            if rows_size != n * lay.bytes_per_row:
                raise ValueError(f"sync_scatter_rows_all: rank {r} sent {rows_size} row bytes for {n} slots "
                                 f"of {lay.bytes_per_row} bytes")
            for piece in row_kernels.pieces(cache, addr):
                entries.append(row_kernels.rows_entry(
                    piece, rows=n, buf=rows_offset + piece.packed, slot=slots_offset,
                    arg=row_kernels.word_width(gathered.data_ptr() + slots_offset, 8), label=what, rank=r,
                    aligned_with=(gathered.data_ptr(), rows_offset + piece.packed, lay.bytes_per_row)))
    return entries


def _check_segments(entry_caches: list[int], caches: list[torch.Tensor], decoded: list[ResolvedLayout],
                    slots_segments: list[int], labels: list[str], table: list, gathered: torch.Tensor,
                    world: int) -> list[tuple[int, ...]]:
    """``row_kernels.check_tables`` rows of the distinct slot segments: each segment's group is
    its cache's (segments of one cache are compared with each other), its slot count the smallest
    of the caches it addresses."""
    chunk = gathered.numel() // world
    segs = _slot_segments(slots_segments)
    out = []
    for seg in segs:
        users = [k for k, s in enumerate(slots_segments) if s == seg]
        offset = table[0][seg][0]
        limit = min(rows.num_slots(caches[entry_caches[k]], decoded[k]) for k in users)
        out.append((table[0][seg][1] // 8, device_checks.label(labels[users[0]]), offset,
                    row_kernels.word_width(gathered.data_ptr() + offset, chunk, 8), entry_caches[users[0]], limit))
    return out


def _views_overlap(caches: list[torch.Tensor]) -> bool:
    """Two distinct views of one storage among ``caches`` (the device checks compare slots, not
    bytes: such caches take the reference checks)."""
    seen: dict[tuple, tuple] = {}
    for c in caches:
        key = (c.device, c.untyped_storage().data_ptr())
        geometry = (c.storage_offset(), tuple(c.shape), c.stride(), c.dtype)
        if seen.setdefault(key, geometry) != geometry:
            return True
    return False


def scatter_rows_all(
    caches: list[torch.Tensor],
    gathered: torch.Tensor,
    index: torch.Tensor,
    rows_segments: list[int],
    slots_segments: list[int],
    layouts: list[int],
    group_name: str,
    sites: str,
    check_conflicts: bool,
    verdict: torch.Tensor | None = None,
) -> None:
    """``sync_scatter_rows_all`` with no host reads: ONE scatter launch for every cache, which
    applies nothing when ``verdict`` refused the step. Without a verdict and with checks
    (``check_conflicts``, or headers verified by ``sync_read_header``) one check launch decides
    first (see :mod:`pcppass.sync.device_checks` for what an error does). Caches the kernel
    cannot address go through :func:`scatter_rows`, one by one; unchecked overlapping views, or
    an unknown segment table, through the reference op."""
    decoded = decode_layouts(layouts)
    labels = rows.site_labels(sites, len(caches))
    if not (len(caches) == len(rows_segments) == len(slots_segments) == len(decoded)):
        raise ValueError("sync_scatter_rows_all: caches, segments and layouts differ in length")
    addressings = [row_kernels.addressing(c, lay) for c, lay in zip(caches, decoded)]
    host_known = index.data_ptr() in _INDEX_HOST
    verify = host_known and _VERIFY.get(index.data_ptr(), False)
    checks = verdict is None and (verify or check_conflicts)
    if checks and (not host_known or _views_overlap(caches)):
        rows.sync_scatter_rows_all._init_fn(caches, gathered, index, rows_segments, slots_segments, layouts,
                                            group_name, sites, check_conflicts, verdict)
        return
    if any(a is None for a in addressings):
        if checks:  # decide once for every cache, then apply cache by cache
            verdict = _checked(caches, gathered, index, slots_segments, decoded, labels, group_name, check_conflicts)
        for cache, rs, ss, lay, site in zip(caches, rows_segments, slots_segments, decoded, labels):
            scatter_rows(cache, gathered, index, rs, ss, encode_layout(lay), group_name, site, False, verdict)
        return
    me = _group_rank(group_name)
    table = _table(index)

    def build():
        entries = _received_rows_entries(caches, addressings, decoded, labels, rows_segments, slots_segments,
                                         table, me, gathered)
        return entries, {}

    # a cached segment table is identified by its address; any other is identified by its values
    where = index.data_ptr() if host_known else str(table)
    key = ("scatter", row_kernels.cache_key(caches), tuple(layouts), tuple(rows_segments), tuple(slots_segments),
           me, where, gathered.data_ptr() % 16, sites)
    tiles = row_kernels.tile_table(key, gathered.device, build)
    if checks:
        verdict = _checked(caches, gathered, index, slots_segments, decoded, labels, group_name, check_conflicts)
    row_kernels.scatter(gathered, tiles, verdict)


def _checked(caches: list[torch.Tensor], gathered: torch.Tensor, index: torch.Tensor, slots_segments: list[int],
             decoded: list[ResolvedLayout], labels: list[str], group_name: str, conflicts: bool) -> torch.Tensor:
    """One check launch over the slot segments of ``caches`` (cache ``i`` with segment ``i``):
    the device verdict (1: headers differ, a slot outside its cache, a row two ranks wrote)."""
    table = _table(index)
    world = len(table)
    me = _group_rank(group_name)
    segs = _check_segments(list(range(len(caches))), caches, decoded, slots_segments, labels, table, gathered, world)
    key = ("checks", row_kernels.cache_key(caches), tuple(slots_segments),
           tuple(tuple(encode_layout(x)) for x in decoded),
           index.data_ptr(), gathered.data_ptr() % 16, tuple(labels), conflicts)
    tiles = row_kernels.tile_table(key, gathered.device, lambda: ([], row_kernels.check_tables(segs, world)))
    row_kernels.check(row_kernels.Chunks(gathered, 0, gathered.numel() // world), tiles, me, world,
                      header_bytes(index.shape[1]), conflicts)
    return tiles.extra["verdict"]


# ---------------------------------------------------------------------------------------------
# Snapshot and verdict (a refused step writes back what this rank wrote; nothing is applied)
# ---------------------------------------------------------------------------------------------


def snapshot_batched(caches: list[torch.Tensor], cache_slots: list[torch.Tensor], layouts: list[int]) -> torch.Tensor:
    """``sync_snapshot`` in ONE pack launch (same bytes as :func:`pcppass.sync.rows.sync_snapshot`):
    every cache's rows at this rank's slots, then the slots as int64 (converted on the device when
    they are narrower). Caches the kernel cannot address take the reference op."""
    decoded = decode_pack_layouts(caches, cache_slots, layouts)
    addressings = [row_kernels.addressing(c, lay) for c, lay in zip(caches, decoded)]
    wide: dict[int, torch.Tensor] = {}
    slots64 = [wide.setdefault(id(s), s.reshape(-1) if s.dtype == torch.int64 else s.reshape(-1).to(torch.int64))
               for s in cache_slots]
    args = row_kernels.ArgTable()
    slot_args = [args.add(s) for s in slots64]
    devices = {t.device for t in (*caches, *args.tensors)}
    if (not caches or any(a is None for a in addressings) or len(devices) != 1
            or len(args.tensors) > row_kernels.MAX_ARGS):
        return rows.sync_snapshot._init_fn(caches, cache_slots, layouts)  # remembers it too
    (device,) = devices
    counts = [s.numel() for s in slots64]
    rows_at, slots_at = rows._cache_rows_offsets(slots64, decoded)
    total = slots_at[-1] + 8 * counts[-1]
    out = torch.empty(total, dtype=torch.uint8, device=device)
    launch_args = row_kernels.byte_args(args.tensors, out)
    key = ("snapshot", row_kernels.cache_key(caches), tuple(layouts), tuple(counts), tuple(slot_args),
           row_kernels.alignment_key(launch_args), out.data_ptr() % 16)

    def build():
        entries = []
        for i, (cache, addr) in enumerate(zip(caches, addressings)):
            what = device_checks.label(f"sync_snapshot: cache #{i} {tuple(cache.shape)} {cache.dtype}")
            for piece in row_kernels.pieces(cache, addr):
                entries.append(row_kernels.rows_entry(
                    piece, rows=counts[i], buf=rows_at[i] + piece.packed, arg=slot_args[i], label=what,
                    aligned_with=(out.data_ptr(), rows_at[i] + piece.packed, piece.bytes_per_row)))
            if counts[i]:
                entries.append(row_kernels.bytes_entry(
                    kind=row_kernels.ARG_BYTES, arg=slot_args[i], nbytes=8 * counts[i], buf=slots_at[i],
                    aligned_with=(out.data_ptr(), launch_args[slot_args[i]].data_ptr())))
        return entries, {}

    row_kernels.pack(out, row_kernels.tile_table(key, device, build), launch_args, -1)
    return rows.remember_snapshot(caches, cache_slots, layouts, out)


def verdict(
    caches: list[torch.Tensor],
    gathered: torch.Tensor,
    index: torch.Tensor,
    world_size: int,
    fingerprint: str,
    num_segments: int,
    verify_header: bool,
    entry_caches: list[int],
    slots_segments: list[int],
    layouts: list[int],
    sites: str,
    check_conflicts: bool,
    snapshots: list[torch.Tensor],
    snapshot_slots: list[torch.Tensor],
    snapshot_caches: list[int],
    snapshot_layouts: list[int],
    snapshot_counts: list[int],
    group_name: str,
) -> torch.Tensor:
    """``sync_verdict`` with no host reads: one check launch over every slot segment (headers,
    ranges, two owners across every segment of one cache) sets the device verdict and the status;
    one scatter launch per snapshot (latest first) writes the snapshot back only where the verdict
    refused the step. Distinct views of one storage, caches the kernels cannot address, or an
    unknown segment table take the reference op (host reads; it raises)."""
    rows.verdict_taken()
    decoded = decode_layouts(layouts)
    restored = decode_layouts(snapshot_layouts)
    addressable = all(row_kernels.addressing(caches[c], lay) is not None
                      for c, lay in zip(snapshot_caches, restored))
    if index.data_ptr() not in _INDEX_HOST or _views_overlap(caches) or not addressable:
        return rows.sync_verdict._init_fn(caches, gathered, index, world_size, fingerprint, num_segments, verify_header,
                                          entry_caches, slots_segments, layouts, sites, check_conflicts, snapshots,
                                          snapshot_slots, snapshot_caches, snapshot_layouts, snapshot_counts,
                                          group_name)
    table = _table(index)
    world = len(table)
    me = _group_rank(group_name)
    labels = rows.site_labels(sites, len(entry_caches))
    segs = _check_segments(entry_caches, caches, decoded, slots_segments, labels, table, gathered, world)
    key = ("verdict", row_kernels.cache_key(caches), tuple(layouts), tuple(entry_caches), tuple(slots_segments),
           index.data_ptr(), gathered.data_ptr() % 16, sites, check_conflicts)
    tiles = row_kernels.tile_table(key, gathered.device, lambda: ([], row_kernels.check_tables(segs, world)))
    row_kernels.check(row_kernels.Chunks(gathered, 0, gathered.numel() // world), tiles, me, world,
                      header_bytes(num_segments), check_conflicts)
    decision = tiles.extra["verdict"]
    start = 0
    groups = []
    for snapshot, count in zip(snapshots, snapshot_counts):
        groups.append((snapshot, range(start, start + count)))
        start += count
    for snapshot, part in reversed(groups):
        _write_back(snapshot, [caches[snapshot_caches[e]] for e in part], [restored[e] for e in part],
                    [snapshot_slots[e].numel() for e in part], me, decision)
    return decision


def _write_back(snapshot: torch.Tensor, caches: list[torch.Tensor], decoded: list[ResolvedLayout], counts: list[int],
                me: int, decision: torch.Tensor) -> None:
    """One scatter launch: the snapshot's rows at its slots, applied only if ``decision`` refused."""
    addressings = [row_kernels.addressing(c, lay) for c, lay in zip(caches, decoded)]
    sizes = [torch.empty(n, dtype=torch.int64, device="meta") for n in counts]
    rows_at, slots_at = rows._cache_rows_offsets(sizes, decoded)

    def build():
        entries = []
        for i, (cache, addr) in enumerate(zip(caches, addressings)):
            what = device_checks.label(f"sync_verdict: write-back of cache #{i} {tuple(cache.shape)} {cache.dtype}")
            for piece in row_kernels.pieces(cache, addr):
                entries.append(row_kernels.rows_entry(
                    piece, rows=counts[i], buf=rows_at[i] + piece.packed, slot=slots_at[i],
                    arg=row_kernels.word_width(snapshot.data_ptr() + slots_at[i], 8), label=what, rank=me,
                    aligned_with=(snapshot.data_ptr(), rows_at[i] + piece.packed, piece.bytes_per_row)))
        return entries, {}

    key = ("write-back", row_kernels.cache_key(caches), tuple(tuple(encode_layout(x)) for x in decoded), tuple(counts),
           snapshot.data_ptr() % 16, me)
    row_kernels.scatter(snapshot, row_kernels.tile_table(key, snapshot.device, build), decision, when_refused=True)


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------

_KERNELS = (
    (rows.sync_pack, pack_batched),
    (rows.sync_read_header, read_header),
    (rows.sync_scatter_rows, scatter_rows),
    (rows.sync_scatter_rows_all, scatter_rows_all),
    (rows.sync_unpack, unpack),
    (rows.sync_snapshot, snapshot_batched),
    (rows.sync_verdict, verdict),
)

for _op, _kernel in _KERNELS:
    _op.register_kernel("cuda", _kernel)


@contextlib.contextmanager
def kernels_enabled(enabled: bool) -> Iterator[None]:
    """Run the block with these CUDA kernels on (``True``) or with the reference ops (``False``)."""
    with contextlib.ExitStack() as stack:
        for op, _ in _KERNELS:
            if ("cuda" not in op._disabled_kernel) != enabled:  # torch warns on a no-op switch
                stack.enter_context(op.set_kernel_enabled("cuda", enabled))
        yield
