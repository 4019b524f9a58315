"""One owner per byte: what the ranks of one step wrote that another rank wrote too.

Every row of every cache has exactly one owner per step. Two ranks writing one slot of one cache
is the plain case; two caches that view one buffer with different row shapes (a K/V buffer seen
as ``[nb, bs, 2, 4]`` by one op and as ``[nb, 2 * bs, 1, 4]`` by another) are one cache too: rank
0's row of one may overlap rank 1's row of the other, and no slot comparison sees it. So rows are
compared as byte ranges of the storage they live in::

    rank 0: site A writes slot 2 of ka  -> bytes [64, 96) of the buffer's storage
    rank 1: site B writes slot 4 of kb  -> bytes [64, 80)                  -> two owners

:func:`find_problems` takes every cache a step's sync writes, with every rank's slots, and says
what is wrong (slots outside a cache, bytes two ranks wrote), one line per cache; the replica sync
(:mod:`pcppass.sync.rows`) and the pre-write slot checks (:mod:`pcppass.sync.slot_check_ops`)
refuse the step on any. Entries that view one storage identically (the same cache written by two
sites) are compared by slot, which names the slot; other entries sharing a storage by byte range.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from pcppass.spec import ResolvedLayout


@dataclass(frozen=True)
class Written:
    """One cache written in a step: the tensor this rank holds, its row layout, the site label,
    and every rank's slots (int64, rank order; -1 skips a row)."""

    cache: torch.Tensor
    layout: ResolvedLayout
    label: str
    slots: Sequence[torch.Tensor]


def num_slots(cache: torch.Tensor, layout: ResolvedLayout) -> int:
    """How many slots ``cache`` has under ``layout`` (valid slots are ``[0, num_slots)``)."""
    if layout.kind == "paged_rows":
        return cache.shape[0] * cache.shape[1]
    if layout.kind == "block_split":
        return cache.shape[0] * layout.block_size
    return cache.shape[layout.dim]


def _geometry(w: Written) -> tuple:
    c = w.cache
    return (c.storage_offset(), tuple(c.shape), c.stride(), c.element_size(), w.layout)


def _storage(w: Written) -> tuple:
    return (w.cache.device, w.cache.untyped_storage().data_ptr())


