"""Graph surgery: insert replica synchronisation for every planned write site.

The owner's call stays exactly as the model wrote it (a fused op's slots are never edited: the
V3.2 kernel skips the whole token, its Q row included, for slot -1). After it, every other replica
reproduces the owner's rows:

* ``COPY_ROWS``: read the rows the op wrote, by slot, through the cache's layout; all-gather them
  with their slots; every rank writes the other ranks' rows into its replica.
* ``RERUN``: all-gather the op's per-row inputs; every rank calls the op again on all ranks' rows
  with its own rows' slots set to -1 (already written locally); non-cache outputs are discarded.

Schedules:

* ``"deferred"`` (decode): one sync at the end of the step for every site, in ONE collective:
  all rows, slots and re-run inputs packed into one uint8 buffer behind a small header. Sites are
  applied in graph order, so a re-run that reads state another site wrote sees it synced. The
  collective starts right after the last site (:mod:`pcppass.rewrite.overlap`).
* ``"immediate"`` (partitioned prefill, where other ranks read the rows in the same step): one
  sync right after each site, before any later read.

Before (Dynamo graph, one GQA layer)::

    reshape_and_cache_flash(k, v, k_cache, v_cache, slots, "auto", ks, vs)
    ... attention reads k_cache, v_cache ...
    return (hidden,)

After, deferred::

    reshape_and_cache_flash(k, v, k_cache, v_cache, slots, "auto", ks, vs)      # unchanged
    ... attention reads k_cache, v_cache ...
    packed   = pcppass.sync_pack(fp, [k_cache, v_cache], [slots, slots], layouts, [slots])
    gathered = wait_tensor(all_gather_into_tensor(packed, world, group))
    index    = pcppass.sync_read_header(gathered, world, fp, 3, True)
    pcppass.sync_scatter_rows_all([k_cache, v_cache], gathered, index, [0, 1], [2, 2],
                                  layout_k + layout_v, group, "site\nsite", True)
    return (hidden,)

One ``sync_scatter_rows_all`` writes every cache of the collective (a device implementation moves
all their rows in one launch); a re-run site splits the scatters so that it sees earlier sites'
rows synced.

How one collective is emitted, step by step (:func:`emit_collective`):

1. :func:`collect_segments`: what moves, as :class:`Segments`: one :class:`CacheRows` segment per
   cache written (cache, slots, layout) and one payload per distinct tensor a replica needs
   (slot mappings, re-run inputs; under the deferred schedule a snapshot taken right after the
   site);
2. the :class:`Transport` (one object per collective) emits the nodes that move the segments
   between ranks (:meth:`Transport.exchange`);
3. in graph order, the transport applies the other ranks' cache rows
   (:meth:`Transport.apply_rows`), and every re-run site calls its op again on every rank's
   inputs (:func:`emit_rerun`).

``fp`` is the graph fingerprint (:func:`graph_fingerprint`): a hash of the rewritten graph and the
plan, carried in every header so ranks that traced different graphs fail loudly.
"""

from __future__ import annotations

import abc
import hashlib
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
import torch.fx

import pcppass.sync.context_restore  # noqa: F401  (registers pcppass::sync_context_snapshot, _verdict)
import pcppass.sync.rerun_context  # noqa: F401  (registers pcppass::sync_rerun_context)
import pcppass.sync.rows  # noqa: F401  (registers the pcppass::sync_* ops)
from pcppass.analysis.views import node_value
from pcppass.errors import PcpSyncError
from pcppass.sync.rows import encode_layout
from pcppass.rewrite.overlap import start_exchange_early
from pcppass.rewrite.plan import CacheRef, ContextRef, PlanError, SyncPlan, SyncSite, written_arg_names
from pcppass.spec import Recipe, ResolvedLayout

Schedule = Literal["deferred", "immediate"]
SCHEDULES: tuple[Schedule, ...] = ("deferred", "immediate")

_c10d = torch.ops._c10d_functional
_SYNC = torch.ops.pcppass
#: stands in for the fingerprint until the rewritten graph can be hashed
_FINGERPRINT_PENDING = ""


@dataclass
class SyncRewrite:
    """What :func:`insert_sync` did to the graph."""

    schedule: Schedule
    fingerprint: str
    collectives: int
    sites: int
    nodes: list[torch.fx.Node] = field(default_factory=list)
    #: the graph inputs as traced (:func:`input_signature`), hashed into the fingerprint
    inputs: str = ""


# ---------------------------------------------------------------------------------------------
# Emitting nodes
# ---------------------------------------------------------------------------------------------


