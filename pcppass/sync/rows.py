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

import contextlib
import contextvars
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from pcppass.sync.owners import num_slots
from pcppass.sync.stats import SYNC_COUNTERS
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


def _read_headers(gathered: torch.Tensor, world_size: int, fingerprint: str,
                  num_segments: int) -> tuple[torch.Tensor, str | None]:
    """The segment table of ``gathered`` (every rank's sizes as its header states them) and what
    is wrong with the headers (None: every rank's carries this rank's fingerprint and sizes)."""
    chunk = gathered.numel() // world_size
    head_len = header_bytes(num_segments)
    heads = gathered.view(world_size, chunk)[:, :head_len].cpu()
    index = torch.empty(world_size, num_segments, 2, dtype=torch.int64)
    mine = _fingerprint_bytes(fingerprint)
    fingerprints, sizes_by_rank, invalid = [], [], None
    for r in range(world_size):
        head = heads[r]
        magic = bytes(head[: len(MAGIC)].tolist())
        fp = bytes(head[len(MAGIC): len(MAGIC) + FINGERPRINT_BYTES].tolist())
        ints = head[len(MAGIC) + FINGERPRINT_BYTES:].clone().view(torch.int64)
        fingerprints.append(fp.hex())
        sizes_by_rank.append(ints.tolist())
        if invalid is None and (magic != MAGIC or int(ints[0]) != num_segments):
            invalid = (f"rank {r}'s sync buffer has no valid pcppass header (magic {magic!r}, "
                       f"{int(ints[0])} segments, expected {num_segments})")
        sizes = ints[1:1 + num_segments]
        offsets = torch.cumsum(sizes, 0) - sizes + r * chunk + head_len
        index[r, :, 0] = offsets
        index[r, :, 1] = sizes
    problem = invalid
    if problem is None and any(fp != mine.hex() for fp in fingerprints):
        problem = "ranks traced different graphs: their sync fingerprints differ"
    if problem is None and any(s != sizes_by_rank[0] for s in sizes_by_rank):
        problem = f"ranks packed different segment sizes: {sizes_by_rank}"
    if problem is not None:
        listing = ", ".join(f"rank {r}: {fp}" for r, fp in enumerate(fingerprints))
        problem = (f"pcppass replica sync: {problem} [{listing}]. Every rank must compile and run the "
                   "same step graph (same model, same pcppass configuration, same step kind).")
    return index, problem


