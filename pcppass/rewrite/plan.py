"""The sync plan: what every replica must reproduce after a step, derived from covered writes.

:func:`plan_sync` groups the covered :class:`~pcppass.analysis.records.StateWrite` records by the
node that performs them (a fused op writing two caches is one site with two caches) and resolves,
from the pattern, every graph value the rewrite needs: the cache tensor as the op receives it, its
slot mapping, its byte layout, and for re-run sites the per-row inputs and which of them are slots.

The plan is data about the graph; :mod:`pcppass.rewrite.insert` turns it into graph nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from pcppass.analysis.classify import ContextUnresolved, cache_role, context_layouts
from pcppass.analysis.records import StateWrite
from pcppass.analysis.schema import bind_call, resolve_overload, written_args
from pcppass.analysis.views import fake_value, node_value
from pcppass.spec import CacheRole, Recipe, ResolvedLayout, WritePattern, qualified_op_name


class PlanError(ValueError):
    """A covered write cannot be planned (an argument the pattern names is missing or not a tensor)."""


@dataclass(frozen=True)
class ContextRef:
    """A cache the op fetches at run time from a context (vLLM's forward context), not a graph
    tensor: ``resolver`` (registered by name) maps ``handle`` (the handle argument's value, e.g. a
    layer name) to the role tensors; ``cache_role`` and ``slots_role`` name the ones synced."""

    resolver: str
    handle: str
    cache_role: str
    slots_role: str


#: where a synced cache lives: a tensor of the graph, or a context reference resolved at run time
CacheRef = Union[torch.fx.Node, ContextRef]


@dataclass(frozen=True)
class CacheSync:
    """One cache written at a site: the replica must receive these rows."""

    state: str  # source name of the base state tensor
    arg: str  # schema argument through which the op writes it
    cache: CacheRef  # the tensor the op receives (the base or a view of it), or a context ref
    #: the slot mapping addressing it; None for a context ref (read with the rows at run time)
    slots: torch.fx.Node | None
    layout: ResolvedLayout


@dataclass
class SyncSite:
    """One write site (one mutating node) and how the other replicas reproduce it."""

    index: int
    node: torch.fx.Node
    op: str
    pattern: WritePattern
    caches: list[CacheSync]
    source: str
    #: every schema argument of the node, by name (fx nodes or constants)
    arguments: dict[str, Any] = field(default_factory=dict)
    #: re-run sites: per-row inputs (schema name -> row dim), slot arguments among them
    row_args: dict[str, int] = field(default_factory=dict)
    slot_args: tuple[str, ...] = ()
    #: re-run sites: per-row inputs the op itself writes (its schema marks them ``(a!)``): what
    #: the replicas re-run on must be copied before the op runs
    mutated_row_args: tuple[str, ...] = ()
    #: the recipe classification chose for this site's records (None: the pattern's own)
    chosen: Recipe | None = None

    @property
    def recipe(self) -> Recipe:
        return self.chosen or self.pattern.recipe

    @property
    def context(self) -> ContextRef | None:
        """Where a context-addressed site's caches are fetched at run time (None: graph caches)."""
        return next((c.cache for c in self.caches if isinstance(c.cache, ContextRef)), None)

    @property
    def label(self) -> str:
        states = ", ".join(c.state for c in self.caches)
        return f"{self.op} at {self.source} writing {states}"

    def rows_like(self) -> torch.fx.Node:
        """A per-row input of the op (its row count is the rows a context cache is read for)."""
        for name in self.pattern.row_args:
            value = self.arguments.get(name)
            if isinstance(value, torch.fx.Node):
                return value
        raise PlanError(f"{self.label}: none of the pattern's row_args {list(self.pattern.row_args)} "
                        f"is a tensor in the graph")

    def describe(self) -> str:
        """Stable, rank-independent text of this site (part of the graph fingerprint)."""
        caches = "; ".join(
            f"{c.arg}->{c.state} slots={c.slots.name if c.slots is not None else c.cache} "
            f"layout={c.layout}" for c in self.caches
        )
        rows = ",".join(f"{k}:{v}" for k, v in sorted(self.row_args.items()))
        return f"#{self.index} {self.op} node={self.node.name} {self.recipe.value} [{caches}] rows=[{rows}]"


@dataclass
class SyncPlan:
    sites: list[SyncSite]

    def describe(self) -> str:
        return "\n".join(site.describe() for site in self.sites)

    def deferred_replay_hazards(self) -> list[str]:
        """Re-run sites the deferred schedule would replay on the wrong bytes.

        The deferred sync packs every cache's rows at the END of the step and applies them in
        graph order before each re-run. A re-run site that reads a cache written both before it
        (those rows are synced ahead of the re-run) and after it (so the rows sent are the later
        bytes, not those the owner's op read) would re-run on other replicas over bytes the owner
        never saw. Slots are run-time values, so any such cache counts.
        """
        hazards = []
        for b, site in enumerate(self.sites):
            if site.recipe is not Recipe.RERUN:
                continue
            read = storages_of(site.arguments.values())
            for c in read:
                before = [s for s in self.sites[:b] if c in written_storages(s)]
                after = [s for s in self.sites[b + 1:] if c in written_storages(s)]
                if before and after:
                    hazards.append(f"{site.label} reads a cache written before it by {before[0].label} "
                                   f"and again after it by {after[0].label}")
                    break
        return hazards

    @property
    def caches(self) -> list[CacheSync]:
        return [c for site in self.sites for c in site.caches]


def storages_of(values: Any) -> set[StorageWeakRef]:
    """Storages of the fake tensors of graph values (nodes, lists of nodes; constants skipped)."""
    found = set()
    for value in values:
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            fake = node_value(item) if isinstance(item, torch.fx.Node) else None
            if isinstance(fake, torch.Tensor):
                try:
                    found.add(StorageWeakRef(fake.untyped_storage()))
                except (RuntimeError, NotImplementedError):  # no storage: nothing to compare
                    pass
    return found


def written_storages(site: SyncSite) -> set[StorageWeakRef]:
    return storages_of(c.cache for c in site.caches if isinstance(c.cache, torch.fx.Node))


# ---------------------------------------------------------------------------------------------
# Argument binding
# ---------------------------------------------------------------------------------------------


def bind_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """Every argument of a write node by its schema name (``self`` for the method receiver)."""
    bound = bind_call(node)
    if bound is None:
        raise PlanError(f"arguments of node {node.name} match no schema of {node.target}")
    return bound


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


def _role(write: StateWrite) -> CacheRole:
    role = cache_role(write)
    if role is None:
        raise PlanError(f"pattern {write.pattern.name} has no cache role for argument {write.arg!r}")
    return role


def _tensor_node(arguments: dict[str, Any], name: str, site: str) -> torch.fx.Node:
    value = arguments.get(name)
    if isinstance(value, (list, tuple)):  # index_put_ / setitem: the one row-index tensor
        tensors = [v for v in value if isinstance(v, torch.fx.Node)]
        value = tensors[0] if len(tensors) == 1 else value
    if not isinstance(value, torch.fx.Node):
        raise PlanError(f"{site}: argument {name!r} is {value!r}, not a tensor in the graph")
    return value


def _fits_paged(value: Any, layout: ResolvedLayout) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != layout.block_size:
        return False
    row = value.element_size()
    for d in value.shape[2:]:
        row *= d
    return row == layout.bytes_per_row


def _cache_node(write: StateWrite, layout: ResolvedLayout, fallback: torch.fx.Node) -> torch.fx.Node:
    """The tensor the layout addresses: the written tensor, or for a write through a flattened
    view of a paged cache (``cache.view(-1, ...)[slot] = row``) the paged base itself."""
    written = write.written_node if write.written_node is not None else fallback
    if layout.kind != "paged_rows" or _fits_paged(node_value(written), layout):
        return written
    if write.state_node is not None and _fits_paged(node_value(write.state_node), layout):
        return write.state_node
    raise PlanError(f"{write.op} at {write.source}: paged layout {layout} fits neither the written "
                    f"tensor nor {write.state}")


def _layout(write: StateWrite, role: CacheRole, cache: torch.fx.Node,
            arguments: dict[str, Any]) -> ResolvedLayout:
    if write.layout is not None:
        return write.layout
    fake_cache = node_value(cache)
    fake_args = {k: fake_value(v) for k, v in arguments.items()}
    return role.layout.resolve(tuple(fake_cache.shape), fake_cache.element_size(), fake_args)


def _context_caches(write: StateWrite, arguments: dict[str, Any]) -> list[CacheSync]:
    """One :class:`CacheSync` per cache the pattern fetches through the handle ``write.arg``
    (layouts resolved again on what the resolver describes, as classification did)."""
    pattern = write.pattern
    roles = pattern.context_roles(write.arg)
    fake_args = {k: fake_value(v) for k, v in arguments.items()}
    try:
        layouts = context_layouts(pattern, roles, write.state, fake_args)
    except ContextUnresolved as exc:
        raise PlanError(f"{write.op} at {write.source}: {exc}") from exc
    return [CacheSync(write.state, write.arg, ContextRef(pattern.resolver, write.state, role.cache, role.slots),
                      None, layout)
            for role, layout in zip(roles, layouts)]


def written_arg_names(node: torch.fx.Node) -> list[str]:
    """Arguments the op's schema marks as written (none for calls without a schema)."""
    overload = resolve_overload(node.target, node.args, dict(node.kwargs)) if node.op == "call_function" else None
    return written_args(overload._schema) if overload is not None else []


def plan_sync(writes: Sequence[StateWrite]) -> SyncPlan:
    """Group covered writes into sites in graph order and resolve what each site syncs.

    Raises :class:`PlanError` for an uncovered record (the backend handles coverage first).
    """
    by_node: dict[torch.fx.Node, list[StateWrite]] = {}
    for w in writes:
        if not w.covered:
            raise PlanError(f"cannot plan an uncovered write: {w.op} at {w.source}")
        if w.recipe is Recipe.READ_ONLY:
            continue  # the op only reads the state its handle addresses: nothing to sync
        by_node.setdefault(w.node, []).append(w)
    if not by_node:
        return SyncPlan([])
    order = {n: i for i, n in enumerate(next(iter(by_node)).graph.nodes)}
    sites: list[SyncSite] = []
    for node in sorted(by_node, key=order.__getitem__):
        records = by_node[node]
        pattern = records[0].pattern
        op = records[0].op or qualified_op_name(node.target) or str(node.target)
        where = f"{op} at {records[0].source}"
        arguments = dict(records[0].bound_args) or bind_arguments(node)
        caches = []
        for w in records:
            if w.state_node is None:  # a handle: caches fetched at run time through it
                caches.extend(_context_caches(w, arguments))
                continue
            role = _role(w)
            written = w.written_node if w.written_node is not None else _tensor_node(arguments, role.arg, where)
            layout = _layout(w, role, written, arguments)
            slots = _tensor_node(arguments, role.slots, where)
            caches.append(CacheSync(w.state, role.arg, _cache_node(w, layout, written), slots, layout))
        chosen = {w.recipe for w in records}
        if len(chosen) != 1:
            raise PlanError(f"{where}: its records chose different recipes ({sorted(r.value for r in chosen)})")
        site = SyncSite(len(sites), node, op, pattern, caches, records[0].source, arguments,
                        chosen=chosen.pop())
        if site.recipe is Recipe.RERUN:
            _plan_rerun(site, where)
        sites.append(site)
    return SyncPlan(sites)


def _plan_rerun(site: SyncSite, where: str) -> None:
    """A re-run site's per-row inputs, the slot mappings among them and those the op writes. A
    context-addressed site's rows are addressed by the resolver's slots role instead (read at run
    time), so its inputs hold no slot argument."""
    pattern = site.pattern
    site.row_args = dict(pattern.row_args)
    for name in site.row_args:
        _tensor_node(site.arguments, name, where)
    site.mutated_row_args = tuple(name for name in written_arg_names(site.node) if name in site.row_args)
    if site.context is not None:
        return
    site.slot_args = tuple(sorted({r.slots for r in pattern.caches} & set(site.row_args)))
    missing = {r.slots for r in pattern.caches} - set(site.row_args)
    if missing:
        raise PlanError(f"{where}: re-run pattern {pattern.name} must list slot args "
                        f"{sorted(missing)} among its row_args")


def size_expr(size: Any) -> Any:
    """A tensor size as a sympy expression (a size Dynamo kept dynamic) or an int."""
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return int(size)


def num_slots_expr(cache: torch.Tensor, layout) -> Any:
    """How many slots ``cache`` holds under ``layout`` (:func:`size_expr` of its sizes)."""
    if layout.kind == "paged_rows":
        return size_expr(cache.shape[0]) * size_expr(cache.shape[1])
    if layout.kind == "block_split":
        return size_expr(cache.shape[0]) * layout.block_size
    return size_expr(cache.shape[layout.dim])