class GraphEmitter:
    """Creates the sync nodes at the graph's current insert point and remembers them (and which
    argument of which node receives the fingerprint once the rewritten graph is hashed)."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.nodes: list[torch.fx.Node] = []
        self._fingerprint_args: list[tuple[torch.fx.Node, int]] = []

    def call(self, target: Callable, *args: Any, kwargs: dict[str, Any] | None = None,
             fingerprint_at: int | None = None) -> torch.fx.Node:
        """``target(*args, **kwargs)`` as a new node; ``fingerprint_at``: the argument that carries
        the graph fingerprint (emitted as a placeholder, filled in by :meth:`set_fingerprint`)."""
        node = self.graph.call_function(target, args, kwargs or {})
        self.nodes.append(node)
        if fingerprint_at is not None:
            self._fingerprint_args.append((node, fingerprint_at))
        return node

    def set_fingerprint(self, fingerprint: str) -> None:
        for node, position in self._fingerprint_args:
            args = list(node.args)
            args[position] = fingerprint
            node.args = tuple(args)


# ---------------------------------------------------------------------------------------------
# Segments: what one collective moves
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheRows:
    """A cache-row segment: the rows ``site`` wrote into ``cache`` at ``slots``.

    For a context-addressed cache (``cache`` a :class:`ContextRef`) the rows and their slots are
    read at run time by ``pcppass::sync_context_rows`` and travel as payloads."""

    site: SyncSite
    state: str
    cache: CacheRef
    #: the slot mapping as sent (under the deferred schedule, a snapshot taken after the site)
    slots: torch.fx.Node
    layout: ResolvedLayout
    #: segment numbers in the packed buffer: these rows, and the payload carrying their slots
    rows_segment: int
    slots_segment: int


@dataclass(frozen=True)
class WrittenRows:
    """A graph cache a site writes, and where the gathered buffer holds every rank's slots of
    those rows (a ``COPY_ROWS`` segment's slots, or a re-run's slot payload): what the verdict
    checks and the snapshot covers."""

    site: SyncSite
    state: str
    cache: torch.fx.Node
    #: the slot mapping the site's op takes (its own dtype), for the snapshot before the write
    local_slots: torch.fx.Node
    slots_segment: int
    layout: ResolvedLayout


@dataclass(frozen=True)
class ContextWritten:
    """A context-addressed cache a site writes, and where the gathered buffer holds every rank's
    slots of those rows (the rows' slots, or a re-run's state lines): what the context verdict
    checks and the site's context snapshot covers."""

    site: SyncSite
    ref: ContextRef
    layout: ResolvedLayout
    slots_segment: int


@dataclass(frozen=True)
class RerunInputs:
    """A re-run site's per-row inputs: schema argument name -> payload segment number; for a
    context-addressed site, also the payload carrying its rows' state lines (read at run time)."""

    site: SyncSite
    segments: dict[str, int]
    lines: int | None = None


@dataclass(frozen=True)
class Segments:
    """Everything one collective moves, in packing order: every cache's rows, then the payloads
    (rows-first tensors: slot mappings and re-run inputs, each sent once)."""

    sites: tuple[SyncSite, ...]
    rows: tuple[CacheRows, ...]
    payloads: tuple[torch.fx.Node, ...]
    reruns: tuple[RerunInputs, ...]
    #: what the scatter into (or a re-run of) context-addressed caches waits for. Deferred
    #: schedule: the step's outputs, so every op whose result reaches them (vLLM's attention, its
    #: state ops) has read the caches before other ranks' rows land, as functionalization orders a
    #: graph cache's scatter after its reads. Immediate schedule: nothing (the readers wait on the
    #: scatter instead).
    context_after: tuple[torch.fx.Node, ...] = ()
    #: every graph cache the sites write, with its slot segment (the verdict's entries)
    written: tuple[WrittenRows, ...] = ()
    #: every context-addressed cache the sites write, with its slot segment, in site order
    context_written: tuple[ContextWritten, ...] = ()
    #: the immediate schedule, on a step that writes context-addressed caches: every collective
    #: of the step is decided by a context verdict, and the rows it applies stay with the step
    #: (written back if a later collective refuses it)
    context_step: bool = False
    #: the step's last collective (deferred: its only one): no later verdict can refuse the step
    context_final: bool = True
    #: the deferred schedule: a refused step writes back what the sites wrote (snapshots)
    restore: bool = False

    @property
    def graph_rows(self) -> tuple[CacheRows, ...]:
        """The cache-row segments of graph tensors (the first segments of the buffer)."""
        return tuple(r for r in self.rows if not isinstance(r.cache, ContextRef))

    @property
    def count(self) -> int:
        return len(self.graph_rows) + len(self.payloads)

    def payload(self, segment: int) -> torch.fx.Node:
        """The local tensor of payload segment number ``segment``."""
        return self.payloads[segment - len(self.graph_rows)]

    def rows_of(self, site: SyncSite) -> list[CacheRows]:
        return [r for r in self.rows if r.site is site]

    def rerun_of(self, site: SyncSite) -> RerunInputs | None:
        return next((r for r in self.reruns if r.site is site), None)


class _SegmentCollector:
    """Builds :class:`Segments`; emits the snapshot and ``movedim`` nodes the payloads need."""

    def __init__(self, emit: GraphEmitter, snapshot: bool) -> None:
        self.emit = emit
        self.snapshot = snapshot
        self.payloads: list[torch.fx.Node] = []
        self._payload_index: dict[tuple[torch.fx.Node, int], int] = {}
        #: (site node, tensor, "before" | "after" the site) -> its copy
        self._snapshots: dict[tuple[torch.fx.Node, torch.fx.Node, str], torch.fx.Node] = {}

    def as_sent(self, site: SyncSite, node: torch.fx.Node, *, mutated_by_op: bool = False) -> torch.fx.Node:
        """``node`` as the site consumed it. Under the deferred schedule the sync runs long after
        the site, so a tensor the graph computed is copied right after the site: a later in-place
        update (``x.add_(...)``) must not change what the replicas re-run on or which slots they
        fill. Graph inputs are state-checked by the analysis (a write to one is reported) and are
        sent as they are. An input the op itself writes (``mutated_by_op``) is copied right
        BEFORE the site, under either schedule: the replicas must re-run on what the owner's op
        read, not on what it left."""
        if mutated_by_op:
            key = (site.node, node, "before")
            if key not in self._snapshots:
                with self.emit.graph.inserting_before(site.node):
                    self._snapshots[key] = self.emit.call(torch.clone, node)
            return self._snapshots[key]
        if not self.snapshot or node.op == "placeholder":
            return node
        key = (site.node, node, "after")
        if key not in self._snapshots:
            with self.emit.graph.inserting_after(site.node):
                self._snapshots[key] = self.emit.call(torch.clone, node)
        return self._snapshots[key]

    def slots_as_sent(self, site: SyncSite, node: torch.fx.Node) -> torch.fx.Node:
        """A slot mapping as the site consumed it, as int64: the sync ops, kernels and checks read
        slots as int64 words. Any other integer dtype (int32 slot mappings are common) is
        converted right after the site, which also stands for the deferred schedule's copy; the
        values are the same, the owner's op still takes its own tensor."""
        if slot_dtype(node) in (torch.int64, None):
            return self.as_sent(site, node)
        key = (site.node, node, "int64")
        if key not in self._snapshots:
            with self.emit.graph.inserting_after(site.node):
                self._snapshots[key] = self.emit.call(_TO_COPY, node, kwargs={"dtype": torch.int64})
        return self._snapshots[key]

    def payload(self, node: torch.fx.Node, dim: int = 0) -> int:
        """Index among the payloads of ``node`` sent rows first (each tensor and dim sent once)."""
        key = (node, dim)
        if key not in self._payload_index:
            rows_first = node if dim == 0 else self.emit.call(torch.movedim, node, dim, 0)
            self._payload_index[key] = len(self.payloads)
            self.payloads.append(rows_first)
        return self._payload_index[key]


