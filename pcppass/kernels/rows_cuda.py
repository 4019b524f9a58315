"""CUDA kernels for the replica-sync ops with no host synchronisation (CUDA-graph capturable).

The reference implementations in :mod:`pcppass.kernels.rows` read sizes and offsets back to the
host (``bool(valid.any())``, ``index.tolist()``, ``gathered[:head].cpu()``) and select rows with
boolean masks. Each of those waits for the GPU, and none can be recorded in a CUDA graph. The
kernels here produce the same bytes with device-side selection only:

* :func:`pack` (torch ``sync_pack``): every row is read (slot -1 clamped to 0) and padding rows are zeroed with
  ``where``; the header is a device constant cached per (fingerprint, segment sizes).
* ``sync_read_header`` (``verify=False``): the segment table comes from the sizes this rank packed
  (every rank packs the same sizes: that is the contract the header check enforces), as a cached
  device tensor whose host copy stays known, so the ops after it slice ``gathered`` without
  reading the device. If the sizes are unknown or ambiguous, the table is computed on the device
  from the gathered headers and the later ops read it back (correct, not capturable).
* ``sync_scatter_rows`` (``check_conflicts=False``): padding rows are not skipped by compaction but
  redirected to repeat a real row of the same rank (same slot, same bytes: a duplicate store of
  identical bytes is deterministic), or, when the rank sent no real row, to rewrite slot 0 with
  the bytes it already holds.
* ``sync_unpack``: the reference computation with host-known offsets.
* ``sync_pack`` (registered kernel: :func:`pack_batched`) and ``sync_scatter_rows_all``: ONE Triton
  launch each for all caches of the collective (:mod:`pcppass.kernels.row_kernels`), padding rows
  masked in the kernel; caches the kernels cannot address take the torch paths above.

With ``verify=True`` or ``check_conflicts=True`` the reference implementation runs: raising on a
mismatch needs the values on the host. Warm the step up once before capturing it (the header
and index constants are created on first use).

Importing this module registers the kernels for the ``cuda`` device type; :func:`kernels_enabled`
switches them off and on (the reference implementations run while they are off).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from pcppass.kernels import row_kernels, rows
from pcppass.kernels.rows import (
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
from pcppass.runtime.stats import SYNC_COUNTERS
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


def _cached_header(fingerprint: str, sizes: list[int], device: torch.device) -> torch.Tensor:
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
    """``sync_pack`` without host reads (same bytes as :func:`pcppass.kernels.rows.sync_pack`)."""
    decoded = decode_pack_layouts(caches, cache_slots, layouts)
    anchor = caches[0] if caches else payloads[0]
    segments = [_padded_rows(c, s.reshape(-1), lay).reshape(-1)
                for c, s, lay in zip(caches, cache_slots, decoded)]
    segments.extend(payload_bytes(t) for t in payloads)
    sizes = [s.numel() for s in segments]
    total = header_bytes(len(sizes)) + sum(sizes)
    _PACKED_SIZES.setdefault((fingerprint, len(sizes), total), set()).add(tuple(sizes))
    return torch.cat([_cached_header(fingerprint, sizes, anchor.device), *segments])


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
    """``sync_read_header``; with ``verify`` the reference implementation (it raises on mismatch)."""
    if verify:
        return rows.sync_read_header._init_fn(gathered, world_size, fingerprint, num_segments, verify)
    chunk = gathered.numel() // world_size
    SYNC_COUNTERS.record(chunk, world_size)
    known = _PACKED_SIZES.get((fingerprint, num_segments, chunk), set())
    if len(known) != 1:
        return _device_table(gathered, world_size, chunk, num_segments)
    (sizes,) = known
    key = (gathered.device, world_size, chunk, sizes)
    index = _INDEX.get(key)
    if index is None:
        table = _host_table(world_size, chunk, header_bytes(num_segments), sizes)
        index = _INDEX[key] = torch.tensor(table, dtype=torch.int64, device=gathered.device)
        _INDEX_HOST[index.data_ptr()] = table
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
) -> None:
    """``sync_scatter_rows``; with ``check_conflicts`` the reference implementation."""
    if check_conflicts:
        rows.sync_scatter_rows._init_fn(cache, gathered, index, rows_segment, slots_segment, layout,
                                        group_name, site, check_conflicts)
        return
    (lay,) = decode_layouts(layout)
    table = _table(index)
    me = _group_rank(group_name)
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
) -> torch.Tensor:
    """``sync_unpack`` slicing with host-known offsets."""
    table = _table(index)
    parts = []
    for r in range(len(table)):
        offset, size = table[r][segment]
        parts.append(gathered[offset:offset + size].clone().view(like.dtype).view(like.shape))
    if mask_own_rows:
        parts[_group_rank(group_name)] = torch.full_like(parts[0], -1)
    return torch.cat(parts, dim=0)


# ---------------------------------------------------------------------------------------------
# One launch for all caches (Triton, pcppass.kernels.row_kernels)
# ---------------------------------------------------------------------------------------------


def pack_batched(
    fingerprint: str,
    caches: list[torch.Tensor],
    cache_slots: list[torch.Tensor],
    layouts: list[int],
    payloads: list[torch.Tensor],
) -> torch.Tensor:
    """``sync_pack`` with every cache's rows read by ONE kernel launch (same bytes as
    :func:`pack`); caches the kernel cannot address go through :func:`pack`."""
    decoded = decode_pack_layouts(caches, cache_slots, layouts)
    addressings = [row_kernels.addressing(c, lay) for c, lay in zip(caches, decoded)]
    if not caches or any(a is None for a in addressings) or any(c.device != caches[0].device for c in caches):
        return pack(fingerprint, caches, cache_slots, layouts, payloads)
    device = caches[0].device
    # one int64 slot vector; caches that share a slot tensor share its rows of the vector
    first_row: dict[int, int] = {}
    distinct: list[torch.Tensor] = []
    starts, counts, total_slots = [], [], 0
    for s in cache_slots:
        if id(s) not in first_row:
            first_row[id(s)] = total_slots
            distinct.append(s.reshape(-1).to(torch.int64))
            total_slots += s.numel()
        starts.append(first_row[id(s)])
        counts.append(s.numel())
    payload_rows = [payload_bytes(t) for t in payloads]
    sizes = [n * lay.bytes_per_row for n, lay in zip(counts, decoded)]
    sizes += [b.numel() for b in payload_rows]
    head = _cached_header(fingerprint, sizes, device)
    offsets, offset = [], head.numel()
    for size in sizes:
        offsets.append(offset)
        offset += size
    _PACKED_SIZES.setdefault((fingerprint, len(sizes), offset), set()).add(tuple(sizes))
    out = torch.empty(offset, dtype=torch.uint8, device=device)
    out[:head.numel()].copy_(head)
    slots = distinct[0] if len(distinct) == 1 else torch.cat(distinct)
    key = (row_kernels.cache_key(caches), tuple(layouts), tuple(counts), tuple(starts))
    row_kernels.pack_rows(out, caches, addressings, slots.contiguous(), starts, counts,
                          offsets[:len(caches)], key)
    for b, o in zip(payload_rows, offsets[len(caches):]):
        if b.numel():
            out[o:o + b.numel()].copy_(b)
    return out


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
) -> None:
    """``sync_scatter_rows_all`` in ONE kernel launch; with ``check_conflicts`` the reference
    implementation. Caches the kernel cannot address go through :func:`scatter_rows`, one by one."""
    if check_conflicts:
        rows.sync_scatter_rows_all._init_fn(caches, gathered, index, rows_segments, slots_segments, layouts,
                                            group_name, sites, check_conflicts)
        return
    decoded = decode_layouts(layouts)
    labels = rows.site_labels(sites, len(caches))
    if not (len(caches) == len(rows_segments) == len(slots_segments) == len(decoded)):
        raise ValueError("sync_scatter_rows_all: caches, segments and layouts differ in length")
    addressings = [row_kernels.addressing(c, lay) for c, lay in zip(caches, decoded)]
    if any(a is None for a in addressings):
        for cache, rs, ss, lay, site in zip(caches, rows_segments, slots_segments, decoded, labels):
            scatter_rows(cache, gathered, index, rs, ss, encode_layout(lay), group_name, site, False)
        return
    me = _group_rank(group_name)
    host_known = index.data_ptr() in _INDEX_HOST
    table = _table(index)

    def sources() -> list[list[tuple[int, int, int]]]:
        out = []
        for rs, ss, lay in zip(rows_segments, slots_segments, decoded):
            per_cache = []
            for r in range(len(table)):
                if r == me:
                    continue
                rows_offset, rows_size = table[r][rs]
                slots_offset, slots_size = table[r][ss]
                n = slots_size // 8
                if rows_size != n * lay.bytes_per_row:
                    raise ValueError(f"sync_scatter_rows_all: rank {r} sent {rows_size} row bytes for {n} slots "
                                     f"of {lay.bytes_per_row} bytes")
                per_cache.append((rows_offset, slots_offset, n))
            out.append(per_cache)
        return out

    # a cached segment table is identified by its address; any other is identified by its values
    where = index.data_ptr() if host_known else str(table)
    key = (row_kernels.cache_key(caches), tuple(layouts), tuple(rows_segments), tuple(slots_segments), me, where)
    row_kernels.scatter_rows(gathered, caches, addressings, sources, key)


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------

_KERNELS = (
    (rows.sync_pack, pack_batched),
    (rows.sync_read_header, read_header),
    (rows.sync_scatter_rows, scatter_rows),
    (rows.sync_scatter_rows_all, scatter_rows_all),
    (rows.sync_unpack, unpack),
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
