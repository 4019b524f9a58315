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
  applied in graph order, so a re-run that reads state another site wrote sees it synced.
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

``fp`` is the graph fingerprint (:func:`graph_fingerprint`): a hash of the rewritten graph and the
plan, carried in every header so ranks that traced different graphs fail loudly.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.fx

import pcppass.kernels.rows  # noqa: F401  (registers the pcppass::sync_* ops)
from pcppass.kernels.rows import encode_layout
from pcppass.rewrite.plan import PlanError, SyncPlan, SyncSite
from pcppass.spec import Recipe

Schedule = Literal["deferred", "immediate"]

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


class _CollectiveBuilder:
    """Emits one packed all-gather that syncs ``sites``, at the graph's current insert point."""

    def __init__(self, graph: torch.fx.Graph, group_name: str, world_size: int,
                 verify_header: bool, check_conflicts: bool):
        self.graph = graph
        self.group_name = group_name
        self.world_size = world_size
        self.verify_header = verify_header
        self.check_conflicts = check_conflicts
        self.nodes: list[torch.fx.Node] = []

    def _call(self, target, args, kwargs=None) -> torch.fx.Node:
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        self.nodes.append(node)
        return node

    def emit(self, sites: list[SyncSite], *, snapshot: bool = False) -> None:
        """Sync ``sites`` at the current insert point. With ``snapshot`` (the deferred schedule,
        where the sync runs long after the sites), every payload the graph computed is copied
        right after its site: a later in-place update of that tensor (``x.add_(...)``) must not
        change what the other replicas re-run on or which slots they fill. Graph inputs are
        state-checked by the analysis (a write to one is reported) and are sent once."""
        caches, cache_slots, layouts = [], [], []
        payloads: list[torch.fx.Node] = []
        payload_index: dict[tuple[torch.fx.Node, int], int] = {}
        copy_targets = []  # (site, cache sync, rows segment, payload key of its slots)
        snapshots: dict[tuple[torch.fx.Node, torch.fx.Node], torch.fx.Node] = {}

        def as_sent(site: SyncSite, node: torch.fx.Node) -> torch.fx.Node:
            if not snapshot or node.op == "placeholder":
                return node
            if (site.node, node) not in snapshots:
                with self.graph.inserting_after(site.node):
                    snapshots[(site.node, node)] = self._call(torch.clone, (node,))
            return snapshots[(site.node, node)]

        def payload(node: torch.fx.Node, dim: int = 0) -> tuple[torch.fx.Node, int]:
            key = (node, dim)
            if key not in payload_index:
                rows_first = node if dim == 0 else self._call(torch.movedim, (node, dim, 0))
                payload_index[key] = len(payloads)
                payloads.append(rows_first)
            return key

        rerun_args = []  # (site, {name: payload key})
        for site in sites:
            if site.recipe is Recipe.COPY_ROWS:
                for c in site.caches:
                    slots = as_sent(site, c.slots)
                    copy_targets.append((site, c, len(caches), payload(slots)))
                    caches.append(c.cache)
                    cache_slots.append(slots)
                    layouts.extend(encode_layout(c.layout))
            else:
                rerun_args.append((site, {name: payload(as_sent(site, site.arguments[name]), dim)
                                          for name, dim in site.row_args.items()}))
        num_segments = len(caches) + len(payloads)

        def segment(key: tuple[torch.fx.Node, int]) -> int:
            return len(caches) + payload_index[key]

        packed = self._call(_SYNC.sync_pack.default,
                            (_FINGERPRINT_PENDING, caches, cache_slots, layouts, payloads))
        gathered = self._call(_c10d.all_gather_into_tensor.default,
                              (packed, self.world_size, self.group_name))
        gathered = self._call(_c10d.wait_tensor.default, (gathered,))
        index = self._call(_SYNC.sync_read_header.default,
                           (gathered, self.world_size, _FINGERPRINT_PENDING, num_segments,
                            self.verify_header))
        reruns = dict((id(site), args) for site, args in rerun_args)
        targets_by_site: dict[int, list] = {}
        for entry in copy_targets:
            targets_by_site.setdefault(id(entry[0]), []).append(entry)
        # Graph order: a re-run that reads state written by an earlier site sees it synced. Row
        # copies between re-runs go out as ONE scatter op (one kernel for all caches).
        batch: list[tuple] = []
        for site in sites:
            for _, c, rows_segment, slots_key in targets_by_site.get(id(site), []):
                if any(c.cache is other.cache for _, other, _, _ in batch):
                    self._scatter(batch, gathered, index)  # a cache appears once per op
                    batch = []
                batch.append((site, c, rows_segment, segment(slots_key)))
            if id(site) in reruns:
                self._scatter(batch, gathered, index)
                batch = []
                self._rerun(site, gathered, index, {n: segment(k) for n, k in reruns[id(site)].items()},
                            {n: payloads[payload_index[k]] for n, k in reruns[id(site)].items()})
        self._scatter(batch, gathered, index)

    def _scatter(self, batch: list[tuple], gathered: torch.fx.Node, index: torch.fx.Node) -> None:
        """One ``sync_scatter_rows_all`` for ``(site, cache sync, rows segment, slots segment)``s."""
        if not batch:
            return
        layouts = [x for _, c, _, _ in batch for x in encode_layout(c.layout)]
        self._call(_SYNC.sync_scatter_rows_all.default,
                   ([c.cache for _, c, _, _ in batch], gathered, index, [rows for _, _, rows, _ in batch],
                    [slots for _, _, _, slots in batch], layouts, self.group_name,
                    "\n".join(site.label.replace("\n", " ") for site, _, _, _ in batch), self.check_conflicts))

    def _rerun(self, site: SyncSite, gathered, index, segments: dict[str, int],
               locals_: dict[str, torch.fx.Node]) -> None:
        if site.node.op != "call_function":
            raise PlanError(f"{site.label}: a re-run needs an op call, got {site.node.op}")
        kwargs = dict(site.arguments)
        for name, dim in site.row_args.items():
            every_rank = self._call(_SYNC.sync_unpack.default,
                                    (gathered, index, segments[name], locals_[name],
                                     self.group_name, name in site.slot_args))
            kwargs[name] = every_rank if dim == 0 else self._call(torch.movedim, (every_rank, 0, dim))
        self._call(site.node.target, (), kwargs)