def collect_segments(emit: GraphEmitter, sites: Sequence[SyncSite], *, snapshot: bool,
                     context_step: bool = False, context_final: bool = True) -> Segments:
    """The segments that sync ``sites``: every cache written by a ``COPY_ROWS`` site (its slots
    as a payload; a context-addressed cache's rows and slots, read at run time, as two payloads)
    and every per-row input of a ``RERUN`` site, as payloads (a context-addressed one's state
    lines, read at run time, too)."""
    collector = _SegmentCollector(emit, snapshot)
    copies: list[tuple[SyncSite, Any, torch.fx.Node, int]] = []  # site, cache sync, slots, payload
    contexts: list[tuple[SyncSite, Any, torch.fx.Node, int, int]] = []  # ... rows and slots payloads
    reruns: list[tuple[SyncSite, dict[str, int], int | None]] = []  # site, inputs, lines payload
    for site in sites:
        if site.recipe is Recipe.COPY_ROWS:
            for cache in site.caches:
                if isinstance(cache.cache, ContextRef):
                    rows, slots = read_context_rows(emit, site, cache)
                    contexts.append((site, cache, slots, collector.payload(rows), collector.payload(slots)))
                    continue
                slots = collector.slots_as_sent(site, cache.slots)
                copies.append((site, cache, slots, collector.payload(slots)))
        else:
            inputs = {
                name: collector.payload(_rerun_input(collector, site, name), dim)
                for name, dim in site.row_args.items()
            }
            lines = collector.payload(read_context_lines(emit, site)) if site.context is not None else None
            reruns.append((site, inputs, lines))
    first_payload = len(copies)
    rows = tuple(
        CacheRows(site, cache.state, cache.cache, slots, cache.layout, rows_segment=i,
                  slots_segment=first_payload + payload)
        for i, (site, cache, slots, payload) in enumerate(copies)
    ) + tuple(
        CacheRows(site, cache.state, cache.cache, slots, cache.layout,
                  rows_segment=first_payload + rows_payload, slots_segment=first_payload + slots_payload)
        for site, cache, slots, rows_payload, slots_payload in contexts
    )
    rerun_inputs = tuple(RerunInputs(site, {name: first_payload + p for name, p in payloads.items()},
                                     None if lines is None else first_payload + lines)
                         for site, payloads, lines in reruns)
    return Segments(
        sites=tuple(sites), rows=rows, payloads=tuple(collector.payloads), reruns=rerun_inputs,
        context_after=_step_outputs(emit.graph) if snapshot and (
            contexts or any(lines is not None for _, _, lines in reruns)) else (),
        written=_written_rows(rows, rerun_inputs), context_written=_context_written(rows, rerun_inputs),
        context_step=context_step, context_final=context_final, restore=snapshot,
    )


def _rerun_input(collector: _SegmentCollector, site: SyncSite, name: str) -> torch.fx.Node:
    """A re-run's per-row input as sent (slot mappings as int64; :func:`emit_rerun` gives the
    op its own dtype back)."""
    if name in site.slot_args and name not in site.mutated_row_args:
        return collector.slots_as_sent(site, site.arguments[name])
    return collector.as_sent(site, site.arguments[name], mutated_by_op=name in site.mutated_row_args)


def _written_rows(rows: Sequence[CacheRows], reruns: Sequence[RerunInputs]) -> tuple[WrittenRows, ...]:
    """Every graph cache the sites write with its slot segment, in graph order."""
    written = []
    for r in rows:
        if isinstance(r.cache, torch.fx.Node):
            cache = next(c for c in r.site.caches if c.cache is r.cache and c.state == r.state)
            written.append(WrittenRows(r.site, r.state, r.cache, cache.slots, r.slots_segment, r.layout))
    for rerun in reruns:
        for c in rerun.site.caches:
            if not isinstance(c.cache, torch.fx.Node):  # context-addressed: no graph cache to snapshot
                continue
            role = next(role for role in rerun.site.pattern.caches if role.arg == c.arg)
            if role.slots in rerun.segments:
                written.append(WrittenRows(rerun.site, c.state, c.cache, c.slots, rerun.segments[role.slots],
                                           c.layout))
    return tuple(sorted(written, key=lambda w: w.site.index))


