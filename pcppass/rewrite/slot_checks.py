"""Checks of the slot mappings a graph computes, inserted before the step's first write.

Slot mappings that are graph inputs are checked before the graph runs
(:class:`pcppass.runtime.validate.InputValidator`). One the graph computes exists only inside the
step, on its own rank; a rank that refused it alone would leave the other ranks' writes in their
replicas. So every computed mapping is checked before ANY write of the step, and the ranks agree
(one small all-gather of each rank's findings) before anyone writes::

    ... slot computations (hoisted here if the graph computes them later) ...
    record   = pcppass.slot_check_record([slots, ...], limits, rows, aten)
    gathered = wait_tensor(all_gather_into_tensor(record, world, group))
    checked  = pcppass.slot_check_verdict(gathered, [slots, ...], labels, aten)   # every rank raises
    first_write(..., checked[0], ...)                                               # alike, or none
    later_write(..., checked[1], ...)

The writes take the verdict's copies (same values), so nothing reorders them before it. A graph
whose slot mappings are all inputs gets none of this (no extra collective), except under the
immediate schedule: there each site is synchronised right after it, so a row two ranks write at
a later site would show only after earlier sites' rows were applied on every replica. So every
slot mapping, inputs included, is gathered here (``send``) and the verdict refuses, before any
write, a step in which two ranks would write one row or overlapping bytes of one buffer
(:mod:`pcppass.sync.owners`): one extra collective per immediate step.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx

import pcppass.sync.slot_check_ops  # noqa: F401  (registers the pcppass::slot_check_* ops)
from pcppass.analysis.schema import resolve_overload, written_args
from pcppass.analysis.views import node_value
from pcppass.errors import PcpSyncError
from pcppass.sync.rows import encode_layout
from pcppass.rewrite.plan import CacheSync, SyncPlan, SyncSite, storages_of, written_storages, num_slots_expr

_c10d = torch.ops._c10d_functional


def _mutates(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return str(node.target).endswith("_")
    if node.op != "call_function":
        return False
    if node.target is operator.setitem:
        return True
    overload = resolve_overload(node.target, node.args, dict(node.kwargs))
    return overload is not None and bool(written_args(overload._schema))


def _hoist(node: torch.fx.Node, before: torch.fx.Node, written: set, order: dict,
           reads_state: bool = False) -> str | None:
    """Move ``node`` and what it depends on after ``before`` ahead of it; None, or why not.
    ``reads_state``: ``node`` is a view of a cache (it reads no values, so it may depend on state
    the step writes)."""
    chain, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in chain or order[n] < order[before]:
            continue
        if n.op not in ("call_function", "call_method") or _mutates(n):
            return f"it depends on {n.name}, which writes or is not a plain computation"
        if not reads_state and storages_of(n.all_input_nodes) & written:
            return f"{n.name} reads state the step writes"
        chain.add(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(chain, key=order.__getitem__):
        before.prepend(n)
    return None


def _static_int(expr: Any) -> int | None:
    if isinstance(expr, int):
        return expr
    if isinstance(expr, sympy.Integer):
        return int(expr)
    return None


def _row_count(site: SyncSite, cache: CacheSync, placeholders: list[torch.fx.Node]) -> Any:
    """The op's row count as an int or a SymInt-valued node (-1 when it cannot be named)."""
    slot_names = {role.slots for role in site.pattern.caches}
    for name, dim in site.pattern.row_args.items():
        value = site.arguments.get(name)
        fake = node_value(value) if isinstance(value, torch.fx.Node) else None
        if name in slot_names or not isinstance(fake, torch.Tensor) or fake.dim() <= dim:
            continue
        size = fake.shape[dim]
        if not isinstance(size, torch.SymInt):
            return int(size)
        for p in placeholders:  # a SymInt input carrying exactly this size
            if isinstance(node_value(p), torch.SymInt) and node_value(p).node.expr == size.node.expr:
                return p
        return -1
    return -1


def insert_slot_checks(gm: torch.fx.GraphModule, plan: SyncPlan, *, group_name: str,
                       world_size: int, ranges: bool = True, owners: bool = False) -> int:
    """Check the slot mappings of ``plan`` before the first write (see the module docstring);
    returns how many mappings are checked (0: the graph is left as it is). ``ranges``: computed
    mappings' lengths and ranges. ``owners``: every mapping, inputs included, is gathered and a
    row (or bytes of one buffer) two ranks would write refuses the step on every rank before any
    write (the immediate schedule, whose per-site syncs would otherwise have applied earlier
    sites' rows when a later site's conflict shows)."""
    entries = [(site, c) for site in plan.sites for c in site.caches
               if isinstance(c.cache, torch.fx.Node) and (owners or (ranges and c.slots.op != "placeholder"))]
    if not entries:
        return 0
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((site.node for site in plan.sites), key=order.__getitem__)
    written = set().union(*(written_storages(site) for site in plan.sites))
    for site, c in entries:
        for needed in (c.slots, c.cache) if owners else (c.slots,):
            if order[needed] > order[first]:
                why = _hoist(needed, first, written, order, reads_state=needed is c.cache)
                if why is not None:
                    raise PcpSyncError(
                        f"pcppass: {site.label}: its {'slot mapping' if needed is c.slots else 'cache view'} "
                        f"{needed.name} is computed after the step's first write and cannot be computed "
                        f"before it ({why}), so the ranks cannot check it together before anything is "
                        "written. Compute it from the step's inputs (or pass it as an input)."
                    )
                order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = list(graph.find_nodes(op="placeholder"))
    limits, rows = [], []
    for site, c in entries:
        checked = ranges and c.slots.op != "placeholder"  # inputs: checked before the graph runs
        limit = _static_int(num_slots_expr(node_value(c.cache), c.layout)) if checked else -1
        if limit is None:
            raise PcpSyncError(f"pcppass: {site.label}: the cache's slot count is symbolic; computed "
                               "slot mappings are checked against a static cache size")
        limits.append(limit)
        rows.append(_row_count(site, c, placeholders) if checked else -1)
    slots = [c.slots for _, c in entries]
    aten = [site.pattern.aten_family is not None for site, _ in entries]
    labels = "\n".join(f"{site.op} writing {c.state} ({site.source}): slot mapping {c.slots.name}"
                       for site, c in entries)
    caches = [c.cache for _, c in entries] if owners else []
    layouts = [x for _, c in entries for x in encode_layout(c.layout)] if owners else []
    sites = "\n".join(f"{site.op} at {site.source} writing {c.state}" for site, c in entries) if owners else ""
    with graph.inserting_before(first):
        record = graph.call_function(torch.ops.pcppass.slot_check_record.default,
                                     (slots, limits, rows, aten, owners))
        gathered = graph.call_function(_c10d.all_gather_into_tensor.default, (record, world_size, group_name))
        gathered = graph.call_function(_c10d.wait_tensor.default, (gathered,))
        verdict = graph.call_function(torch.ops.pcppass.slot_check_verdict.default,
                                      (gathered, slots, labels, aten, caches, layouts, sites))
        checked_slots = {}
        for i, node in enumerate(slots):
            if node not in checked_slots:
                checked_slots[node] = graph.call_function(operator.getitem, (verdict, i))
    for site in plan.sites:
        for node, copy in checked_slots.items():
            site.node.replace_input_with(node, copy)
    return len(entries)
