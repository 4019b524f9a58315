"""What the sync of a compiled step consisted of: checks in force and the transport that moved the rows.

The transport is read off the graph the rewrite emitted (its nodes' operators), so a bench reports
what actually ran, whichever transport the rewrite chose.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any


def _op_name(target: Any) -> str:
    name = getattr(target, "_name", None) or getattr(target, "__name__", None) or str(target)
    return name.replace("::", ".")


def transport(backend: Any) -> dict[str, Any]:
    """``{"transport": label, "ops": [...], "collectives": n}`` of the backend's last compiled graph.

    ``label`` is ``all_gather`` when the sync's rows travel through an all-gather, else the names
    of the emitted operators that are not the pack, header read or scatter steps.
    """
    reports = [r for r in getattr(backend, "reports", []) if getattr(r, "rewrite", None) is not None]
    if not reports:
        return {"transport": "none", "ops": [], "collectives": 0}
    rewrite = reports[-1].rewrite
    ops = sorted({_op_name(n.target) for n in getattr(rewrite, "nodes", []) if n.op == "call_function"})
    moving = [op for op in ops if not any(step in op for step in ("pack", "header", "scatter", "wait_tensor"))]
    label = "all_gather" if any("all_gather" in op for op in ops) else "+".join(moving) or "unknown"
    return {"transport": label, "ops": ops, "collectives": getattr(rewrite, "collectives", None)}


def checks(backend: Any) -> dict[str, Any]:
    """The backend's run-time and compile-time check switches."""
    value = getattr(backend, "checks", None)
    try:
        return asdict(value)
    except TypeError:
        return {"checks": repr(value)}


def capturable(backend: Any) -> tuple[bool, str]:
    """Whether a step compiled by ``backend`` can be captured in a CUDA graph, and why not.

    A backend may say so itself (a ``capturable`` attribute); otherwise a step is capturable when
    none of the checks that read the device on the host is on. Trying anyway is not harmless: the
    failing sync op fails the step, and a failed sharded step aborts the process group (fail-stop).
    """
    if backend is None:
        return True, ""
    explicit = getattr(backend, "capturable", None)
    if explicit is not None:
        return bool(explicit), "" if explicit else "the backend says its steps cannot be captured"
    checks = getattr(backend, "checks", None)
    host = [name for name in ("inputs", "header", "slot_conflicts") if getattr(checks, name, False)]
    return not host, f"checks that read the device on the host are on: {', '.join(host)}" if host else ""