def _context_written(rows: Sequence[CacheRows], reruns: Sequence[RerunInputs]) -> tuple[ContextWritten, ...]:
    """Every context-addressed cache the sites write with its slot segment, grouped by site in
    graph order (one context snapshot per site covers its entries)."""
    written = [ContextWritten(r.site, r.cache, r.layout, r.slots_segment)
               for r in rows if isinstance(r.cache, ContextRef)]
    for rerun in reruns:
        if rerun.lines is not None:
            written += [ContextWritten(rerun.site, c.cache, c.layout, rerun.lines)
                        for c in rerun.site.caches if isinstance(c.cache, ContextRef)]
    return tuple(sorted(written, key=lambda w: w.site.index))


_TO_COPY = torch.ops.aten._to_copy.default


def slot_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype of a slot mapping node (through the copies and conversions the rewrite makes)."""
    if node.op == "call_function" and node.target is _TO_COPY:
        return node.kwargs.get("dtype")
    while node.op == "call_function" and node.target is torch.clone:
        node = node.args[0]
    value = node_value(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def _step_outputs(graph: torch.fx.Graph) -> tuple[torch.fx.Node, ...]:
    """The tensor nodes the graph returns."""
    (output,) = graph.find_nodes(op="output")
    return tuple(n for n in _flat_nodes(output.args) if isinstance(node_value(n), torch.Tensor))


def _flat_nodes(value: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, found.append)
    return found


def read_context_rows(emit: GraphEmitter, site: SyncSite, cache: Any) -> tuple[torch.fx.Node, torch.fx.Node]:
    """Emit the run-time read of a context-addressed cache's rows and slots, after its write::

        rows, slots = pcppass.sync_context_rows(resolver, handle, cache_role, slots_role, layout,
                                                 <a row input of the op>, [<the op's result>])

    The op's result (vLLM's update ops return an empty dependency token) orders the read after
    the write, which the graph cannot see."""
    ref: ContextRef = cache.cache
    read = emit.call(_SYNC.sync_context_rows.default, ref.resolver, ref.handle, ref.cache_role,
                     ref.slots_role, encode_layout(cache.layout), site.rows_like(), [_result_tensor(site)])
    return emit.call(operator.getitem, read, 0), emit.call(operator.getitem, read, 1)


def read_context_lines(emit: GraphEmitter, site: SyncSite) -> torch.fx.Node:
    """Emit the run-time read of a context-addressed re-run site's state lines (one per row, -1
    where the op wrote none), after the op::

        lines = pcppass.sync_context_slots(resolver, handle, slots_role, <a row input>, [<result>])
    """
    ref = site.context
    return emit.call(_SYNC.sync_context_slots.default, ref.resolver, ref.handle, ref.slots_role,
                     site.rows_like(), [_result_tensor(site)])


def _result_tensor(site: SyncSite) -> torch.fx.Node:
    """A tensor the op produces, to order its sync after it: its result (the first tensor of a
    tuple result), else the first argument its schema marks written (vLLM's attention ops return
    nothing and write ``output``: every later read of that argument comes after the op)."""
    value = node_value(site.node)
    if isinstance(value, torch.Tensor):
        return site.node
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                return _getitem(site.node, i)
    for name in written_arg_names(site.node):
        written = site.arguments.get(name)
        if isinstance(written, torch.fx.Node) and isinstance(node_value(written), torch.Tensor):
            return written
    raise PlanError(f"{site.label}: a context-addressed write must return a tensor (a dependency "
                    f"token) or write a tensor argument, to order its sync after it; it returns "
                    f"{type(value).__name__} and writes none")


def _getitem(node: torch.fx.Node, index: int) -> torch.fx.Node:
    with node.graph.inserting_after(node):
        return node.graph.call_function(operator.getitem, (node, index))


# ---------------------------------------------------------------------------------------------
# Transports: how the segments move between ranks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyncGroup:
    """The ranks a collective syncs, and the run-time checks its nodes perform."""

    group_name: str
    world_size: int
    #: every rank's header must carry this graph's fingerprint and segment sizes
    verify_header: bool = True
    #: a slot written by two ranks in one step raises
    check_conflicts: bool = True


class Transport(abc.ABC):
    """Moves one collective's segments between ranks and applies the cache rows (the seam).

    :func:`emit_collective` creates one transport per collective, calls :meth:`exchange` once
    where the collective runs, then, in graph order, :meth:`apply_rows` for batches of cache-row
    segments (each cache at most once per batch) and :meth:`every_rank` for each input a re-run
    needs. Every method emits graph nodes through :attr:`emit`; nothing runs at rewrite time.
    """

    def __init__(self, emit: GraphEmitter, group: SyncGroup) -> None:
        self.emit = emit
        self.group = group

    @abc.abstractmethod
    def exchange(self, segments: Segments) -> None:
        """Emit the nodes that move ``segments`` from every rank to every other rank."""

    @abc.abstractmethod
    def apply_rows(self, rows: Sequence[CacheRows]) -> None:
        """Emit the nodes that write the other ranks' rows of ``rows`` into this replica."""

    @abc.abstractmethod
    def every_rank(self, segment: int, mask_own_rows: bool) -> torch.fx.Node:
        """A node holding payload ``segment`` of every rank, concatenated along dim 0 (rank
        order); with ``mask_own_rows`` (a re-run's slots) this rank's own rows read -1."""

    @property
    def context_token(self) -> torch.fx.Node | None:
        """The token of the last scatter into context-addressed caches, which readers of those
        caches wait on under the immediate schedule; None: this transport emitted none (a
        transport that cannot write context caches refuses them in :meth:`exchange`)."""
        return None

    def expect_batches(self, count: int) -> None:
        """Called once before the first :meth:`apply_rows`: how many batches of cache rows this
        collective applies (more than one where a re-run site, or a cache written twice, splits
        them)."""

    def finish(self) -> None:
        """Called once after the collective's last batch and re-run."""


TransportFactory = Callable[[GraphEmitter, SyncGroup], Transport]


