"""CUDA kernels for the replica-sync ops with no host synchronisation (CUDA-graph capturable).

The reference implementations in :mod:`pcppass.kernels.rows` read sizes and offsets back to the
host (``bool(valid.any())``, ``index.tolist()``, ``gathered[:head].cpu()``) and select rows with
boolean masks. Each of those waits for the GPU, and none can be recorded in a CUDA graph. The
kernels here produce the same bytes with device-side selection only:

* ``sync_pack``: every row is read (slot -1 clamped to 0) and padding rows are zeroed with
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

from pcppass.kernels import rows
from pcppass.kernels.rows import (
    _encode_header,
    _group_rank,
    decode_layouts,
    header_bytes,
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
    decoded = decode_layouts(layouts)
    if not (len(caches) == len(cache_slots) == len(decoded)):
        raise ValueError("sync_pack: caches, cache_slots and layouts differ in length")
    anchor = caches[0] if caches else payloads[0]
    segments = [_padded_rows(c, s.reshape(-1), lay).reshape(-1)
                for c, s, lay in zip(caches, cache_slots, decoded)]
    for t in payloads:
        segments.append(t.contiguous().view(torch.uint8).reshape(-1) if t.numel() else
                        torch.empty(0, dtype=torch.uint8, device=t.device))
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
# Registration
# ---------------------------------------------------------------------------------------------

_KERNELS = (
    (rows.sync_pack, pack),
    (rows.sync_read_header, read_header),
    (rows.sync_scatter_rows, scatter_rows),
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