@torch.library.custom_op("pcppass::sync_read_header", mutates_args=())
def sync_read_header(
    gathered: torch.Tensor, world_size: int, fingerprint: str, num_segments: int, verify: bool
) -> torch.Tensor:
    """``[world, num_segments, 2]`` (offset, size) of every rank's segments in ``gathered``.

    With ``verify``, every rank's header must carry this rank's fingerprint and segment sizes:
    ranks that traced different graphs fail here, before any replica is touched. (The rewrite
    leaves that to ``pcppass::sync_verdict``, which also restores what the step wrote.)
    """
    SYNC_COUNTERS.record(gathered.numel() // world_size, world_size)
    index, problem = _read_headers(gathered, world_size, fingerprint, num_segments)
    if verify and problem is not None:
        from pcppass.errors import PcpSyncError

        raise PcpSyncError(problem)
    return index.to(gathered.device)


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


def _raise_sync_problems(problems: list[str | None], tail: str = "") -> None:
    found = [p for p in problems if p is not None]
    if found:
        from pcppass.errors import PcpSyncError

        raise PcpSyncError("; ".join(found) + tail)


# ---------------------------------------------------------------------------------------------
# The verdict: every rank decides alike, from the gathered buffer, whether the step stands
# ---------------------------------------------------------------------------------------------
#
# Every owner's op has written its rows into its own replica before the collective. The verdict
# reads every rank's header and slots from the gathered buffer (the same bytes on every rank), so
# every rank reaches the same decision: the step stands, and the scatters apply the other ranks'
# rows; or it is refused (headers differ, a slot outside its cache, two ranks wrote one row or
# overlapping bytes of one buffer), and NO rank applies any other rank's row, every rank writes
# back the rows its own ops overwrote from the snapshot taken before the step's first write
# (``pcppass::sync_snapshot``), and raises the same error. Every replica is then as it was before
# the step:
#
#     snapshot = pcppass.sync_snapshot([caches], [slots], layouts)          # before the first write
#     ... the step's writes and reads ...
#     packed, gathered, index = ...                                          # the collective
#     verdict  = pcppass.sync_verdict([caches], gathered, index, ..., [snapshot], [slots], ...)
#     pcppass.sync_scatter_rows_all([caches], gathered, index, ..., verdict)


def _cache_rows_offsets(slots: list[torch.Tensor], layouts: list[ResolvedLayout]) -> tuple[list[int], list[int]]:
    """Byte offsets of each entry's rows and of its int64 slots in a snapshot buffer."""
    rows_at, at = [], 0
    for s, lay in zip(slots, layouts):
        rows_at.append(at)
        at += s.numel() * lay.bytes_per_row
    slots_at = []
    for s in slots:
        slots_at.append(at)
        at += 8 * s.numel()
    return rows_at, slots_at


def _valid(slots: torch.Tensor, cache: torch.Tensor, layout: ResolvedLayout) -> torch.Tensor:
    return (slots >= 0) & (slots < num_slots(cache, layout))


#: what writes back the snapshots taken so far by the step running inside
#: :func:`restoring_on_failure`, until a verdict takes them over: (kind, write back)
_PENDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("pcppass_pending_snapshots", default=None)

#: the kind of graph-cache snapshots (``pcppass::sync_snapshot``; context-addressed caches have
#: their own, :mod:`pcppass.sync.context_restore`)
GRAPH = "graph"


@contextlib.contextmanager
def restoring_on_failure() -> Iterator[None]:
    """Run a step so that if it raises before its verdict (a peer that refused its own inputs
    aborted the collective, an op refused its arguments after earlier sites wrote), this rank
    writes back every snapshot the step took: its replica is then as before the step, as every
    other rank's is (each writes back its own rows). After the verdict, the verdict decides."""
    pending: list = []
    token = _PENDING.set(pending)
    try:
        yield
    except BaseException:
        for _, write_back in reversed(pending):
            write_back()
        raise
    finally:
        _PENDING.reset(token)


def remember_restore(kind: str, write_back: Callable[[], None]) -> None:
    """Record how to write back a snapshot of ``kind`` for :func:`restoring_on_failure` (when a
    step runs inside it)."""
    pending = _PENDING.get()
    if pending is not None:
        pending.append((kind, write_back))


def remember_snapshot(caches: list[torch.Tensor], cache_slots: list[torch.Tensor], layouts: list[int],
                      snapshot: torch.Tensor) -> torch.Tensor:
    """Record a graph-cache snapshot for :func:`restoring_on_failure`."""
    caches, cache_slots, layouts = list(caches), list(cache_slots), list(layouts)
    remember_restore(GRAPH, lambda: restore_snapshots(caches, [snapshot], list(range(len(caches))), layouts,
                                                      [len(caches)], cache_slots))
    return snapshot


def verdict_taken(kind: str = GRAPH) -> None:
    """The step reached the verdict over its snapshots of ``kind``: they are the verdict's now (it
    writes them back when it refuses the step)."""
    pending = _PENDING.get()
    if pending is not None:
        pending[:] = [entry for entry in pending if entry[0] != kind]


@torch.library.custom_op("pcppass::sync_snapshot", mutates_args=())
def sync_snapshot(caches: list[torch.Tensor], cache_slots: list[torch.Tensor], layouts: list[int]) -> torch.Tensor:
    """The rows every cache holds at this rank's slots, taken before the step writes them: every
    entry's rows (``[n, bytes_per_row]``, zeros at slot -1), then every entry's slots as int64.
    ``pcppass::sync_verdict`` writes them back when the step is refused (and
    :func:`restoring_on_failure` when the step fails before its verdict)."""
    return remember_snapshot(caches, cache_slots, layouts, _snapshot(caches, cache_slots, layouts))


def _snapshot(caches: list[torch.Tensor], cache_slots: list[torch.Tensor], layouts: list[int]) -> torch.Tensor:
    decoded = decode_pack_layouts(caches, cache_slots, layouts)
    parts = []
    for cache, slots, lay in zip(caches, cache_slots, decoded):
        slots = slots.reshape(-1).to(torch.int64)
        rows = torch.zeros(slots.numel(), lay.bytes_per_row, dtype=torch.uint8, device=cache.device)
        valid = _valid(slots, cache, lay)
        if bool(valid.any()):
            rows[valid] = read_rows(cache, slots[valid], lay)
        parts.append(rows.reshape(-1))
    parts += [s.reshape(-1).to(torch.int64).view(torch.uint8) for s in cache_slots]
    anchor = caches[0]
    return torch.cat(parts) if parts else anchor.new_empty((0,), dtype=torch.uint8)


@sync_snapshot.register_fake
def _sync_snapshot_fake(caches, cache_slots, layouts):
    total = 0
    for s, lay in zip(cache_slots, decode_layouts(layouts)):
        total = total + s.numel() * (lay.bytes_per_row + 8)
    return caches[0].new_empty((total,), dtype=torch.uint8)


def restore_snapshots(caches: list[torch.Tensor], snapshots: list[torch.Tensor], snapshot_caches: list[int],
                      snapshot_layouts: list[int], snapshot_counts: list[int],
                      snapshot_slots: list[torch.Tensor]) -> None:
    """Write every snapshot's rows back at its slots, latest snapshot first (a row two snapshots
    hold gets the earlier one's bytes: the bytes from before the step)."""
    decoded = decode_layouts(snapshot_layouts)
    entries, start = [], 0
    for snapshot, count in zip(snapshots, snapshot_counts):
        part = range(start, start + count)
        rows_at, slots_at = _cache_rows_offsets([snapshot_slots[e] for e in part], [decoded[e] for e in part])
        entries.append([(e, snapshot, rows_at[k], slots_at[k]) for k, e in enumerate(part)])
        start += count
    for group in reversed(entries):
        for e, snapshot, rows_at, slots_at in reversed(group):
            cache, lay, n = caches[snapshot_caches[e]], decoded[e], snapshot_slots[e].numel()
            slots = snapshot[slots_at:slots_at + 8 * n].clone().view(torch.int64)
            rows = snapshot[rows_at:rows_at + n * lay.bytes_per_row].view(n, lay.bytes_per_row)
            valid = _valid(slots, cache, lay)
            if bool(valid.any()):
                write_rows(cache, slots[valid], rows[valid], lay)


def sync_problems(caches: list[torch.Tensor], gathered: torch.Tensor, index: torch.Tensor, world_size: int,
                  fingerprint: str, num_segments: int, verify_header: bool, entry_caches: list[int],
                  slots_segments: list[int], layouts: list[int], sites: str, check_conflicts: bool) -> list[str]:
    """What refuses a step, read from the gathered buffer alike on every rank: headers that differ
    (``verify_header``), slots outside their cache and bytes two ranks wrote (``check_conflicts``;
    :mod:`pcppass.sync.owners`)."""
    from pcppass.sync.owners import find_problems

    if verify_header:
        _, problem = _read_headers(gathered, world_size, fingerprint, num_segments)
        if problem is not None:
            return [problem]
    if not check_conflicts:
        return []
    return find_problems(written_entries(caches, gathered, index, entry_caches, slots_segments, layouts, sites))


def written_entries(caches: list[torch.Tensor], gathered: torch.Tensor, index: torch.Tensor,
                    entry_caches: list[int], slots_segments: list[int], layouts: list[int], sites: str) -> list:
    """Entry ``i`` (``caches[entry_caches[i]]``, its slots in segment ``slots_segments[i]``) as an
    :class:`pcppass.sync.owners.Written` with every rank's slots."""
    from pcppass.sync.owners import Written

    labels = site_labels(sites, len(entry_caches))
    return [Written(caches[c], lay, label, every_rank_slots(gathered, index, seg))
            for c, seg, lay, label in zip(entry_caches, slots_segments, decode_layouts(layouts), labels)]


_RESTORED = (". The step was refused on every rank: no rank applied another rank's rows, and every rank "
             "wrote back the rows its own ops had written, so every replica holds what it held before "
             "the step")
_NOT_APPLIED = (". The step was refused on every rank: no rank applied another rank's rows (each rank "
                "keeps the rows its own ops wrote in this site)")


@torch.library.custom_op("pcppass::sync_verdict", mutates_args=("caches",))
def sync_verdict(
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
    """Decide, alike on every rank, whether this collective's step stands (see above). Entry ``i``
    of ``entry_caches`` / ``slots_segments`` / ``layouts`` / ``sites`` (one per line) is a cache
    written in the step (``caches[entry_caches[i]]``) and the slot segment of its rows. Snapshot
    ``k`` holds ``snapshot_counts[k]`` entries (caches, layouts and slots in the ``snapshot_*``
    lists, in order). Refused: the snapshots are written back and the same
    :class:`~pcppass.errors.PcpSyncError` is raised on every rank. Else an int32 ``[1]`` zero, which
    the scatters and unpacks of the collective take (a device implementation records a refusal in
    it instead of raising: they then apply nothing)."""
    verdict_taken()
    problems = sync_problems(caches, gathered, index, world_size, fingerprint, num_segments, verify_header,
                             entry_caches, slots_segments, layouts, sites, check_conflicts)
    if problems:
        restore_snapshots(caches, snapshots, snapshot_caches, snapshot_layouts, snapshot_counts, snapshot_slots)
        _raise_sync_problems(problems, _RESTORED if snapshots else _NOT_APPLIED)
    return torch.zeros(1, dtype=torch.int32, device=gathered.device)


@sync_verdict.register_fake
def _sync_verdict_fake(caches, gathered, index, world_size, fingerprint, num_segments, verify_header,
                       entry_caches, slots_segments, layouts, sites, check_conflicts, snapshots, snapshot_slots,
                       snapshot_caches, snapshot_layouts, snapshot_counts, group_name):
    return gathered.new_empty((1,), dtype=torch.int32)


def refused(verdict: torch.Tensor | None) -> bool:
    """Whether a verdict (host ops) refused the step."""
    return verdict is not None and bool(verdict.any())


# ---------------------------------------------------------------------------------------------
# Scatter
# ---------------------------------------------------------------------------------------------


def scatter_rows_reference(
    cache: torch.Tensor,
    gathered: torch.Tensor,
    index: torch.Tensor,
    rows_segment: int,
    slots_segment: int,
    layout: list[int],
    group_name: str,
) -> None:
    """Write every other rank's rows (from ``gathered``) into this rank's replica of ``cache``.
    Slot -1 rows are skipped and this rank's own rows are left as its local op wrote them; the
    slots were checked (``sync_problems``) before."""
    (lay,) = decode_layouts(layout)
    me = _group_rank(group_name)
    all_slots = every_rank_slots(gathered, index, slots_segment)
    for r, slots in enumerate(all_slots):
        valid = slots >= 0
        if r == me or not bool(valid.any()):
            continue
        rows = _segment(gathered, index, r, rows_segment).view(slots.numel(), lay.bytes_per_row)
        write_rows(cache, slots[valid], rows[valid], lay)


def _checked_scatter(caches: list[torch.Tensor], gathered: torch.Tensor, index: torch.Tensor,
                     rows_segments: list[int], slots_segments: list[int], layouts: list[int], group_name: str,
                     sites: str, check_conflicts: bool, verdict: torch.Tensor | None) -> None:
    """Every cache's scatter, after the checks: the verdict's when one is given (a refusal
    applies nothing), else this op's own (a problem raises before anything is applied)."""
    decoded = decode_layouts(layouts)
    labels = site_labels(sites, len(caches))
    if not (len(caches) == len(rows_segments) == len(slots_segments) == len(decoded)):
        raise ValueError("sync_scatter_rows_all: caches, segments and layouts differ in length")
    if refused(verdict):
        return
    if verdict is None and check_conflicts:
        world = index.shape[0]
        problems = sync_problems(caches, gathered, index, world, "", 0, False, list(range(len(caches))),
                                 slots_segments, layouts, "\n".join(labels), True)
        _raise_sync_problems(problems, _NOT_APPLIED)
    for cache, rows_segment, slots_segment, lay in zip(caches, rows_segments, slots_segments, decoded):
        scatter_rows_reference(cache, gathered, index, rows_segment, slots_segment, encode_layout(lay), group_name)


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
    verdict: torch.Tensor | None = None,
) -> None:
    """One cache's scatter (:func:`sync_scatter_rows_all` of one cache)."""
    _checked_scatter([cache], gathered, index, [rows_segment], [slots_segment], layout, group_name, site,
                     check_conflicts, verdict)


@sync_scatter_rows.register_fake
def _sync_scatter_rows_fake(cache, gathered, index, rows_segment, slots_segment, layout,
                            group_name, site, check_conflicts, verdict=None):
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
    verdict: torch.Tensor | None = None,
) -> None:
    """Every other rank's rows into this replica, for many caches in one op: cache ``i`` receives
    the rows of segment ``rows_segments[i]`` at the slots of segment ``slots_segments[i]`` through
    the i-th layout of ``layouts`` (concatenated :func:`encode_layout` results); ``sites`` holds
    the i-th cache's site label on line ``i`` (for errors). One op per collective lets a device
    implementation move every cache's rows in one launch; the caches are distinct tensors.

    ``verdict`` (``pcppass::sync_verdict``'s, which checked every rank's slots): a refused step
    applies nothing. Without one, with ``check_conflicts``, this op checks its own caches' slots
    and raises on a problem before it applies anything."""
    _checked_scatter(caches, gathered, index, rows_segments, slots_segments, layouts, group_name, sites,
                     check_conflicts, verdict)