def _lines(values: Sequence[str]) -> str:
    """One value per line (a value's own line breaks become spaces)."""
    return "\n".join(v.replace("\n", " ") for v in values)


def _labels(rows: Sequence[CacheRows]) -> str:
    return _lines([r.site.label for r in rows])


def _cache_positions(written: Sequence[WrittenRows]) -> tuple[list[torch.fx.Node], dict[torch.fx.Node, int]]:
    """The distinct graph caches ``written`` writes, and each one's position among them."""
    caches = list(dict.fromkeys(w.cache for w in written))
    return caches, {c: i for i, c in enumerate(caches)}


def emit_snapshots(emit: GraphEmitter, segments: Segments) -> list[tuple[torch.fx.Node, list[WrittenRows]]]:
    """``pcppass.sync_snapshot`` of every graph cache the sites write, at this rank's slots, right
    before the first site (one op); an entry whose cache view or slot mapping the graph computes
    later gets its own snapshot right before its site (restored first: see
    :func:`pcppass.sync.rows.restore_snapshots`). Returns each snapshot node and its entries."""
    if not segments.written:
        return []
    graph = emit.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((site.node for site in segments.sites), key=order.__getitem__)
    groups: dict[torch.fx.Node, list[WrittenRows]] = {}
    for w in segments.written:
        ready = order[w.cache] < order[first] and order[w.local_slots] < order[first]
        groups.setdefault(first if ready else w.site.node, []).append(w)
    snapshots = []
    for at in sorted(groups, key=order.__getitem__):
        entries = groups[at]
        with graph.inserting_before(at):
            node = emit.call(_SYNC.sync_snapshot.default, [w.cache for w in entries],
                             [w.local_slots for w in entries], [x for w in entries for x in encode_layout(w.layout)])
        snapshots.append((node, entries))
    return snapshots


def _ordering_input(site: SyncSite) -> torch.fx.Node:
    """A tensor the site's op reads and does not write (a per-row input first: the cheapest to
    copy): the op takes the context snapshot's copy of it, so it cannot run before the snapshot."""
    written = set(written_arg_names(site.node))
    names = [*site.pattern.row_args, *site.arguments]
    for name in names:
        value = site.arguments.get(name)
        if name not in written and isinstance(value, torch.fx.Node) and isinstance(node_value(value), torch.Tensor):
            return value
    raise PlanError(f"{site.label}: a context-addressed write site needs a tensor input it does not "
                    f"write, to order the snapshot of its caches before it")


def emit_context_snapshots(emit: GraphEmitter,
                           segments: Segments) -> list[tuple[torch.fx.Node, list[ContextWritten]]]:
    """``pcppass.sync_context_snapshot`` of every context-addressed cache a site writes, right
    before the site, which takes the snapshot's copy of one of its inputs
    (:mod:`pcppass.sync.context_restore`). Returns each snapshot node and its entries, in site
    order."""
    by_site: dict[int, list[ContextWritten]] = {}
    for w in segments.context_written:
        by_site.setdefault(w.site.index, []).append(w)
    snapshots = []
    for entries in by_site.values():
        site = entries[0].site
        through = _ordering_input(site)
        with emit.graph.inserting_before(site.node):
            snap = emit.call(_SYNC.sync_context_snapshot.default, *_context_texts(entries),
                             [x for w in entries for x in encode_layout(w.layout)], site.rows_like(), through)
            snapshot = emit.call(operator.getitem, snap, 0)
            copy = emit.call(operator.getitem, snap, 1)
        site.node.replace_input_with(through, copy)
        snapshots.append((snapshot, entries))
    return snapshots


def _context_texts(entries: Sequence[ContextWritten]) -> list[str]:
    """Resolvers, handles, cache roles and slot roles of ``entries``, one per line each."""
    return [_lines([w.ref.resolver for w in entries]), _lines([w.ref.handle for w in entries]),
            _lines([w.ref.cache_role for w in entries]), _lines([w.ref.slots_role for w in entries])]


def emit_context_verdict(emit: GraphEmitter, group: SyncGroup, segments: Segments, gathered: torch.fx.Node,
                         index: torch.fx.Node, snapshots: Sequence[tuple[torch.fx.Node, list[ContextWritten]]],
                         graph_snapshots: Sequence[torch.fx.Node]) -> torch.fx.Node:
    """``pcppass.sync_context_verdict`` over every cache the collective's sites write, context
    entries in the snapshots' order; returns the index copy every later op of the collective
    takes. ``graph_snapshots``: graph-cache snapshots no graph verdict takes (they stay with the
    step), which it only keeps alive."""
    entries = [w for _, part in snapshots for w in part]
    written = segments.written
    caches, position = _cache_positions(written)
    return emit.call(
        _SYNC.sync_context_verdict.default, gathered, index, group.world_size, _FINGERPRINT_PENDING,
        segments.count, group.verify_header, group.check_conflicts,
        caches, [position[w.cache] for w in written], [w.slots_segment for w in written],
        [x for w in written for x in encode_layout(w.layout)], _lines([w.site.label for w in written]),
        *_context_texts(entries), [w.slots_segment for w in entries],
        [x for w in entries for x in encode_layout(w.layout)],
        _lines([f"{w.site.op} at {w.site.source} writing {w.ref.handle} ({w.ref.cache_role})" for w in entries]),
        [i for i, w in enumerate(entries) if w.site.recipe is Recipe.RERUN],
        [node for node, _ in snapshots], [len(part) for _, part in snapshots], list(graph_snapshots),
        group.group_name, segments.context_final, fingerprint_at=3)


