"""``pcppass bench``: decode steps, paged attention kernels and serving, replicated vs decode-sharded.

    pcppass bench --model deepseek_v32,llama --world 2 --rows-per-rank 8,32 --context 16384,32768
    pcppass bench kernels [--rows 32,64] [--context 16384,32768]
    pcppass bench serve --model deepseek_v32 --world 2 [--hit-rates 0.8,0.9,0.95,0.99]
    pcppass bench serve --device cpu --world 2          (small CPU workload: tiny model, gloo)

The benches live in :mod:`pcppass.bench` (:mod:`~pcppass.bench.step`, :mod:`~pcppass.bench.kernels`,
:mod:`~pcppass.bench.serve`); results go to ``--out`` as JSON (device, versions, date, configuration,
every number), markdown tables and a plot. See docs/BENCH.md.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple]:
    return lambda text: tuple(kind(x) for x in text.split(",") if x)


def _common(p: argparse.ArgumentParser, timeout: float) -> None:
    p.add_argument("--out", default="bench/results", help="directory for the JSON, markdown and plot")
    p.add_argument("--tag", default="", help="file name tag (default: kind, device, world and date)")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds for the whole multi-process run")


def register(subparsers: argparse._SubParsersAction) -> None:
    from pcppass.bench.step_config import DEFAULT_VARIANTS, VARIANTS

    p = subparsers.add_parser(
        "bench", help="benchmark decode steps, attention kernels or serving, replicated vs decode-sharded",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The step bench's options live on the ``bench`` parser itself (``pcppass bench --model ...``);
    # their defaults are suppressed there and applied in main_step, so the subcommands' own options
    # of the same names (--model, --world, ...) keep their own defaults.
    def opt(flag: str, default: Any, **kw: Any) -> None:
        action = p.add_argument(flag, default=argparse.SUPPRESS, **kw)
        STEP_DEFAULTS[action.dest] = default
        if "help" in kw and default not in (None, False, True):
            action.help = f"{kw['help']} (default {default})"

    opt("--model", ("deepseek_v32",), type=_csv(str),
        help="comma-separated built-in models (llama, deepseek_v2, deepseek_v32, deepseek_v4); "
             "NAME:L runs NAME with L layers only (e.g. llama,deepseek_v32,deepseek_v32:16)")
    opt("--size", "full", choices=("tiny", "full"), help="model widths")
    opt("--layers", (2,), type=_csv(int), help="decoder layers, comma-separated (e.g. 2,16)")
    opt("--world", 2, type=int, help="GPUs / PCP ranks (local processes)")
    opt("--rows-per-rank", (32,), type=_csv(int), help="decode rows per rank, comma-separated")
    opt("--context", (4096,), type=_csv(int), help="cached positions per request, comma-separated")
    opt("--variants", DEFAULT_VARIANTS, type=_csv(str),
        help=f"subset of {','.join(VARIANTS)}; synced variants run with every check on")
    opt("--also-checks-off", False, action="store_true",
        help="also time each checked synced variant with every check off, side by side (VARIANT_nochecks)")
    opt("--symmetric-caches", False, action="store_true",
        help="allocate the caches in symmetric memory, so the backend's automatic transport picks peer stores")
    opt("--warmup", 3, type=int, help="untimed steps first")
    opt("--reps", 20, type=int, help="timed steps")
    opt("--smoke-steps", 3, type=int, help="sharded steps before the replica comparison")
    opt("--sync-kernels", "device", choices=("device", "reference"),
        help="device: the host-sync-free CUDA kernels of pcppass.sync.rows_cuda; reference: plain ops")
    opt("--no-gather-hidden", True, dest="gather_hidden", action="store_false",
        help="do not all-gather the final hidden rows in sharded steps")
    opt("--cuda-graph", False, action="store_true", help="also capture each step in a CUDA graph and replay it")
    opt("--sync-microbench", False, action="store_true",
        help="add the 61-layer sync-cost microbenchmark through the real pcppass::sync_* ops")
    opt("--micro-rows", (8, 32, 128), type=_csv(int), help="rows per rank of the microbenchmark")
    opt("--micro-layers", 61, type=int, help="layers of the microbenchmark")
    opt("--micro-reference", False, action="store_true",
        help="also time the reference (plain-torch, host-reading) sync ops in the microbenchmark")
    opt("--op-value-checks", False, action="store_true",
        help="keep the cache-write ops' value checks on (they read the device on the host)")
    opt("--out", "bench/results", help="directory for the JSON, markdown and plot")
    opt("--tag", "", help="file name tag (default: kind, device, world and date)")
    opt("--timeout", 580.0, type=float, help="seconds for the whole multi-process run")
    p.set_defaults(func=main_step)
    sub = p.add_subparsers(dest="bench_command", required=False)

    k = sub.add_parser("kernels", help="each paged attention kernel's time and bandwidth against its floor (1 GPU)")
    k.add_argument("--rows", default=(32, 64), type=_csv(int), help="decode rows, comma-separated")
    k.add_argument("--context", default=(16384, 32768), type=_csv(int), help="context per row, comma-separated")
    k.add_argument("--reps", type=int, default=20)
    k.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the models' reference (gather-everything) paths")
    _common(k, 580.0)
    k.set_defaults(func=main_kernels)

    s = sub.add_parser("serve", help="the engine end to end: serving workload, replicated vs decode-sharded")
    s.add_argument("--model", default="deepseek_v32", help="built-in model")
    s.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda: full-width model, NCCL; cpu: tiny model, gloo, small workload (CI)")
    s.add_argument("--size", choices=("tiny", "full"), help="default: full on cuda, tiny on cpu")
    s.add_argument("--layers", type=int, default=2)
    s.add_argument("--world", type=int, default=2)
    s.add_argument("--modes", type=_csv(str), help="subset of replicated,pcppass,per_site,nosync (default: all)")
    s.add_argument("--hit-rates", type=_csv(float), help="target prefix-hit rates (default 0.8,0.9,0.95,0.99)")
    s.add_argument("--requests", type=int, help="measured requests per run (cuda 64, cpu 6)")
    s.add_argument("--concurrency", type=int, help="requests in flight (cuda 32, cpu 3)")
    s.add_argument("--prompt-len", type=int, help="prompt tokens (cuda 16384, cpu 40)")
    s.add_argument("--output-len", type=int, help="output tokens per request (cuda 128, cpu 4)")
    s.add_argument("--max-num-batched-tokens", type=int,
                   help="chunked-prefill token budget per step (default: a quarter of the prompt, as the seed's "
                        "32768 for 128k prompts)")
    s.add_argument("--inner", choices=("inductor", "aot_eager", "eager"), help="default: inductor on cuda, eager on cpu")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--repeats", type=int,
                   help="rounds per hit rate, every mode once per round in an order rotated each round "
                        "(cuda 3, cpu 1)")
    s.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="do not capture the engine's decode steps in CUDA graphs (cuda only)")
    s.add_argument("--no-progress", dest="progress", action="store_false")
    _common(s, 580.0)
    s.set_defaults(func=main_serve)


#: the step bench's option defaults (see register)
STEP_DEFAULTS: dict[str, Any] = {}


def main_step(args: argparse.Namespace) -> int:
    from pcppass.bench import step_report
    from pcppass.bench.environment import default_tag, keep_multicast_off
    from pcppass.bench.results import write
    from pcppass.bench.step import bench_rank
    from pcppass.bench.step_config import VARIANTS, StepBenchConfig, with_checks_off
    from pcppass.engine.launch import launch

    args = argparse.Namespace(**{**STEP_DEFAULTS, **vars(args)})
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"pcppass bench: unknown variant(s) {bad}; choose from {VARIANTS}")
    _need_gpus(args.world)
    keep_multicast_off()
    tag = args.tag or default_tag("step", args.world)
    variants = with_checks_off(args.variants) if args.also_checks_off else args.variants
    cfg = StepBenchConfig(
        models=args.model, size=args.size, world=args.world, rows_per_rank=args.rows_per_rank,
        contexts=args.context, layers=args.layers, variants=variants, warmup=args.warmup, reps=args.reps,
        smoke_steps=args.smoke_steps, sync_kernels=args.sync_kernels, gather_hidden=args.gather_hidden,
        cuda_graph=args.cuda_graph, sync_microbench=args.sync_microbench, micro_layers=args.micro_layers,
        micro_rows=args.micro_rows, micro_reference=args.micro_reference, op_value_checks=args.op_value_checks,
        symmetric_caches=args.symmetric_caches, out=args.out, tag=tag, timeout_s=args.timeout,
    )
    try:
        result = launch(bench_rank, cfg.world, cfg, backend="nccl", timeout_s=cfg.timeout_s)[0]
    except (TimeoutError, RuntimeError) as exc:  # what the run finished is kept
        result = partial_result(cfg.out, f"bench_{tag}", exc)
    print(write(cfg.out, f"bench_{tag}", result, step_report.markdown, step_report.plot))
    return 1 if result.get("errors") else 0


def main_kernels(args: argparse.Namespace) -> int:
    from pcppass.bench import kernels
    from pcppass.bench.environment import default_tag
    from pcppass.bench.results import write

    _need_gpus(1)
    tag = args.tag or default_tag("kernels", 1)
    cfg = kernels.KernelBenchConfig(rows=args.rows, contexts=args.context, reps=args.reps, reference=args.reference,
                                    out=args.out, tag=tag)
    result = kernels.bench(cfg)
    print(write(cfg.out, f"kernels_{tag}", result, kernels.markdown))
    return 1 if result.get("errors") else 0


#: (cuda, cpu) defaults of ``pcppass bench serve``
SERVE_DEFAULTS = {"size": ("full", "tiny"), "requests": (64, 6), "concurrency": (32, 3), "prompt_len": (16384, 40),
                  "output_len": (128, 4), "inner": ("inductor", "eager"), "repeats": (3, 1)}


def main_serve(args: argparse.Namespace) -> int:
    from pcppass.bench import serve, serve_report
    from pcppass.bench.environment import default_tag, keep_multicast_off
    from pcppass.bench.results import write
    from pcppass.engine.launch import launch

    on_cpu = args.device == "cpu"
    opts = {k: getattr(args, k) if getattr(args, k) is not None else v[on_cpu] for k, v in SERVE_DEFAULTS.items()}
    modes = args.modes or serve.DEFAULT_MODES
    bad = [m for m in modes if m not in serve.MODES]
    if bad:
        raise SystemExit(f"pcppass bench serve: unknown mode(s) {bad}; choose from {serve.MODES}")
    if opts["repeats"] < 1:
        raise SystemExit(f"pcppass bench serve: --repeats must be at least 1, got {opts['repeats']}")
    if not on_cpu:
        _need_gpus(args.world)
        keep_multicast_off()
    tag = args.tag or default_tag("serve", args.world)
    cfg = serve.ServeBenchConfig(
        model=args.model, size=opts["size"], layers=args.layers, world=args.world, device=args.device, modes=modes,
        hit_rates=args.hit_rates or (0.8, 0.9, 0.95, 0.99), num_requests=opts["requests"],
        concurrency=opts["concurrency"], prompt_len=opts["prompt_len"], output_len=opts["output_len"],
        max_num_batched_tokens=args.max_num_batched_tokens or max(16, opts["prompt_len"] // 4), inner=opts["inner"],
        seed=args.seed, progress=args.progress, out=args.out, tag=tag, timeout_s=args.timeout,
        repeats=opts["repeats"], cuda_graphs=args.cuda_graphs,
    )
    results = launch(serve.serve_rank, cfg.world, cfg, backend="gloo" if on_cpu else "nccl", timeout_s=cfg.timeout_s)
    result = serve_report.summarise(results)
    print(write(cfg.out, f"serve_{tag}", result, serve_report.markdown, serve_report.plot))
    return 0 if serve_report.passed_checks(result) else 1


def partial_result(out: str, name: str, exc: Exception) -> dict:
    """The results a run saved before ``exc`` ended it (raises ``exc`` when it saved none)."""
    import json
    from pathlib import Path

    path = Path(out) / f"{name}.partial.json"
    if not path.exists():
        raise exc
    result = json.loads(path.read_text())
    result.setdefault("errors", []).append({"stage": "run", "traceback": f"{type(exc).__name__}: {exc}"})
    return result


def _need_gpus(world: int) -> None:
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < world:
        raise SystemExit(f"pcppass bench: needs {world} CUDA GPUs, found {found}")
