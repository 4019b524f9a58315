"""The peer-store transport, and the automatic choice between it and the all-gather transport.

:class:`PeerStoreTransport` moves one collective's rows with ONE op (:mod:`pcppass.sync.peer_store`)
when every replica of every cache lives in symmetric memory: each rank stores its rows straight
into every peer's replica and its header and payloads into every rank's mailbox, then waits on a
device epoch. Before (one DeepSeek-V3.2 layer, deferred)::

    fused_norm_rope(..., slots, idx_slots, mla_cache, idx_cache, ...)
    ... attention reads mla_cache, idx_cache ...
    return (hidden,)

After::

    fused_norm_rope(..., slots, idx_slots, mla_cache, idx_cache, ...)             # unchanged
    ... attention reads mla_cache, idx_cache ...
    pcppass.sync_peer_store(fp, [mla_cache, idx_cache], [slots_c, idx_slots_c], layouts,
                            [slots_c, idx_slots_c], [2, 3], group, labels, True, True, False)
    return (hidden,)

No all-gather, no scatter: ``apply_rows`` emits nothing (the rows arrived with the exchange). A
re-run reads every rank's inputs from the mailbox (``sync_read_header`` + ``sync_unpack`` on what
the op returns). Because every cache row is in place right after the exchange, the transport takes
a collective only when no re-run site comes before a row-copy site (a re-run must not see rows of
a site that follows it).

:class:`AutoTransport` (the backend's default) decides per collective: peer stores when
:func:`peer_store_refusal` finds nothing against them, the all-gather transport otherwise (CPU and
gloo, caches outside symmetric memory, context-addressed caches, more payload tensors than one
launch takes). Each emitted node records the choice in ``node.meta["pcppass_transport"]``;
:func:`transports_of` reads it back for reports.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx

import pcppass.sync.peer_store  # noqa: F401  (registers pcppass::sync_peer_store)
from pcppass.sync import row_kernels
from pcppass.sync.rows import encode_layout
from pcppass.rewrite.insert import (
    AllGatherTransport, CacheRows, GraphEmitter, Segments, SyncGroup, Transport, slot_dtype,
)
from pcppass.rewrite.plan import PlanError
from pcppass.spec import Recipe

_SYNC = torch.ops.pcppass
META = "pcppass_transport"
PEER_STORES = "peer stores"
ALL_GATHER = "all-gather"


def _real_tensor(node: torch.fx.Node) -> torch.Tensor | None:
    """The real tensor behind a Dynamo graph input (None when not known at rewrite time)."""
    grapharg = node.meta.get("grapharg") if isinstance(node, torch.fx.Node) else None
    try:
        value = grapharg.example if grapharg is not None else None
    except Exception:  # noqa: BLE001 - a collected weak reference or another kind of argument
        return None
    return value if isinstance(value, torch.Tensor) else None


def peer_store_refusal(segments: Segments, group: SyncGroup) -> str | None:
    """Why peer stores cannot move ``segments`` (None when they can)."""
    from pcppass.sync.peer import cache_refusal, group_refusal
    from torch.distributed.distributed_c10d import _resolve_process_group

    why = group_refusal(_resolve_process_group(group.group_name))
    if why is not None:
        return why
    if not segments.rows:
        return "no cache rows to store"
    for rows in segments.rows:
        if not isinstance(rows.cache, torch.fx.Node):
            return f"{rows.site.label}: the cache is addressed through a context, not a graph tensor"
        real = _real_tensor(rows.cache)
        if real is None:
            return f"{rows.site.label}: the cache's tensor is not known when rewriting"
        why = cache_refusal(real)
        if why is not None:
            return why
        if row_kernels.addressing(real, rows.layout) is None:
            return f"{rows.site.label}: the cache's rows are not contiguous per segment"
        if slot_dtype(rows.slots) != torch.int64:
            return f"{rows.site.label}: the slot mapping is not an int64 tensor"
    if len(segments.payloads) > row_kernels.MAX_ARGS:
        return f"{len(segments.payloads)} payload tensors (one launch takes {row_kernels.MAX_ARGS})"
    rerun_seen = False
    for site in segments.sites:
        if site.recipe is Recipe.COPY_ROWS and rerun_seen:
            return "a re-run site precedes a row-copy site (peer stores land every row at once)"
        rerun_seen = rerun_seen or site.recipe is not Recipe.COPY_ROWS
    return None


class PeerStoreTransport(Transport):
    """``pcppass.sync_peer_store`` (+ header and unpack for re-runs); see the module docstring.
    Refuses (:class:`PlanError`) a collective :func:`peer_store_refusal` refuses."""

    def __init__(self, emit: GraphEmitter, group: SyncGroup) -> None:
        super().__init__(emit, group)
        self.segments: Segments | None = None
        self.mailbox: torch.fx.Node | None = None
        self.index: torch.fx.Node | None = None

    def exchange(self, segments: Segments) -> None:
        why = peer_store_refusal(segments, self.group)
        if why is not None:
            raise PlanError(f"pcppass: peer stores cannot sync this step: {why}")
        emit, group = self.emit, self.group
        rows = segments.rows
        self.mailbox = emit.call(
            _SYNC.sync_peer_store.default, "", [r.cache for r in rows], [r.slots for r in rows],
            [x for r in rows for x in encode_layout(r.layout)], list(segments.payloads),
            [r.slots_segment for r in rows], group.group_name, _labels(rows), group.verify_header,
            group.check_conflicts, bool(segments.reruns), fingerprint_at=0)
        if segments.reruns:
            self.index = emit.call(_SYNC.sync_read_header.default, self.mailbox, group.world_size, "",
                                   segments.count, False, fingerprint_at=2)
        self.segments = segments

    def apply_rows(self, rows: Sequence[CacheRows]) -> None:
        """Nothing: every rank's rows reached every replica in :meth:`exchange`."""

    def every_rank(self, segment: int, mask_own_rows: bool) -> torch.fx.Node:
        assert self.segments is not None and self.index is not None, "exchange() first"
        return self.emit.call(_SYNC.sync_unpack.default, self.mailbox, self.index, segment,
                              self.segments.payload(segment), self.group.group_name, mask_own_rows)