def emit_verdict(emit: GraphEmitter, group: SyncGroup, segments: Segments, gathered: torch.fx.Node,
                 index: torch.fx.Node, snapshots: Sequence[tuple[torch.fx.Node, list[WrittenRows]]]) -> torch.fx.Node:
    """``pcppass.sync_verdict`` over every cache the collective's sites write (see
    :class:`AllGatherTransport`)."""
    written = segments.written
    caches, position = _cache_positions(written)
    restored = [w for _, entries in snapshots for w in entries]
    return emit.call(
        _SYNC.sync_verdict.default, caches, gathered, index, group.world_size, _FINGERPRINT_PENDING,
        segments.count, group.verify_header, [position[w.cache] for w in written],
        [w.slots_segment for w in written], [x for w in written for x in encode_layout(w.layout)],
        _lines([w.site.label for w in written]), group.check_conflicts,
        [node for node, _ in snapshots], [w.local_slots for w in restored], [position[w.cache] for w in restored],
        [x for w in restored for x in encode_layout(w.layout)], [len(entries) for _, entries in snapshots],
        group.group_name, fingerprint_at=4)


class AllGatherTransport(Transport):
    """pack -> ``all_gather_into_tensor`` + ``wait_tensor`` -> read header -> verdict -> batched
    scatter::

        snapshot = pcppass.sync_snapshot(caches, slots, layouts)    # deferred: before the first write
        snap, x2 = pcppass.sync_context_snapshot(..., x, x)        # before a context site, which takes x2
        ...
        packed   = pcppass.sync_pack(fp, caches, slots, layouts, payloads)
        gathered = wait_tensor(all_gather_into_tensor(packed, world, group))
        index    = pcppass.sync_read_header(gathered, world, fp, n_segments, False)
        index    = pcppass.sync_context_verdict(gathered, index, ..., [snap], ...)  # context caches
        verdict  = pcppass.sync_verdict(caches, gathered, index, ..., [snapshot], ...)
        pcppass.sync_scatter_rows_all(caches, gathered, index, rows_segs, slots_segs, layouts,
                                      group, labels, check_conflicts, verdict)    # apply_rows
        token = pcppass.sync_scatter_context(gathered, index, resolvers, handles, roles, rows_segs,
                                             slots_segs, layouts, group, labels, check_conflicts)
        pcppass.sync_unpack(gathered, index, segment, local, group, mask, verdict)  # every_rank

    The verdict (:func:`pcppass.sync.rows.sync_verdict`) reads every rank's header and slots
    once for the whole collective, before its first scatter, however many batches a re-run splits
    the scatters into: a refused step applies no batch and re-runs nothing on any rank, and under
    the deferred schedule every rank writes back, from the snapshot, the rows its own ops wrote.
    (With the header and slot checks off, or no graph cache written, there is neither verdict nor
    snapshot.) With context-addressed caches, ``sync_context_verdict`` decides first, over graph
    and context caches alike (:mod:`pcppass.sync.context_restore`).
    Context-addressed caches are resolved by the scatter at run time; it returns an empty token
    (:attr:`context_token`) that readers of those caches can wait on.
    """

    def __init__(self, emit: GraphEmitter, group: SyncGroup) -> None:
        super().__init__(emit, group)
        self.segments: Segments | None = None
        self.gathered: torch.fx.Node | None = None
        self.index: torch.fx.Node | None = None
        self.verdict: torch.fx.Node | None = None
        self._context_token: torch.fx.Node | None = None
        #: a context verdict decided the collective: the context scatter need not check again
        self._context_decided = False

    @property
    def context_token(self) -> torch.fx.Node | None:
        return self._context_token

    def exchange(self, segments: Segments) -> None:
        emit, group = self.emit, self.group
        # the graph verdict mutates the graph caches it writes back: only where some are written
        # (a mutating op with nothing to mutate cannot be lowered by Inductor); context-addressed
        # caches have their own verdict, which mutates no graph tensor
        checks = group.verify_header or group.check_conflicts
        # a refused step writes back what the context-addressed sites wrote too, decided before any
        # of the collective's scatters (and before the graph caches' verdict). Under the immediate
        # schedule a step with context sites has every collective decided there, graph-only ones
        # too, so that their snapshots and the rows they apply stay with the step until its last
        # collective (the graph verdict would take its snapshots over)
        context_step = segments.context_step
        context_checked = checks and (bool(segments.context_written) or (context_step and bool(segments.written)))
        checked = checks and bool(segments.written) and not context_step
        snapshots = (emit_snapshots(emit, segments)
                     if checks and segments.written and (segments.restore or context_step) else [])
        context_snapshots = emit_context_snapshots(emit, segments) if context_checked else []
        graph_rows = segments.graph_rows
        layouts = [x for rows in graph_rows for x in encode_layout(rows.layout)]
        packed = emit.call(_SYNC.sync_pack.default, _FINGERPRINT_PENDING,
                           [r.cache for r in graph_rows], [r.slots for r in graph_rows],
                           layouts, list(segments.payloads), fingerprint_at=0)
        gathered = emit.call(_c10d.all_gather_into_tensor.default, packed, group.world_size,
                             group.group_name)
        self.gathered = emit.call(_c10d.wait_tensor.default, gathered)
        self.index = emit.call(_SYNC.sync_read_header.default, self.gathered, group.world_size,
                               _FINGERPRINT_PENDING, segments.count,
                               group.verify_header and not (checked or context_checked), fingerprint_at=2)
        self.segments = segments
        self._context_decided = context_checked
        if context_checked:
            self.index = emit_context_verdict(emit, group, segments, self.gathered, self.index, context_snapshots,
                                              [] if checked else [node for node, _ in snapshots])
        if checked:
            self.verdict = emit_verdict(emit, group, segments, self.gathered, self.index, snapshots)

    def apply_rows(self, rows: Sequence[CacheRows]) -> None:
        graph_rows = [r for r in rows if not isinstance(r.cache, ContextRef)]
        context_rows = [r for r in rows if isinstance(r.cache, ContextRef)]
        if graph_rows:
            self.emit.call(
                _SYNC.sync_scatter_rows_all.default,
                [r.cache for r in graph_rows], self.gathered, self.index,
                [r.rows_segment for r in graph_rows], [r.slots_segment for r in graph_rows],
                [x for r in graph_rows for x in encode_layout(r.layout)], self.group.group_name,
                _labels(graph_rows), self.group.check_conflicts and not self._context_decided, self.verdict,
            )
        if context_rows:
            refs = [r.cache for r in context_rows]
            self._context_token = self.emit.call(
                _SYNC.sync_scatter_context.default, self.gathered, self.index,
                list(self.segments.context_after), "\n".join(ref.resolver for ref in refs), "\n".join(ref.handle for ref in refs),
                "\n".join(ref.cache_role for ref in refs),
                [r.rows_segment for r in context_rows], [r.slots_segment for r in context_rows],
                [x for r in context_rows for x in encode_layout(r.layout)], self.group.group_name,
                _labels(context_rows), self.group.check_conflicts and not self._context_decided,
            )

    def every_rank(self, segment: int, mask_own_rows: bool) -> torch.fx.Node:
        assert self.segments is not None, "exchange() first"
        return self.emit.call(_SYNC.sync_unpack.default, self.gathered, self.index, segment,
                              self.segments.payload(segment), self.group.group_name, mask_own_rows,
                              self.verdict)


