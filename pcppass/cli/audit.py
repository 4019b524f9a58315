"""``pcppass audit MODEL``: list every write into persistent state and what covers it.

Exit code 0 when every write is covered, 1 when anything is uncovered (or, with ``--dynamic``, a
state change no graph write explains, or state the run could not watch), 2 when the model cannot be
loaded or traced.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pcppass.analysis.report import EXIT_COVERED, EXIT_ERROR, EXIT_UNCOVERED, print_writes_table


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "audit",
        help="list every state write of a model's decode graph and the pattern covering it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?",
                   help="built-in model name (llama, deepseek_v2, ...) or module:factory; with --vllm a "
                        "model directory (config.json alone is enough: dummy weights)")
    p.add_argument("--size", choices=("tiny", "full"), default="tiny",
                   help="built-in model widths; 'full' is traced on the meta device (no weights)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--dynamic", action="store_true",
                   help="also run real steps and report state rows changed without a graph write "
                        "(every live tensor is watched, not only the step's arguments)")
    p.add_argument("--steps", type=int, default=2, help="steps to run with --dynamic")
    p.add_argument("--rows", type=int, default=6, help="rows of the traced step (built-in models)")
    p.add_argument("--vllm", action="store_true",
                   help="MODEL is a model directory: audit the graph vLLM itself compiles for it "
                        "(needs vLLM; see docs/INTEGRATION.md)")
    vllm = p.add_argument_group("vLLM (with --vllm)")
    vllm.add_argument("--layers", type=int, default=None,
                      help="keep the first N layers (raised to keep one layer of every kind); dummy weights")
    vllm.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                      help="the model's dtype (Qwen3-Next's CPU kernel takes bfloat16 only)")
    vllm.add_argument("--moe-dispatch", choices=("auto", "op"), default="auto",
                      help="'op': MoE layers through vllm::moe_forward, the dispatch vLLM uses off the CPU")
    vllm.add_argument("--no-prefix-caching", action="store_true",
                      help="run vLLM with enable_prefix_caching=False (its default for hybrids, mamba_cache_mode "
                           "'align', copies state blocks outside the graph: refused)")
    vllm.add_argument("--zoo", action="store_true",
                      help="audit a tiny config of every architecture family in the zoo and print the table")
    vllm.add_argument("--families", default=None,
                      help="with --zoo: comma-separated family names (default: all)")
    vllm.add_argument("--jobs", type=int, default=2, help="with --zoo: families audited at a time")
    vllm.add_argument("--shard", action="store_true",
                      help="with --zoo: run each covered family decode-sharded at P=2 (gloo) and compare its "
                           "tokens with vLLM's LLM.generate")
    p.set_defaults(func=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    if args.vllm or args.zoo:
        # vLLM's log would bury the table; VLLM_LOGGING_LEVEL=INFO shows it (read at vLLM's import)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        try:
            from pcppass.integrations.vllm.audit import run_audit_cli
        except ImportError as exc:
            print(f"pcppass audit --vllm: {exc}", file=sys.stderr)
            return EXIT_ERROR
        return run_audit_cli(args)
    if args.model is None:
        print("pcppass audit: give a model", file=sys.stderr)
        return EXIT_ERROR
    from rich.console import Console

    from pcppass.analysis.report import audit
    from pcppass.analysis.trace import TraceError
    from pcppass.cli.targets import load_target

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
    try:
        report = audit(model, inputs, dynamic_steps=args.steps if args.dynamic else 0, name=args.model)
    except TraceError as exc:
        err.print(f"pcppass audit: {exc}")
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - the model's own failure, reported as usage error
        if not args.dynamic:
            raise
        err.print(f"pcppass audit --dynamic: running the model failed: {type(exc).__name__}: {exc}")
        return EXIT_ERROR
    if report.trace_error is not None:
        # the graph break is part of what --dynamic checks: audit every graph of the real run
        err.print(f"pcppass audit: {report.trace_error}; listing the writes of every graph of the real steps")
    if args.json:
        print(json.dumps({**report.to_dict(), "size": args.size}, indent=2))
    else:
        print_writes_table(args.model, report.writes, console)
        console.print(f"{len(report.covered)} covered, {len(report.uncovered)} uncovered")
        if report.dynamic is not None:
            for line in report.dynamic.summary_lines():
                console.print(line, markup=False)
    return EXIT_COVERED if report.ok else EXIT_UNCOVERED
