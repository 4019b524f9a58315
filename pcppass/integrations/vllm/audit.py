"""``pcppass audit --vllm DIR``: the writes in the graph vLLM itself compiles for a model directory.

vLLM is started in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, compile caches off, so its
compile reaches the backend) with ``compilation_config={"mode": 2, "backend":
"pcppass.integrations.vllm.audit_backend"}``: the engine compiles while it warms up, the backend
records the classified writes of Dynamo's whole graph and runs it unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from pcppass.analysis.report import AuditReport
from pcppass.integrations.vllm.engine_args import cpu_engine_args

#: what an in-process audit needs from vLLM's environment (set unless already set)
AUDIT_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: its compile reaches us
    "VLLM_DISABLE_COMPILE_CACHE": "1",  # a compile-cache hit would skip the backend
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: a small KV cache for an audit run
}


class VllmAuditError(RuntimeError):
    """vLLM did not hand pcppass a graph (it compiled in another process, or not at all)."""


def audit_model_dir(model_dir: str, **llm_args: Any) -> AuditReport:
    """Every write into persistent state (and every handle) in vLLM's graph of ``model_dir``.

    ``llm_args`` go to ``vllm.LLM`` (defaults: :mod:`.engine_args`, ``max_model_len=256``).
    """
    for key, value in AUDIT_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    from pcppass.integrations.vllm.compile import audit_backend

    args = cpu_engine_args(model_dir, max_model_len=256,
                           compilation_config={"mode": 2, "backend": "pcppass.integrations.vllm.audit_backend"})
    args.update(llm_args)
    first = len(audit_backend.reports)
    LLM(**args)
    reports = audit_backend.reports[first:]
    if not reports:
        raise VllmAuditError(
            f"vLLM compiled no graph of {model_dir} in this process (VLLM_ENABLE_V1_MULTIPROCESSING="
            f"{os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING')!r}, compilation mode off, or a "
            "compile-cache hit)")
    return AuditReport(target=model_dir, writes=[w for report in reports for w in report.writes],
                       graph=reports[0].graph)


def run_audit_cli(args: argparse.Namespace) -> int:
    """``pcppass audit --vllm DIR``: the table (or ``--json``) and exit codes of ``pcppass audit``."""
    from rich.console import Console

    from pcppass.cli.audit import EXIT_COVERED, EXIT_ERROR, EXIT_UNCOVERED, _print_table

    err = Console(file=sys.stderr)
    if args.dynamic:
        err.print("pcppass audit --vllm: --dynamic is not supported (vLLM runs its own steps)")
        return EXIT_ERROR
    try:
        # stdout is for the table or the JSON: vLLM's own log (on stdout by default) goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            report = audit_model_dir(args.model)
    except Exception as exc:  # noqa: BLE001 - vLLM could not load or compile the model
        err.print(f"pcppass audit --vllm: vLLM failed on {args.model}: {type(exc).__name__}: {exc}")
        return EXIT_ERROR
    if args.json:
        print(json.dumps({**report.to_dict(), "engine": "vllm"}, indent=2))
    else:
        console = Console(file=sys.stdout, width=200)
        _print_table(args.model, report.writes, console)
        console.print(f"{len(report.covered)} covered, {len(report.uncovered)} uncovered")
    return EXIT_COVERED if report.ok else EXIT_UNCOVERED