def _element_runs(sizes: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    """``[k, 2]`` (first element, count) of the contiguous runs the elements of one row cover,
    relative to the row's first element (sizes and strides of the row's own dims)."""
    return _element_runs_of(tuple(int(x) for x in sizes), tuple(int(x) for x in strides))


@functools.lru_cache(maxsize=256)
def _element_runs_of(sizes: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    # one row shape per cache: the same few geometries every step (the result is never written)
    offsets = torch.zeros(1, dtype=torch.int64)
    for size, stride in zip(sizes, strides):
        offsets = (offsets[:, None] + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    offsets = torch.unique(offsets)
    breaks = torch.nonzero(offsets[1:] != offsets[:-1] + 1).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    ends = torch.cat([breaks, torch.tensor([offsets.numel()])])
    return torch.stack([offsets[starts], ends - starts], dim=1)


def byte_runs(cache: torch.Tensor, layout: ResolvedLayout, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(start, end, slot) of every byte range the rows at ``slots`` (valid, int64) cover in the
    cache's storage, one entry per contiguous run."""
    item = cache.element_size()
    origin = cache.storage_offset() * item
    if layout.kind == "block_split":
        block = origin + (slots // layout.block_size) * cache.stride(0) * item
        offset = slots % layout.block_size
        parts = [(block + base + offset * stride, length) for base, stride, length in layout.segments]
        starts = torch.stack([p for p, _ in parts], dim=1)
        lengths = torch.tensor([n for _, n in parts], dtype=torch.int64).expand_as(starts)
    else:
        if layout.kind == "paged_rows":
            bs = cache.shape[1]
            first = (slots // bs) * cache.stride(0) + (slots % bs) * cache.stride(1)
            inner = _element_runs(cache.shape[2:], cache.stride()[2:])
        else:
            d = layout.dim
            first = slots * cache.stride(d)
            keep = [i for i in range(cache.dim()) if i != d]
            inner = _element_runs([cache.shape[i] for i in keep], [cache.stride(i) for i in keep])
        starts = origin + (first[:, None] + inner[None, :, 0]) * item
        lengths = (inner[:, 1] * item).expand_as(starts)
    n = starts.shape[1]
    return starts.reshape(-1), (starts + lengths).reshape(-1), slots.repeat_interleave(n)


def _outside(w: Written) -> str | None:
    limit = num_slots(w.cache, w.layout)
    for r, slots in enumerate(w.slots):
        bad = slots[(slots < -1) | (slots >= limit)]
        if bad.numel():
            return f"{w.label}: rank {r} wrote slot {int(bad[0])}, outside [-1, {limit})"
    return None


def _same_view_conflict(group: list[Written]) -> str | None:
    """Slots two ranks wrote in entries that view one storage identically."""
    world = len(group[0].slots)
    slots = torch.cat([s.reshape(-1) for w in group for s in w.slots])
    ranks = torch.cat([torch.full((s.numel(),), r, dtype=torch.int64) for w in group for r, s in enumerate(w.slots)])
    keep = slots >= 0
    pairs = torch.unique(slots[keep] * world + ranks[keep])
    owners, counts = torch.unique(pairs // world, return_counts=True)
    shared = owners[counts > 1]
    if not shared.numel():
        return None
    slot = int(shared.min())
    writers = sorted(int(p) % world for p in pairs[pairs // world == slot])
    sites = list(dict.fromkeys(w.label for w in group if any(bool((s == slot).any()) for s in w.slots)))
    more = f" (and {shared.numel() - 1} more slot(s))" if shared.numel() > 1 else ""
    return f"{' and '.join(sites)}: slot {slot} was written by ranks {writers} in the same step{more}"


def _span(w: Written) -> tuple[int, int]:
    """The bytes ``[start, end)`` of the storage that any element of ``w.cache`` lies in."""
    c = w.cache
    item = c.element_size()
    start = c.storage_offset() * item
    if not c.numel():
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(c.shape, c.stride()))
    return start, start + (last + 1) * item


def _views_may_overlap(views: Sequence[list[Written]]) -> bool:
    """Whether two of the distinct views of one storage reach common bytes at all (K and V caches
    that are two halves of one buffer never do: no byte ranges need comparing)."""
    reach = None
    for start, end in sorted(_span(group[0]) for group in views):
        if reach is not None and start < reach:
            return True
        reach = end if reach is None else max(reach, end)
    return False


def _overlap(group: list[Written]) -> str | None:
    """Byte ranges two ranks wrote through different views of one storage."""
    world = len(group[0].slots)
    runs = []  # per rank: starts, ends, entry, slot
    for r in range(world):
        parts = []
        for k, w in enumerate(group):
            s = w.slots[r].reshape(-1)
            s = s[s >= 0]
            start, end, slot = byte_runs(w.cache, w.layout, s)
            parts.append((start, end, torch.full_like(start, k), slot))
        runs.append([torch.cat(p) for p in zip(*parts)])
    for r in range(world):
        for q in range(r + 1, world):
            found = _first_overlap(runs[r], runs[q])
            if found is not None:
                (ka, sa, a0, a1), (kb, sb, b0, b1) = found
                return (f"{group[ka].label} (rank {r}, slot {sa}) and {group[kb].label} (rank {q}, slot {sb}) "
                        f"wrote overlapping bytes [{max(a0, b0)}, {min(a1, b1)}) of one buffer in the same step: "
                        "caches that view one buffer are one cache")
    return None


def _first_overlap(mine: list[torch.Tensor], theirs: list[torch.Tensor]):
    """The first pair of ranges, one of each list, that overlap (None if none)."""
    starts, ends, entries, slots = theirs
    if not starts.numel() or not mine[0].numel():
        return None
    order = torch.argsort(starts)
    starts, ends, entries, slots = starts[order], ends[order], entries[order], slots[order]
    reach = torch.cummax(ends, 0).values
    last = torch.searchsorted(starts, mine[1], side="left") - 1  # their ranges starting before my end
    hit = (last >= 0) & (reach[last.clamp(min=0)] > mine[0])
    if not bool(hit.any()):
        return None
    i = int(torch.nonzero(hit)[0])
    j = int(torch.nonzero((ends[: int(last[i]) + 1] > mine[0][i]))[0])
    return ((int(mine[2][i]), int(mine[3][i]), int(mine[0][i]), int(mine[1][i])),
            (int(entries[j]), int(slots[j]), int(starts[j]), int(ends[j])))


def find_problems(written: Sequence[Written]) -> list[str]:
    """Slots outside their cache, and bytes two ranks wrote in the same step (one line each)."""
    problems = [p for p in map(_outside, written) if p is not None]
    if problems:
        return problems  # byte ranges of slots outside a cache are meaningless
    groups: dict[tuple, list[Written]] = {}
    for w in written:
        groups.setdefault(_storage(w), []).append(w)
    for group in groups.values():
        views: dict[tuple, list[Written]] = {}
        for w in group:
            views.setdefault(_geometry(w), []).append(w)
        found = [p for p in map(_same_view_conflict, views.values()) if p is not None]
        if not found and len(views) > 1 and _views_may_overlap(list(views.values())):
            found = [p for p in [_overlap(group)] if p is not None]
        problems += found
    return problems
