"""``pcppass run``: a workload single-rank and decode-sharded over P ranks, verified step by step.

    pcppass run --model deepseek_v32 --world 2 --steps 40

Runs the reference (one rank, eager), then the sharded run (P local processes, gloo on CPU, NCCL on
CUDA) through the pcppass backend, and prints per step the rows each rank ran and the collectives
and bytes the graph used to synchronise the replicas, then whether the greedy tokens equal the
reference and every state tensor is identical on all ranks after every step. Exit code 1 on any
divergence (naming the first state that diverged), 2 when the backend refused the model.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from pcppass.cli.run_driver import RunConfig, Verification, compare, rank_main, reference_run


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run", help="run a workload single-rank and decode-sharded; verify tokens and replicas",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="llama",
                   help="built-in model (llama, deepseek_v2, deepseek_v32, deepseek_v4) or module:factory")
    p.add_argument("--size", default="tiny", choices=("tiny", "full"))
    p.add_argument("--world", type=int, default=2, help="PCP ranks (local processes)")
    p.add_argument("--steps", type=int, default=40, help="most engine steps to run")
    p.add_argument("--policy", default="round_robin", choices=("round_robin", "sticky"))
    p.add_argument("--schedule", default="deferred", choices=("deferred", "immediate"),
                   help="sync schedule of decode steps (mixed steps always sync immediately)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--inner", default="eager", choices=("inductor", "aot_eager", "eager"),
                   help="compiler the rewritten graph is handed to")
    p.add_argument("--requests", type=int, default=14)
    p.add_argument("--spec-width", type=int, default=2, help="tokens per decode row (speculative verify)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--on-uncovered", default="raise", choices=("raise", "replicate", "unsafe_ignore"),
                   help="uncovered writes: refuse, keep decode replicated, or (negative controls "
                        "only) leave them unsynchronised")
    p.add_argument("--unregister", action="append", default=[], metavar="PATTERN",
                   help="remove a pattern before compiling (negative control); repeatable")
    p.add_argument("--symmetric-caches", action="store_true",
                   help="allocate the caches in symmetric memory (CUDA): rows then move by direct peer stores")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the sharded run")
    p.set_defaults(func=main)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        model=args.model, size=args.size, world=args.world, steps=args.steps, policy=args.policy,
        schedule=args.schedule, inner=args.inner, device=args.device, on_uncovered=args.on_uncovered,
        unregister=tuple(args.unregister), num_requests=args.requests, spec_width=args.spec_width,
        seed=args.seed, symmetric_caches=args.symmetric_caches,
    )


def render(cfg: RunConfig, v: Verification, console: Console) -> None:
    steps = Table(title=f"pcppass run: {cfg.model} ({cfg.size}), P={cfg.world}, {cfg.policy}, "
                        f"decode schedule {cfg.schedule}, inner {cfg.inner}")
    steps.add_column("step", justify="right")
    steps.add_column("kind")
    steps.add_column("rows per rank")
    steps.add_column("sync collectives", justify="right")
    steps.add_column("sync bytes (all ranks)", justify="right")
    steps.add_column("replicas")
    bad_steps = {s for s, _, _ in v.divergent}
    for index, kind, rows, collectives, nbytes in v.per_step:
        steps.add_row(str(index), kind, " ".join(map(str, rows)), str(collectives), f"{nbytes:,}",
                      "[red]DIFFER[/red]" if index in bad_steps else "equal")
    console.print(steps)
    summary = Table(show_header=False, title="verification")
    summary.add_row("decode", v.mode)
    summary.add_row("steps", str(v.steps))
    summary.add_row("greedy tokens equal to single rank",
                    "yes" if v.tokens_equal else f"[red]NO[/red] (requests {v.token_mismatches})")
    summary.add_row("state digests equal on all ranks after every step",
                    "yes" if not v.divergent else f"[red]NO[/red]: {v.first_divergence()}")
    decode = [p for p in v.per_step if p[1] == "decode"]
    if decode:
        summary.add_row("collectives per decode step", ", ".join(sorted({str(p[3]) for p in decode})))
    for kind, transports in v.transports.items():
        summary.add_row(f"sync transport ({kind} graphs)", "; ".join(dict.fromkeys(transports)) or "none")
    console.print(summary)


def main(args: argparse.Namespace) -> int:
    from pcppass.engine.launch import default_backend, launch

    cfg = config_from_args(args)
    console = Console()
    reference = reference_run(cfg)
    try:
        ranks = launch(rank_main, cfg.world, cfg, backend=default_backend(args.device), timeout_s=args.timeout)
    except RuntimeError as exc:
        if "PcpCoverageError" in str(exc):
            console.print(f"[red]pcppass refused to shard {cfg.model}[/red]:\n{exc}")
            return 2
        raise
    verification = compare(reference, ranks)
    render(cfg, verification, console)
    return 0 if verification.ok else 1