# ---------------------------------------------------------------------------------------------
# One collective: collect -> exchange -> apply rows and re-runs in graph order
# ---------------------------------------------------------------------------------------------


def emit_rerun(emit: GraphEmitter, transport: Transport, rerun: RerunInputs,
               after: Sequence[torch.fx.Node] = ()) -> None:
    """Call the re-run site's op again on every rank's per-row inputs (own slots masked to -1).
    Every output of the call is discarded: the owner keeps its own. A context-addressed site is
    re-run through its resolver instead (:func:`emit_context_rerun`)."""
    site = rerun.site
    if site.context is not None:
        emit_context_rerun(emit, transport, rerun, after)
        return
    if site.node.op != "call_function":
        raise PlanError(f"{site.label}: a re-run needs an op call, got {site.node.op}")
    kwargs = dict(site.arguments)
    for name, dim in site.row_args.items():
        every_rank = transport.every_rank(rerun.segments[name], name in site.slot_args)
        own = slot_dtype(site.arguments[name]) if name in site.slot_args else None
        if own is not None and own != torch.int64:  # sent as int64 (see slots_as_sent)
            every_rank = emit.call(_TO_COPY, every_rank, kwargs={"dtype": own})
        kwargs[name] = every_rank if dim == 0 else emit.call(torch.movedim, every_rank, 0, dim)
    emit.call(site.node.target, kwargs=kwargs)


def emit_context_rerun(emit: GraphEmitter, transport: Transport, rerun: RerunInputs,
                       after: Sequence[torch.fx.Node]) -> None:
    """Re-run a context-addressed site's state update for the other ranks' rows, through the
    resolver's ``rerun`` hook (the op fetches its state, and its batch's metadata, by the handle)::

        pcppass.sync_rerun_context(resolver, handle, op, names, [every rank's inputs],
                                   every rank's lines, after, group, site)
    """
    site, ref = rerun.site, rerun.site.context
    names = list(site.row_args)
    # rows first (the hook's contract), as the payloads travel
    rows = [transport.every_rank(rerun.segments[name], False) for name in names]
    lines = transport.every_rank(rerun.lines, False)
    emit.call(_SYNC.sync_rerun_context.default, ref.resolver, ref.handle, site.op, "\n".join(names), rows,
              lines, list(after), transport.group.group_name, site.label.replace("\n", " "))


def apply_in_graph_order(emit: GraphEmitter, transport: Transport, segments: Segments) -> None:
    """Cache rows and re-runs in the sites' order: a re-run that reads state an earlier site wrote
    sees it synced. Row copies between two re-runs go out as ONE batch (one scatter op); a cache
    appears once per batch."""
    steps: list[list[CacheRows] | RerunInputs] = []
    batch: list[CacheRows] = []
    for site in segments.sites:
        for rows in segments.rows_of(site):
            if any(rows.cache == other.cache for other in batch):
                steps.append(batch)
                batch = []
            batch.append(rows)
        rerun = segments.rerun_of(site)
        if rerun is not None:
            steps += [batch, rerun]
            batch = []
    steps.append(batch)
    transport.expect_batches(sum(1 for step in steps if isinstance(step, list) and step))
    for step in steps:
        if isinstance(step, list):
            transport.apply_rows(step)
        else:
            emit_rerun(emit, transport, step, segments.context_after)
    transport.finish()


def emit_collective(emit: GraphEmitter, sites: Sequence[SyncSite], group: SyncGroup,
                    make_transport: TransportFactory, *, snapshot: bool, context_step: bool = False,
                    context_final: bool = True) -> None:
    """Sync ``sites`` with one collective at the current insert point. ``snapshot``: the deferred
    schedule (the sync runs long after the sites; see :meth:`_SegmentCollector.as_sent`).
    ``context_step``, ``context_final``: see :class:`Segments`."""
    segments = collect_segments(emit, sites, snapshot=snapshot, context_step=context_step,
                                context_final=context_final)
    transport = make_transport(emit, group)
    transport.exchange(segments)
    apply_in_graph_order(emit, transport, segments)
    if not snapshot:
        wait_for_context_sync(emit, sites, transport)