def _labels(rows: Sequence[CacheRows]) -> str:
    return "\n".join(r.site.label.replace("\n", " ") for r in rows)


class AutoTransport(Transport):
    """Peer stores where possible, else the all-gather transport, per collective."""

    def __init__(self, emit: GraphEmitter, group: SyncGroup) -> None:
        super().__init__(emit, group)
        self.chosen: Transport | None = None

    def exchange(self, segments: Segments) -> None:
        why = peer_store_refusal(segments, self.group)
        kind = PeerStoreTransport if why is None else AllGatherTransport
        self.chosen = kind(self.emit, self.group)
        first = len(self.emit.nodes)
        self.chosen.exchange(segments)
        for node in self.emit.nodes[first:]:
            node.meta[META] = PEER_STORES if why is None else f"{ALL_GATHER} ({why})"

    def apply_rows(self, rows: Sequence[CacheRows]) -> None:
        assert self.chosen is not None, "exchange() first"
        self.chosen.apply_rows(rows)

    def every_rank(self, segment: int, mask_own_rows: bool) -> torch.fx.Node:
        assert self.chosen is not None, "exchange() first"
        return self.chosen.every_rank(segment, mask_own_rows)

    def expect_batches(self, count: int) -> None:
        assert self.chosen is not None, "exchange() first"
        self.chosen.expect_batches(count)

    def finish(self) -> None:
        assert self.chosen is not None, "exchange() first"
        self.chosen.finish()

    @property
    def context_token(self) -> torch.fx.Node | None:
        return self.chosen.context_token if self.chosen is not None else None


#: ``PcpBackend(transport=...)`` names
TRANSPORTS = {"auto": AutoTransport, "allgather": AllGatherTransport, "peer": PeerStoreTransport}


def transports_of(gm: torch.fx.GraphModule) -> str:
    """How a rewritten graph moves rows: "peer stores", "all-gather (why not peer stores)", both,
    or "none"."""
    found: dict[str, None] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _SYNC.sync_peer_store.default:
            found.setdefault(node.meta.get(META, PEER_STORES))
        elif node.target is torch.ops._c10d_functional.all_gather_into_tensor.default:
            found.setdefault(node.meta.get(META, ALL_GATHER))
    return "; ".join(found) or "none"

