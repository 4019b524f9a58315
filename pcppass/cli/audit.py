"""``pcppass audit MODEL``: list every write into persistent state and what covers it.

Exit code 0 when every write is covered, 1 when anything is uncovered (or, with ``--dynamic``, a
state change no graph write explains), 2 when the model cannot be loaded or traced.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pcppass.analysis.records import StateWrite

EXIT_COVERED, EXIT_UNCOVERED, EXIT_ERROR = 0, 1, 2


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "audit",
        help="list every state write of a model's decode graph and the pattern covering it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="built-in model name (llama, deepseek_v2, ...) or module:factory")
    p.add_argument("--size", choices=("tiny", "full"), default="tiny",
                   help="built-in model widths; 'full' is traced on the meta device (no weights)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--dynamic", action="store_true",
                   help="also run real steps and report state rows changed without a graph write")
    p.add_argument("--steps", type=int, default=2, help="steps to run with --dynamic")
    p.add_argument("--rows", type=int, default=6, help="rows of the traced step (built-in models)")
    p.set_defaults(func=run_audit)


def _write_row(w: StateWrite) -> dict[str, Any]:
    return {
        "state": w.state,
        "state_kind": w.state_kind.value,
        "op": w.op,
        "arg": w.arg,
        "node": w.node.name,
        "source": w.source,
        "covered": w.covered,
        "pattern": w.pattern.name if w.covered else None,
        "recipe": w.pattern.recipe.value if w.covered else None,
        "layout": w.layout.kind if w.layout is not None and w.covered else None,
        "bytes_per_row": w.bytes_per_row if w.covered else None,
        "written_bytes_per_row": (w.written_bytes_per_row if isinstance(w.written_bytes_per_row, int)
                                  or w.written_bytes_per_row is None else str(w.written_bytes_per_row)),
        "reason": w.reason.value if w.reason is not None else None,
        "detail": w.detail,
    }


def _print_table(model: str, writes: list[StateWrite], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"state writes of {model}", show_lines=False)
    for col in ("state", "op", "source", "pattern", "recipe", "bytes/row or reason"):
        table.add_column(col, overflow="fold")
    for w in writes:
        if w.covered:
            table.add_row(w.state, f"{w.op} ({w.arg})", w.source, w.pattern.name,
                          w.pattern.recipe.value, str(w.bytes_per_row))
        else:
            table.add_row(w.state, f"{w.op} ({w.arg})", w.source, "-", "-",
                          f"[red]{w.reason.value}[/red]: {w.detail}")
    console.print(table)


def _unique(writes: list[StateWrite]) -> list[StateWrite]:
    """One record per (graph node, argument): a graph recompiled per step is listed once."""
    seen: set[tuple[str, str, str | None, str]] = set()
    out = []
    for w in writes:
        key = (w.state, w.op, w.arg, w.source)
        if key not in seen:
            seen.add(key)
            out.append(w)
    return out


def run_audit(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pcppass.analysis import find_state_writes
    from pcppass.analysis.trace import TraceError, capture_graph, load_target

    console = Console(file=sys.stdout, width=200)
    err = Console(file=sys.stderr)
    device = "meta" if args.size == "full" and ":" not in args.model else "cpu"
    if args.dynamic and device == "meta":
        err.print("pcppass audit: --dynamic runs real steps; use --size tiny")
        return EXIT_ERROR
    try:
        model, inputs = load_target(args.model, args.size, device=device, num_rows=args.rows)
    except TraceError as exc:
        err.print(f"pcppass audit: {exc}")
        return EXIT_ERROR
    writes: list[StateWrite] | None = None
    try:
        writes = find_state_writes(capture_graph(model, inputs))
    except TraceError as exc:
        if not args.dynamic:
            err.print(f"pcppass audit: {exc}")
            return EXIT_ERROR
        # the graph break is part of what --dynamic checks: audit every graph of the real run
        err.print(f"pcppass audit: {exc}; listing the writes of every graph of the real steps")
    changes = []
    if args.dynamic:
        from pcppass.analysis.dynamic import dynamic_audit

        try:
            report = dynamic_audit(model, inputs, steps=args.steps)
        except Exception as exc:  # noqa: BLE001 - the model's own failure, reported as usage error
            err.print(f"pcppass audit --dynamic: running the model failed: {type(exc).__name__}: {exc}")
            return EXIT_ERROR
        changes = report.changes
        if writes is None:
            writes = _unique(report.writes)
    uncovered = [w for w in writes if not w.covered]
    if args.json:
        payload = {
            "model": args.model,
            "size": args.size,
            "writes": [_write_row(w) for w in writes],
            "covered": len(writes) - len(uncovered),
            "uncovered": len(uncovered),
        }
        if args.dynamic:
            payload["unexplained_changes"] = [
                {"state": c.state, "step": c.step, "unit": c.unit, "rows": c.rows} for c in changes
            ]
        print(json.dumps(payload, indent=2))
    else:
        _print_table(args.model, writes, console)
        console.print(f"{len(writes) - len(uncovered)} covered, {len(uncovered)} uncovered")
        for c in changes:
            console.print(f"[red]unexplained[/red] {c.describe()}")
        if args.dynamic and not changes:
            console.print(f"dynamic audit: every state change in {args.steps} step(s) is explained")
    return EXIT_UNCOVERED if uncovered or changes else EXIT_COVERED
