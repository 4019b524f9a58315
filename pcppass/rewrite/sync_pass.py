"""``PcpSyncPass``: the whole rewrite as one graph pass (an Inductor ``CustomGraphPass``).

On the Dynamo graph of a decode step it

1. checks the graph stage (:mod:`pcppass.rewrite.stage`): a post-grad graph or a piece of a split
   graph is refused with :class:`~pcppass.errors.PcpGraphStageError`;
2. finds every write into persistent state (:func:`pcppass.analysis.find_state_writes`);
3. decides: one rank or ``dcp_size > 1`` leaves the graph unchanged; an uncovered write or a graph
   break is refused (:class:`~pcppass.errors.PcpCoverageError` listing all of them), or with
   ``on_uncovered="replicate"`` leaves the graph unchanged and says decode must stay replicated;
4. plans the sync (:func:`pcppass.rewrite.plan.plan_sync`) and inserts it
   (:func:`pcppass.rewrite.insert.insert_sync`): the owner's op stays as written, the other
   replicas receive its rows in one collective per step (``schedule="deferred"``) or right
   after each write (``"immediate"``).

Engines that own their compile pipeline call :meth:`PcpSyncPass.apply` (or the pass itself, on
the graph Dynamo hands their backend); :class:`pcppass.compiler.PcpBackend` wraps it with the
run-time orchestration (compile-time fingerprint agreement, input validation, fail-stop, inner
compiler). :meth:`PcpSyncPass.uuid` identifies the pass for Inductor's caches: pcppass's version,
the source of the modules the rewrite depends on, every registered pattern and the configuration.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.distributed as dist
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from pcppass.analysis import StateWrite, find_state_writes
from pcppass.checks import SyncChecks
from pcppass.errors import PcpCoverageError, PcpGraphStageError, PcpSyncError
from pcppass.registry import all_patterns
from pcppass.rewrite.insert import (
    SCHEDULES, AllGatherTransport, Schedule, SyncRewrite, TransportFactory, insert_sync,
)
from pcppass.rewrite.plan import SyncPlan, plan_sync
from pcppass.rewrite.rebinding import rebound_state
from pcppass.rewrite.slot_checks import insert_slot_checks
from pcppass.rewrite.stage import check_graph_stage, graph_breaks, is_dynamo_graph_module
from pcppass.version import __version__

log = logging.getLogger(__name__)

#: ``"unsafe_ignore"`` syncs only the covered writes and leaves the others divergent: it exists
#: for negative controls that prove divergence is detected; never use it to run a model.
OnUncovered = Literal["raise", "replicate", "unsafe_ignore"]
Mode = Literal["sharded", "replicated", "single_rank"]
ON_UNCOVERED: tuple[OnUncovered, ...] = ("raise", "replicate", "unsafe_ignore")

#: modules whose source decides what the pass emits (hashed into :meth:`PcpSyncPass.uuid`)
_SOURCE_MODULES = (
    "pcppass.analysis.classify", "pcppass.analysis.defuse", "pcppass.analysis.recipes",
    "pcppass.analysis.records", "pcppass.analysis.schema", "pcppass.analysis.state_writes",
    "pcppass.analysis.views", "pcppass.checks", "pcppass.sync.rerun_context", "pcppass.sync.rows",
    "pcppass.registry", "pcppass.rewrite.insert",
    "pcppass.rewrite.overlap", "pcppass.rewrite.peer_store",
    "pcppass.rewrite.plan", "pcppass.rewrite.rebinding", "pcppass.rewrite.slot_checks", "pcppass.rewrite.stage",
    "pcppass.rewrite.sync_pass", "pcppass.runtime.validate", "pcppass.spec", "pcppass.sync.slot_check_ops",
)


@dataclass
class SyncPassResult:
    """What :meth:`PcpSyncPass.apply` did with one graph."""

    mode: Mode
    reason: str
    writes: list[StateWrite]
    plan: SyncPlan | None = None
    rewrite: SyncRewrite | None = None
    #: the group the sync collectives use (None when nothing was inserted)
    group: dist.ProcessGroup | None = None


@functools.cache
def _source_hash(module_names: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for name in module_names:
        path = importlib.import_module(name).__file__
        with open(path, "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


def _group_exists(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still registered (destroyed and aborted groups are dropped)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._world.pg_map.get(group) is not None


class PcpSyncPass(CustomGraphPass):
    """The sync rewrite of one decode step's Dynamo graph (see the module docstring).

    ``group``: process group of the PCP ranks (default: the world group, resolved when the pass
    runs). ``schedule``: ``"immediate"`` (the default: a sync right after each write site, correct
    for any step) or ``"deferred"`` (one collective at the end of the step), which the caller
    chooses only for decode-only graphs: it is wrong when a rank reads, within the step, rows
    another rank wrote (partitioned prefill), and nothing in the graph can tell.
    ``dcp_size > 1``: the cache itself is sharded, so decode stays replicated.
    ``whole_step``: the caller guarantees the graph is the whole step (compiled with
    ``fullgraph=True``), for graphs where pcppass cannot tell by itself; a graph break it does
    detect is refused regardless. ``transport``: how each collective moves the rows.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        schedule: Schedule = "immediate",
        on_uncovered: OnUncovered = "raise",
        dcp_size: int = 1,
        checks: SyncChecks = SyncChecks(),
        whole_step: bool = False,
        transport: TransportFactory = AllGatherTransport,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if on_uncovered not in ON_UNCOVERED:
            raise ValueError(f"on_uncovered must be one of {ON_UNCOVERED}, got {on_uncovered!r}")
        if dcp_size < 1:
            raise ValueError(f"dcp_size must be >= 1, got {dcp_size}")
        self.group = group
        self.schedule: Schedule = schedule
        self.on_uncovered: OnUncovered = on_uncovered
        self.dcp_size = dcp_size
        self.checks = checks
        self.whole_step = whole_step
        self.transport = transport
        #: the result of the last :meth:`__call__` (Inductor discards the return value)
        self.last_result: SyncPassResult | None = None
        #: the largest group this pass has synchronised: once it saw P > 1 ranks, a group that is
        #: gone (aborted after a failure, destroyed) never reads as "one rank, nothing to sync"
        self.largest_world = 1

    def __repr__(self) -> str:
        return f"PcpSyncPass({self.config_text()})"

    # -- CustomGraphPass --------------------------------------------------------------------

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        if not isinstance(gm, torch.fx.GraphModule):
            raise PcpGraphStageError("pcppass: PcpSyncPass needs a graph owned by a GraphModule")
        self.last_result = self.apply(gm)

    def uuid(self) -> str:
        """Stable across processes; changes with pcppass's version, the rewrite's source, any
        registered pattern, the configuration and the group it syncs."""
        digest = hashlib.sha256()
        digest.update(__version__.encode())
        digest.update(_source_hash(_SOURCE_MODULES).encode())
        for pattern in sorted(all_patterns(), key=lambda p: p.name):
            digest.update(pattern.uuid().encode())
        digest.update(self.config_text().encode())
        group = self.resolved_group()
        world = dist.get_world_size(group) if group is not None else 1
        digest.update(f"group={group.group_name if group is not None else None} world={world}".encode())
        return digest.hexdigest()

    def config_text(self) -> str:
        """The configuration, as text (part of :meth:`uuid` and of every graph fingerprint)."""
        transport = f"{self.transport.__module__}.{self.transport.__qualname__}"
        return (f"schedule={self.schedule} on_uncovered={self.on_uncovered} dcp_size={self.dcp_size} "
                f"checks={self.checks} whole_step={self.whole_step} transport={transport}")

    # -- the pass ---------------------------------------------------------------------------

    def resolved_group(self) -> dist.ProcessGroup | None:
        if self.group is not None:
            return self.group
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def _group_and_world(self) -> tuple[dist.ProcessGroup | None, int]:
        """The group to sync over and its size; raises where the group cannot be used.

        No group at all (torch.distributed never initialised) is one rank. A group that existed
        and is gone is not: a graph compiled after a fail-stop abort (or a destroyed group) would
        otherwise run its rows unsynchronised while the engine still shards them."""
        group = self.resolved_group()
        try:
            if group is not None and not _group_exists(group):
                raise RuntimeError("the group is no longer registered with torch.distributed")
            world = dist.get_world_size(group) if group is not None else 1
        except (RuntimeError, ValueError) as exc:
            raise PcpSyncError(
                f"pcppass: the process group this pass synchronises over cannot be used ({exc}); "
                "it was probably aborted after a failure or destroyed. Rebuild the group and the "
                "backend before compiling another step.") from exc
        if world == 1 and self.largest_world > 1:
            raise PcpSyncError(
                f"pcppass: this pass synchronised {self.largest_world} ranks before, and now finds "
                f"{'no process group' if group is None else 'a group of one rank'}: the group was "
                "aborted (after a failure) or destroyed. A step compiled now would leave its rows "
                "unsynchronised on the other replicas; rebuild the group and the backend instead.")
        self.largest_world = max(self.largest_world, world)
        return group, world

    def apply(self, gm: torch.fx.GraphModule, *, fingerprint_extra: str = "") -> SyncPassResult:
        """Rewrite ``gm`` in place (or leave it unchanged) and say what was done.

        ``fingerprint_extra``: configuration of the caller that every rank must share (hashed
        into the graph fingerprint with :meth:`config_text`)."""
        check_graph_stage(gm)
        writes = find_state_writes(gm)
        if self.dcp_size > 1:
            return SyncPassResult("replicated", f"dcp_size={self.dcp_size}: the cache is sharded", writes)
        group, world = self._group_and_world()
        if world == 1:
            return SyncPassResult("single_rank", "one rank: nothing to synchronise", writes)
        uncovered = [w for w in writes if not w.covered]
        breaks = self._not_whole_step(gm)
        rebound = self._rebound_state()
        if uncovered or breaks or rebound:
            if self.on_uncovered == "raise":
                raise PcpCoverageError(uncovered, breaks, rebound)
            reasons = [f"{w.op} -> {w.state} at {w.source}" for w in uncovered] + breaks + rebound
            if self.on_uncovered == "replicate":
                reason = (f"{len(uncovered)} uncovered write(s), {len(breaks)} graph break(s), "
                          f"{len(rebound)} rebound state(s): " + "; ".join(reasons))
                log.warning("pcppass: decode stays replicated: %s", reason)
                return SyncPassResult("replicated", reason, writes)
            log.warning("pcppass: %d uncovered write(s), %d graph break(s) and %d rebound state(s) left "
                        "unsynchronised (unsafe_ignore)", len(uncovered), len(breaks), len(rebound))
        plan = plan_sync([w for w in writes if w.covered])
        owners = self.schedule == "immediate" and self.checks.slot_conflicts
        checked = 0
        if self.checks.inputs or owners:
            checked = insert_slot_checks(gm, plan, group_name=group.group_name, world_size=world,
                                         ranges=self.checks.inputs, owners=owners)
        rewrite = insert_sync(
            gm, plan, schedule=self.schedule, group_name=group.group_name, world_size=world,
            verify_header=self.checks.header, check_conflicts=self.checks.slot_conflicts,
            extra_fingerprint=f"{fingerprint_extra} {self.config_text()}", transport=self.transport,
        )
        if checked:  # the slot check's all-gather runs every step too: the report counts it
            rewrite = replace(rewrite, collectives=rewrite.collectives + 1)
        reason = (f"{rewrite.sites} write site(s), {rewrite.collectives} collective(s) per step "
                  f"({self.schedule})")
        return SyncPassResult("sharded", reason, writes, plan, rewrite, group)

    def _rebound_state(self) -> list[str]:
        """State the step rebinds (stores a tensor it computed into a module, dict, closure or
        list after the graph: :mod:`pcppass.rewrite.rebinding`), or why that cannot be told."""
        found = rebound_state()
        if found is not None:
            return found
        if self.whole_step:
            return []
        return ["cannot tell whether the step rebinds state: reading Dynamo's side effects needs "
                f"internals that this torch ({torch.__version__}) does not provide, or no Dynamo "
                "compile is running. If the graph is the whole step and rebinds nothing, say so "
                "with whole_step=True"]

    def _not_whole_step(self, gm: torch.fx.GraphModule) -> list[str]:
        """Why ``gm`` may not be the whole step (graph breaks around it), or [] if it is."""
        if not self.whole_step and not is_dynamo_graph_module(gm):
            raise PcpGraphStageError(
                "pcppass: cannot tell that this graph is the whole step: its GraphModule lacks the "
                "metadata Dynamo puts on the graph it hands a backend (it may be a piece of a split "
                "graph, or a copy). Call the pass on the graph module Dynamo hands your backend, or, "
                "if the graph is the whole step (compiled with fullgraph=True), say so with "
                "whole_step=True."
            )
        breaks = graph_breaks(gm)
        if breaks is None:
            if self.whole_step:
                return []
            return ["cannot tell whether this graph is the whole step: graph-break detection reads "
                    f"Dynamo internals that this torch ({torch.__version__}) does not provide, or no "
                    "Dynamo compile is running. If the step compiles as one graph "
                    "(torch.compile(..., fullgraph=True)), say so with whole_step=True"]
        return breaks
