"""A refused step leaves context-addressed caches as they were before it.

An op such as vLLM's ``unified_kv_cache_update(key, value, layer_name)`` fetches its cache and
slot mapping by handle at run time and declares no write, so no graph tensor stands for what it
writes and nothing in the graph orders a read of its cache before it. To snapshot the rows it is
about to overwrite, the rewrite threads one of the op's row inputs through the snapshot, so the op
takes the snapshot's copy of it and cannot run first::

    snap, key2 = pcppass.sync_context_snapshot(resolvers, handles, roles, slots_roles, layouts, key, key)
    token      = unified_kv_cache_update(key2, value, layer)            # takes key2: runs after
    ...
    packed, gathered, index = ...                                        # the step's collective
    index2     = pcppass.sync_context_verdict(gathered, index, ..., [snap, ...], ...)
    pcppass.sync_verdict(graph caches, gathered, index2, ...)            # graph caches, if any
    pcppass.sync_scatter_context(gathered, index2, ...)                  # after the verdict
    pcppass.sync_rerun_context(..., sync_unpack(gathered, index2, ...))  # after the verdict

``sync_context_verdict`` reads every rank's header and every rank's slots of every cache the
collective writes, graph caches and context caches alike (state lines of a re-run site included),
from the gathered buffer, so every rank decides alike, before any scatter or re-run of the
collective. Refused: every rank writes back its own rows from its context snapshots and raises
the same error; the graph caches' snapshots are written back as the step fails
(:func:`pcppass.sync.rows.restoring_on_failure`; the graph verdict, which takes them over, runs
after this one). Else it returns a copy of ``index`` that every later op of the collective
takes, which orders them after it.

Under the immediate schedule (one collective per site) a later site may still refuse the step
after an earlier collective applied its rows: on a step with context sites every collective is
decided by this verdict, and until the step's last one it also records, before its scatter
overwrites them, the rows at the other ranks' slots (graph caches' own rows are snapshotted
too), so that a refusal anywhere writes back every row the step changed.

Cost per context site: a copy of one op input (the step's rows of it: a decode step's few rows,
a prefill chunk's every token under the immediate schedule) and a read of this rank's rows through
the resolver; under the immediate schedule also a read of the other ranks' rows before each
scatter. These are host-checked ops (not CUDA-graph capturable, as the context sync already is
not).
"""

from __future__ import annotations

import torch

from pcppass.errors import PcpSyncError
from pcppass.sync.owners import Written, find_problems
from pcppass.sync.rows import (
    GRAPH,
    _RESTORED,
    _context_where,
    _group_rank,
    _read_headers,
    _valid,
    context_cache,
    context_slots,
    context_tensors,
    decode_layouts,
    every_rank_slots,
    read_rows,
    remember_restore,
    site_labels,
    verdict_taken,
    write_rows,
    written_entries,
)
from pcppass.spec import ResolvedLayout

#: the kind of the snapshots this module takes (see :func:`pcppass.sync.rows.remember_restore`)
CONTEXT = "context"

Entry = tuple[str, str, str, str, ResolvedLayout]


def _entries(resolvers: str, handles: str, cache_roles: str, slots_roles: str, layouts: list[int]) -> list[Entry]:
    """(resolver, handle, cache role, slots role, layout) of each entry (line ``i`` of each text)."""
    decoded = decode_layouts(layouts)
    texts = [site_labels(text, len(decoded)) for text in (resolvers, handles, cache_roles, slots_roles)]
    return list(zip(*texts, decoded))


def _resolve(entry: Entry) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The entry's resolved tensors now, and its cache (None: the engine has none yet)."""
    resolver, handle, role, _, layout = entry
    tensors = context_tensors(resolver, handle)
    return tensors, context_cache(tensors, role, layout, _context_where(resolver, handle))


def snapshot_bytes(rows: int, layouts: list[ResolvedLayout]) -> int:
    """Size of a context snapshot: every entry's rows, then every entry's slots (int64)."""
    return rows * sum(lay.bytes_per_row + 8 for lay in layouts)


def _take(caches: list[torch.Tensor | None], slots: list[torch.Tensor], layouts: list[ResolvedLayout],
          like: torch.Tensor) -> torch.Tensor:
    """Every entry's rows at its slots (zeros where the slot is -1, outside the cache, or the
    entry has no cache), then every entry's slots."""
    parts = []
    for cache, s, lay in zip(caches, slots, layouts):
        rows = torch.zeros(s.numel(), lay.bytes_per_row, dtype=torch.uint8, device=like.device)
        if cache is not None:
            valid = _valid(s, cache, lay)
            if bool(valid.any()):
                rows[valid] = read_rows(cache, s[valid], lay).to(like.device)
        parts.append(rows.reshape(-1))
    parts += [s.to(like.device).view(torch.uint8) for s in slots]
    return torch.cat(parts) if parts else like.new_empty((0,), dtype=torch.uint8)