def site_labels(sites: str, count: int) -> list[str]:
    """The per-cache labels of ``sync_scatter_rows_all``'s ``sites`` (one per line)."""
    labels = sites.split("\n") if count else []
    if len(labels) != count:
        raise ValueError(f"sync_scatter_rows_all: {len(labels)} site labels for {count} caches")
    return labels


@sync_scatter_rows_all.register_fake
def _sync_scatter_rows_all_fake(caches, gathered, index, rows_segments, slots_segments, layouts,
                                group_name, sites, check_conflicts, verdict=None):
    return None


def _one_writer_per_slot(all_slots: list[torch.Tensor], limit: int,
                         site: str) -> tuple[list[torch.Tensor], str | None]:
    """Per rank, which of its rows every other replica applies, and what was wrong (or None):
    the context-addressed caches' rule (:func:`sync_scatter_context`), which no snapshot covers.

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
    verdict: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every rank's copy of a payload, concatenated along dim 0: ``[world * n, *like.shape[1:]]``.

    With ``mask_own_rows`` (slot mappings of a re-run) this rank's own rows become -1, so the
    re-run skips the rows the local op already wrote; every rank's, when ``verdict`` refused the
    step (the re-run then writes nothing).
    """
    world = index.shape[0]
    parts = [_segment(gathered, index, r, segment).clone().view(like.dtype).view(like.shape)
             for r in range(world)]
    if mask_own_rows:
        masked = range(world) if refused(verdict) else [_group_rank(group_name)]
        for r in masked:
            parts[r] = torch.full_like(parts[0], -1)
    return torch.cat(parts, dim=0)


