"""What the sync of a compiled step consisted of (whether it can be captured in a CUDA graph:
:mod:`pcppass.runtime.capturable`).

Everything here is read off what the backend compiled (``backend.reports``): the graphs it handed
to the inner compiler, the transport the rewrite chose for them, the check flags on their sync
nodes, and the implementation each ``pcppass`` operator in them dispatches to on CUDA. A bench
reports what ran, whichever transport and checks the rewrite chose.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.fx


def _op_name(target: Any) -> str:
    name = getattr(target, "_name", None) or getattr(target, "__name__", None) or str(target)
    return name.replace("::", ".")


def _rewritten(backend: Any) -> list[Any]:
    return [r for r in getattr(backend, "reports", []) if getattr(r, "rewrite", None) is not None]


def transport(backend: Any) -> dict[str, Any]:
    """``{"transport": label, "per_graph": [...], "ops": [...], "collectives": n}`` of the backend's
    rewritten graphs: ``label`` is what the rewrite recorded for the last one
    (``CompileReport.transport``: ``"peer stores"``, or ``"all-gather (why not peer stores)"``)."""
    reports = _rewritten(backend)
    if not reports:
        return {"transport": "none", "per_graph": [], "ops": [], "collectives": 0}
    rewrite = reports[-1].rewrite
    ops = sorted({_op_name(n.target) for n in getattr(rewrite, "nodes", []) if n.op == "call_function"})
    per_graph = [getattr(r, "transport", "") or "unknown" for r in reports]
    return {"transport": per_graph[-1], "per_graph": per_graph, "ops": ops,
            "collectives": getattr(rewrite, "collectives", None)}


def checks(backend: Any) -> dict[str, Any]:
    """The backend's check switches (``SyncChecks``), and under ``"in_graph"`` the checks its last
    rewritten graph's sync nodes actually carry (:func:`graph_checks`)."""
    value = getattr(backend, "checks", None)
    try:
        out = asdict(value)
    except TypeError:
        out = {"checks": repr(value)}
    reports = _rewritten(backend)
    graph = getattr(reports[-1], "graph", None) if reports else None
    out["in_graph"] = graph_checks(graph) if graph is not None else {}
    return out


def _sync_nodes(graph: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in graph.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "pcppass" and n.target.__name__.startswith("sync_")]


def _named_args(node: torch.fx.Node) -> dict[str, Any]:
    names = [a.name for a in node.target._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def graph_checks(graph: torch.fx.GraphModule) -> dict[str, bool]:
    """The run-time checks the sync nodes of ``graph`` carry: ``header`` (every rank's sync header
    compared: ``sync_read_header``'s ``verify``, or ``sync_verdict``'s ``verify_header`` where the
    verdict checks it before anything is written) and ``slot_conflicts`` (two owners of one slot
    refused: the ``check_conflicts`` argument); empty when the graph has no sync node."""
    found: dict[str, bool] = {}
    for node in _sync_nodes(graph):
        args = _named_args(node)
        for arg, check in (("verify", "header"), ("verify_header", "header"), ("check_conflicts", "slot_conflicts")):
            if arg in args:
                found[check] = found.get(check, False) or bool(args[arg])
    return found