def write_back(snapshot: torch.Tensor, caches: list[torch.Tensor | None], layouts: list[ResolvedLayout]) -> None:
    """Write a context snapshot's rows back at its slots (entries without a cache skipped)."""
    per_row = sum(lay.bytes_per_row + 8 for lay in layouts)
    if not per_row or not snapshot.numel():
        return
    n = snapshot.numel() // per_row
    at = n * sum(lay.bytes_per_row for lay in layouts)
    rows_at = 0
    for cache, lay in zip(caches, layouts):
        rows = snapshot[rows_at:rows_at + n * lay.bytes_per_row].view(n, lay.bytes_per_row)
        slots = snapshot[at:at + 8 * n].clone().view(torch.int64)
        rows_at += n * lay.bytes_per_row
        at += 8 * n
        if cache is None:
            continue
        slots = slots.to(cache.device)
        valid = _valid(slots, cache, lay)
        if bool(valid.any()):
            write_rows(cache, slots[valid], rows[valid].to(cache.device), lay)


@torch.library.custom_op("pcppass::sync_context_snapshot", mutates_args=())
def sync_context_snapshot(
    resolvers: str,
    handles: str,
    cache_roles: str,
    slots_roles: str,
    layouts: list[int],
    rows_like: torch.Tensor,
    through: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows every context cache of one site holds at this rank's slots, read before the op
    writes them, and a copy of ``through`` (an input the op reads and does not write), which the
    op takes instead: that orders the op after this read. Entry ``i`` is line ``i`` of
    ``resolvers``, ``handles``, ``cache_roles`` and ``slots_roles``, ``rows_like.shape[0]`` slots
    each (-1-padded); the layout: :func:`snapshot_bytes`."""
    n = rows_like.shape[0]
    entries = _entries(resolvers, handles, cache_roles, slots_roles, layouts)
    caches, slots = [], []
    for entry in entries:
        tensors, cache = _resolve(entry)
        caches.append(cache)
        slots.append(context_slots(tensors, entry[3], n, _context_where(entry[0], entry[1])).reshape(-1))
    lays = [entry[4] for entry in entries]
    snapshot = _take(caches, slots, lays, rows_like)
    remember_restore(CONTEXT, lambda: write_back(snapshot, caches, lays))
    return snapshot, through.clone()


@sync_context_snapshot.register_fake
def _sync_context_snapshot_fake(resolvers, handles, cache_roles, slots_roles, layouts, rows_like, through):
    size = snapshot_bytes(rows_like.shape[0], decode_layouts(layouts))
    return rows_like.new_empty((size,), dtype=torch.uint8), torch.empty_like(through)


def _context_written(entries: list[Entry], caches: list[torch.Tensor | None], slots_segments: list[int], sites: str,
                     gathered: torch.Tensor, index: torch.Tensor) -> tuple[list[Written], list[str]]:
    """Every context entry the collective writes as :class:`Written` (its cache as resolved now,
    every rank's slots), and the problems of entries this rank has no cache for while a rank wrote
    rows."""
    written, problems = [], []
    for entry, cache, segment, label in zip(entries, caches, slots_segments, site_labels(sites, len(entries))):
        slots = every_rank_slots(gathered, index, segment)
        if cache is not None:
            written.append(Written(cache, entry[4], label, slots))
            continue
        writers = [r for r, s in enumerate(slots) if bool((s >= 0).any())]
        if writers:
            problems.append(f"{label}: ranks {writers} wrote rows into a cache this rank does not have yet")
    return written, problems


@torch.library.custom_op("pcppass::sync_context_verdict", mutates_args=())
def sync_context_verdict(
    gathered: torch.Tensor,
    index: torch.Tensor,
    world_size: int,
    fingerprint: str,
    num_segments: int,
    verify_header: bool,
    check_conflicts: bool,
    graph_caches: list[torch.Tensor],
    graph_entries: list[int],
    graph_slots_segments: list[int],
    graph_layouts: list[int],
    graph_sites: str,
    resolvers: str,
    handles: str,
    cache_roles: str,
    slots_roles: str,
    slots_segments: list[int],
    layouts: list[int],
    sites: str,
    rerun_entries: list[int],
    snapshots: list[torch.Tensor],
    snapshot_counts: list[int],
    graph_snapshots: list[torch.Tensor],
    group_name: str,
    final: bool,
) -> torch.Tensor:
    """Decide, alike on every rank, whether the collective's step stands, before any of its
    scatters or re-runs (see the module docstring). Context entry ``i``: line ``i`` of
    ``resolvers`` / ``handles`` / ``cache_roles`` / ``slots_roles`` / ``sites``, its slots in
    segment ``slots_segments[i]``; graph entry ``j``: ``graph_caches[graph_entries[j]]``, its
    slots in ``graph_slots_segments[j]``. ``rerun_entries``: the context entries whose slots are
    a re-run's state lines (one row per line in the whole step: a re-run of two rows on one line
    would depend on their order). Snapshot ``k`` covers the next ``snapshot_counts[k]``
    context entries. ``graph_snapshots``: snapshots of graph caches that stay with the step (only
    read to keep them). Refused: the snapshots are written back and the same
    :class:`~pcppass.errors.PcpSyncError` is raised on every rank. Else a copy of ``index``.

    ``final``: no later collective of the step writes a context-addressed cache (deferred: its
    only collective), so no later verdict can refuse the step: the snapshots are this verdict's.
    Not final (immediate: one collective per site), a later site may still be refused: the
    snapshots stay with the step, and this verdict records, before its scatter overwrites them,
    the rows at the other ranks' slots, so that a refusal (or failure) later in the step writes
    back every row the step changed (:func:`pcppass.sync.rows.restoring_on_failure`), until the
    final verdict takes them over."""
    problems: list[str] = []
    if verify_header:
        _, problem = _read_headers(gathered, world_size, fingerprint, num_segments)
        problems = [problem] if problem is not None else []
    entries = _entries(resolvers, handles, cache_roles, slots_roles, layouts)
    caches = [_resolve(e)[1] for e in entries]
    if not problems and check_conflicts:
        written, problems = _context_written(entries, caches, slots_segments, sites, gathered, index)
        written += written_entries(graph_caches, gathered, index, graph_entries, graph_slots_segments,
                                   graph_layouts, graph_sites)
        problems += find_problems(written)
        problems += _lines_written_twice(entries, slots_segments, sites, rerun_entries, gathered, index)
    if problems:  # written back here, and again (the same bytes) with the rest of the step's
        # snapshots as the error leaves the step (restoring_on_failure)
        starts = [sum(snapshot_counts[:k]) for k in range(len(snapshot_counts))]
        for snapshot, start, count in reversed(list(zip(snapshots, starts, snapshot_counts))):
            # latest first: a row two sites wrote gets the older bytes
            write_back(snapshot, caches[start:start + count], [e[4] for e in entries[start:start + count]])
        raise PcpSyncError("; ".join(problems) + _RESTORED)
    if final:
        # the step stands: nothing is written back any more
        verdict_taken(CONTEXT)
        verdict_taken(GRAPH)
    else:
        every_cache = caches + [graph_caches[c] for c in graph_entries]
        layouts_all = [e[4] for e in entries] + decode_layouts(graph_layouts)
        _remember_other_ranks_rows(every_cache, layouts_all, [*slots_segments, *graph_slots_segments], gathered, index,
                                   _group_rank(group_name))
    return index.clone()


def _lines_written_twice(entries: list[Entry], slots_segments: list[int], sites: str, rerun_entries: list[int],
                         gathered: torch.Tensor, index: torch.Tensor) -> list[str]:
    """A state line two rows of one rank's re-run site advanced (two ranks: :func:`find_problems`)."""
    labels = site_labels(sites, len(entries))
    problems = []
    for segment in dict.fromkeys(slots_segments[i] for i in rerun_entries):
        label = labels[next(i for i in rerun_entries if slots_segments[i] == segment)]
        for rank, lines in enumerate(every_rank_slots(gathered, index, segment)):
            unique, counts = torch.unique(lines[lines >= 0], return_counts=True)
            if bool((counts > 1).any()):
                problems.append(f"{label}: rank {rank} advanced state line {int(unique[counts > 1][0])} from "
                                f"more than one row in this step; a re-run of those rows would depend on "
                                f"their order")
                break
    return problems


def _remember_other_ranks_rows(caches: list[torch.Tensor | None], layouts: list[ResolvedLayout],
                               slots_segments: list[int], gathered: torch.Tensor, index: torch.Tensor,
                               me: int) -> None:
    """Record, for :func:`pcppass.sync.rows.restoring_on_failure`, the rows each cache holds now
    at the slots the other ranks wrote, which this collective's scatter (or re-run) is about to
    overwrite."""
    for cache, layout, segment in zip(caches, layouts, slots_segments):
        if cache is None:
            continue
        slots = torch.cat([s for r, s in enumerate(every_rank_slots(gathered, index, segment)) if r != me])
        slots = slots.to(cache.device)
        slots = slots[_valid(slots, cache, layout)]
        if not slots.numel():
            continue
        rows = read_rows(cache, slots, layout)
        remember_restore(CONTEXT, lambda c=cache, s=slots, r=rows, lay=layout: write_rows(c, s, r, lay))


@sync_context_verdict.register_fake
def _sync_context_verdict_fake(gathered, index, world_size, fingerprint, num_segments, verify_header,
                               check_conflicts, graph_caches, graph_entries, graph_slots_segments, graph_layouts,
                               graph_sites, resolvers, handles, cache_roles, slots_roles, slots_segments, layouts,
                               sites, rerun_entries, snapshots, snapshot_counts, graph_snapshots, group_name,
                               final):
    return torch.empty_like(index)


# It raises for the whole step (and writes back state no graph tensor stands for): keep it even
# where dead-code elimination would find its result unused.
torch.fx.node.has_side_effect(torch.ops.pcppass.sync_context_verdict.default)