@sync_unpack.register_fake
def _sync_unpack_fake(gathered, index, segment, like, group_name, mask_own_rows, verdict=None):
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
    problems = []
    for cache, rows_segment, slots_segment, lay, site in zip(caches, rows_segments, slots_segments,
                                                             decoded, lines[3]):
        if cache is None:
            _require_no_rows(gathered, index, slots_segment, site)
            continue
        problems.append(_scatter_lowest_rank_rows(cache, gathered, index, rows_segment, slots_segment, lay,
                                                  group_name, site, check_conflicts))
    _raise_sync_problems(problems)  # after every cache is written: the replicas stay identical
    return gathered.new_empty((0,))


def _scatter_lowest_rank_rows(cache: torch.Tensor, gathered: torch.Tensor, index: torch.Tensor, rows_segment: int,
                              slots_segment: int, lay: ResolvedLayout, group_name: str, site: str,
                              check_conflicts: bool) -> str | None:
    """Every other rank's rows into this replica of a context-addressed cache; with
    ``check_conflicts`` a slot two ranks wrote gets the lowest such rank's row on every replica
    and slots outside the cache are skipped (the problem is returned)."""
    me = _group_rank(group_name)
    all_slots = every_rank_slots(gathered, index, slots_segment)
    problem = None
    if check_conflicts:
        applied, problem = _one_writer_per_slot(all_slots, num_slots(cache, lay), site)
    else:
        applied = [slots >= 0 for slots in all_slots]
    for r, slots in enumerate(all_slots):
        if r == me or not bool(applied[r].any()):
            continue
        rows = _segment(gathered, index, r, rows_segment).view(slots.numel(), lay.bytes_per_row)
        write_rows(cache, slots[applied[r]], rows[applied[r]], lay)
    return problem


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
