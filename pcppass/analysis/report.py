"""The audit as a library call: a model (or a traced graph) in, an :class:`AuditReport` out.

::

    report = pcppass.audit(model, StepInputs((input_ids, positions, meta, caches)))
    report.ok              # every write covered (and, with dynamic_steps, every change explained)
    report.uncovered       # the StateWrite records nothing covers, each with reason and source line
    print(report.describe())

``pcppass audit MODEL`` is this call plus a table, JSON and an exit code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

from pcppass.analysis.records import StateWrite
from pcppass.analysis.state_writes import find_state_writes
from pcppass.analysis.trace import StepInputs, TraceError, capture_graph, contract_step_inputs

#: exit codes of ``pcppass audit`` (built-in models and ``--vllm`` alike): every write covered,
#: something uncovered (or unexplained), the model could not be loaded or traced
EXIT_COVERED, EXIT_UNCOVERED, EXIT_ERROR = 0, 1, 2


@dataclass
class AuditReport:
    """Every write into persistent state of one decode step, classified.

    ``writes`` in graph order; ``graph`` the traced Dynamo graph (None when tracing failed and the
    writes come from the graphs of a dynamic run); ``dynamic`` the run-time check's report when
    ``dynamic_steps`` was asked for; ``trace_error`` why the single-graph trace failed, if it did.
    """

    target: str
    writes: list[StateWrite] = field(default_factory=list)
    graph: torch.fx.GraphModule | None = None
    dynamic: Any = None  # pcppass.analysis.dynamic.DynamicReport
    trace_error: str | None = None

    @property
    def covered(self) -> list[StateWrite]:
        return [w for w in self.writes if w.covered]

    @property
    def uncovered(self) -> list[StateWrite]:
        return [w for w in self.writes if not w.covered]

    @property
    def ok(self) -> bool:
        """Nothing uncovered, one graph, and (if run) every state change explained and verified."""
        if self.uncovered or self.trace_error is not None:
            return False
        return self.dynamic is None or self.dynamic.ok

    def describe(self) -> str:
        lines = [w.describe() for w in self.writes]
        lines.append(f"{len(self.covered)} covered, {len(self.uncovered)} uncovered")
        if self.trace_error is not None:
            lines.append(f"no single graph: {self.trace_error}")
        if self.dynamic is not None:
            lines += self.dynamic.summary_lines()
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the audit CLI's ``--json`` payload."""
        payload: dict[str, Any] = {
            "model": self.target,
            "ok": self.ok,
            "writes": [write_row(w) for w in self.writes],
            "covered": len(self.covered),
            "uncovered": len(self.uncovered),
        }
        if self.trace_error is not None:
            payload["trace_error"] = self.trace_error
        if self.dynamic is not None:
            payload.update(self.dynamic.to_dict())
        return payload


def write_row(w: StateWrite) -> dict[str, Any]:
    """One record as JSON (symbolic sizes as their expression)."""
    written = w.written_bytes_per_row
    return {
        "state": w.state,
        "state_kind": w.state_kind.value,
        "op": w.op,
        "arg": w.arg,
        "node": w.node.name,
        "source": w.source,
        "covered": w.covered,
        "pattern": w.pattern.name if w.covered else None,
        "recipe": w.recipe.value if w.covered else None,
        "layout": w.layout.kind if w.layout is not None and w.covered else None,
        "bytes_per_row": w.bytes_per_row if w.covered else None,
        "recipe_bytes": dict(w.recipe_bytes) if w.covered else {},
        "written_bytes_per_row": written if written is None or isinstance(written, int) else str(written),
        "reason": w.reason.value if w.reason is not None else None,
        "detail": w.detail,
    }


def _unique(writes: list[StateWrite]) -> list[StateWrite]:
    """One record per (state, op, argument, source line): a graph recompiled per step once."""
    seen: set[tuple[str, str, str | None, str]] = set()
    out = []
    for w in writes:
        key = (w.state, w.op, w.arg, w.source)
        if key not in seen:
            seen.add(key)
            out.append(w)
    return out


def _step_inputs(model: Callable[..., Any], inputs: StepInputs | tuple | None,
                 kwargs: dict | None) -> StepInputs:
    if isinstance(inputs, StepInputs):
        return inputs
    if inputs is None:
        if kwargs is None and all(hasattr(model, a) for a in ("cache_groups", "cache_specs")):
            return contract_step_inputs(model)
        inputs = ()
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    return StepInputs(args, dict(kwargs or {}))


def audit(
    target: Callable[..., Any] | torch.fx.GraphModule,
    inputs: StepInputs | tuple | None = None,
    kwargs: dict | None = None,
    *,
    dynamic_steps: int = 0,
    name: str | None = None,
) -> AuditReport:
    """Audit one decode step of ``target``: every write into persistent state, classified.

    ``target`` is a model (any callable ``torch.compile`` accepts) called as
    ``target(*inputs.args, **inputs.kwargs)``; ``inputs`` a :class:`StepInputs` (whose ``dynamic``
    pairs mark the row-count dims symbolic), a tuple of positional arguments (plus ``kwargs``), or
    None for a model that follows the model contract (a step is built from ``cache_specs()``).
    ``target`` may also be a Dynamo graph (what a ``torch.compile`` backend receives): it is
    analysed as is.

    ``dynamic_steps > 0`` also runs that many real steps (:mod:`pcppass.analysis.dynamic`) and
    reports state changes that no graph write explains; a model with a graph break is then audited
    over the graphs of the real run. Raises :class:`~pcppass.analysis.trace.TraceError` when the step
    cannot be traced as one graph and no dynamic run was asked for.
    """
    label = name or getattr(target, "__qualname__", None) or type(target).__name__
    if isinstance(target, torch.fx.GraphModule) and inputs is None:
        if dynamic_steps:
            raise ValueError("a dynamic audit runs the model: pass the model and its inputs, not a graph")
        return AuditReport(label, find_state_writes(target), graph=target)
    step = _step_inputs(target, inputs, kwargs)
    report = AuditReport(label)
    try:
        report.graph = capture_graph(target, step)
        report.writes = find_state_writes(report.graph)
    except TraceError as exc:
        if not dynamic_steps:
            raise
        report.trace_error = str(exc)
    if dynamic_steps:
        from pcppass.analysis.dynamic import dynamic_audit

        report.dynamic = dynamic_audit(target, step, steps=dynamic_steps)
        if report.graph is None:
            report.writes = _unique(report.dynamic.writes)
    return report


def print_writes_table(model: str, writes: list[StateWrite], console: Any) -> None:
    """The audit's table of ``writes`` (one row per write: state, op, source, pattern, recipe, and
    its bytes per row or why nothing covers it), printed on a rich ``console``."""
    from rich.table import Table

    table = Table(title=f"state writes of {model}", show_lines=False)
    for col in ("state", "op", "source", "pattern", "recipe", "bytes/row or reason"):
        table.add_column(col, overflow="fold")
    for w in writes:
        if w.covered:
            # a read-only record says why the op only reads (e.g. the layer's attention backend);
            # one with alternative recipes, the bytes per row of each
            last = str(w.bytes_per_row) if w.bytes_per_row is not None else w.detail
            if w.recipe_bytes:
                last = ", ".join(f"{name} {n}" for name, n in w.recipe_bytes.items())
            table.add_row(w.state, f"{w.op} ({w.arg})", w.source, w.pattern.name, w.recipe.value, last)
        else:
            table.add_row(w.state, f"{w.op} ({w.arg})", w.source, "-", "-",
                          f"[red]{w.reason.value}[/red]: {w.detail}")
    console.print(table)