def wait_for_context_sync(emit: GraphEmitter, sites: Sequence[SyncSite], transport: Transport) -> None:
    """Immediate schedule: whatever waited on a context-addressed write's dependency token (vLLM's
    attention op takes it as ``kv_cache_dummy_dep``) waits on the sync instead, so it reads the
    cache only once the other ranks' rows are in (the graph cannot see that it reads the cache).

    Before / after, one vLLM layer::

        token = unified_kv_cache_update(key, value, layer)      token = unified_kv_cache_update(...)
        unified_attention_with_output(..., kv_cache_dummy_dep=token)
                                                                 ... sync ...; synced = sync_scatter_context(...)
                                                                 unified_attention_with_output(..., kv_cache_dummy_dep=synced)
    """
    context_sites = [s for s in sites if any(isinstance(c.cache, ContextRef) for c in s.caches)]
    if not context_sites:
        return
    token = transport.context_token
    if token is None:
        raise PlanError(f"{context_sites[0].label}: the transport {type(transport).__name__} does not "
                        f"sync context-addressed caches")
    ours = set(emit.nodes)
    for site in context_sites:
        value = node_value(site.node)
        if not (isinstance(value, torch.Tensor) and value.numel() == 0):
            raise PlanError(f"{site.label}: under the immediate schedule a context-addressed write must "
                            f"return an empty dependency token its readers wait on; an op that stores and "
                            f"reads in one call (vLLM's attention op on a backend that stores K/V inside "
                            f"it) reads before other ranks' rows can arrive: run it on decode-only steps "
                            f"(schedule='deferred')")
        for user in list(site.node.users):
            if user not in ours:
                user.replace_input_with(site.node, token)


#: what legitimately differs between ranks in a graph's text: object addresses and the rank's
#: own device index (``cuda:1``, ``device(type='cuda', index=1)``)
_RANK_LOCAL = (
    (re.compile(r"0x[0-9a-fA-F]+"), "0x"),
    (re.compile(r"\b(cuda|xpu|mtia|hpu|privateuseone):\d+"), r"\1"),
    (re.compile(r"(device\(type='\w+'), index=\d+\)"), r"\1)"),
)


def graph_fingerprint(gm: torch.fx.GraphModule, plan: SyncPlan, extra: str = "") -> str:
    """Rank-independent hash of the rewritten graph, the shapes it was traced for and its plan
    (addresses and device indices stripped: rank r runs on its own device, the graph is the
    same)."""
    text = str(gm.graph)
    for pattern, replacement in _RANK_LOCAL:
        text = pattern.sub(replacement, text)
    payload = "\n".join([text, input_signature(gm), plan.describe(), extra])
    return hashlib.sha256(payload.encode()).hexdigest()


def input_signature(gm: torch.fx.GraphModule) -> str:
    """Dtype, sizes and strides of every graph input as traced: symbols where Dynamo kept a size
    dynamic, numbers where it specialised one. The graph's text does not show them, and ranks
    whose inputs specialise differently (a row count of 0 on one rank and 1 on another: Dynamo
    always specialises 0 and 1) trace different graphs with the same text, whose collectives
    then move buffers of different sizes."""
    described = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node_value(node)
        if isinstance(value, torch.Tensor):
            sizes, strides = ", ".join(map(str, value.shape)), ", ".join(map(str, value.stride()))
            described.append(f"{node.name}: {value.dtype} [{sizes}] strides ({strides})")
        elif isinstance(value, torch.SymInt | int | float | bool):
            described.append(f"{node.name}: {value}")
        else:
            described.append(f"{node.name}: {type(value).__name__}")
    return "\n".join(described)


def insert_sync(
    gm: torch.fx.GraphModule,
    plan: SyncPlan,
    *,
    schedule: Schedule,
    group_name: str,
    world_size: int,
    verify_header: bool = True,
    check_conflicts: bool = True,
    extra_fingerprint: str = "",
    transport: TransportFactory = AllGatherTransport,
) -> SyncRewrite:
    """Insert the sync of every site of ``plan`` into ``gm`` (in place) and recompile it."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: expected 'deferred' or 'immediate'")
    hazards = plan.deferred_replay_hazards() if schedule == "deferred" else []
    if hazards:
        raise PcpSyncError(
            "pcppass: the deferred schedule would re-run write sites on bytes their owner never "
            "read: " + "; ".join(hazards) + ". Those rows are sent as they are at the end of the "
            "step. Compile this step with schedule='immediate' (each site synced right after it), "
            "or write each row once per step."
        )
    graph = gm.graph
    emit = GraphEmitter(graph)
    group = SyncGroup(group_name, world_size, verify_header, check_conflicts)
    collectives = 0
    if plan.sites:
        if schedule == "deferred":
            with graph.inserting_before(graph.find_nodes(op="output")[0]):
                emit_collective(emit, plan.sites, group, transport, snapshot=True)
            start_exchange_early(graph, plan.sites, emit.nodes)
            collectives = 1
        else:
            context_step = any(site.context is not None for site in plan.sites)
            for i, site in enumerate(plan.sites):
                with graph.inserting_before(site.node.next):
                    emit_collective(emit, [site], group, transport, snapshot=False, context_step=context_step,
                                    context_final=i == len(plan.sites) - 1)
                collectives += 1
    graph.lint()
    gm.recompile()
    fingerprint = graph_fingerprint(gm, plan, f"{schedule} world={world_size} {extra_fingerprint}")
    emit.set_fingerprint(fingerprint)
    gm.recompile()
    return SyncRewrite(schedule, fingerprint, collectives, len(plan.sites), emit.nodes, input_signature(gm))