#: what legitimately differs between ranks in a graph's text: object addresses and the rank's
#: own device index (``cuda:1``, ``device(type='cuda', index=1)``)
_RANK_LOCAL = (
    (re.compile(r"0x[0-9a-fA-F]+"), "0x"),
    (re.compile(r"\b(cuda|xpu|mtia|hpu|privateuseone):\d+"), r"\1"),
    (re.compile(r"(device\(type='\w+'), index=\d+\)"), r"\1)"),
)


def graph_fingerprint(gm: torch.fx.GraphModule, plan: SyncPlan, extra: str = "") -> str:
    """Rank-independent hash of the rewritten graph and its plan (addresses and device indices
    stripped: rank r runs on its own device, the graph is the same)."""
    text = str(gm.graph)
    for pattern, replacement in _RANK_LOCAL:
        text = pattern.sub(replacement, text)
    payload = "\n".join([text, plan.describe(), extra])
    return hashlib.sha256(payload.encode()).hexdigest()


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
) -> SyncRewrite:
    """Insert the sync of every site of ``plan`` into ``gm`` (in place) and recompile it."""
    if schedule not in ("deferred", "immediate"):
        raise ValueError(f"unknown schedule {schedule!r}: expected 'deferred' or 'immediate'")
    graph = gm.graph
    builder = _CollectiveBuilder(graph, group_name, world_size, verify_header, check_conflicts)
    collectives = 0
    if plan.sites:
        if schedule == "deferred":
            with graph.inserting_before(graph.find_nodes(op="output")[0]):
                builder.emit(plan.sites, snapshot=True)
            collectives = 1
        else:
            for site in plan.sites:
                with graph.inserting_before(site.node.next):
                    builder.emit([site])
                collectives += 1
    graph.lint()
    gm.recompile()
    fingerprint = graph_fingerprint(gm, plan, f"{schedule} world={world_size} {extra_fingerprint}")
    for node in builder.nodes:
        if node.target in (_SYNC.sync_pack.default, _SYNC.sync_read_header.default):
            args = list(node.args)
            args[0 if node.target is _SYNC.sync_pack.default else 2] = fingerprint
            node.args = tuple(args)
    gm.recompile()
    return SyncRewrite(schedule, fingerprint, collectives, len(plan.sites), builder.nodes)
