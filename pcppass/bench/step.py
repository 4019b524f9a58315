"""The decode-step bench: one decode step replicated and decode-sharded on P GPUs, side by side.

Per model, in the same processes and on the same caches, every variant of one decode step of
``N * P`` requests at context ``C``:

* ``replicated``: every rank runs all ``N * P`` rows; no sync (decode as vLLM runs it with PCP);
* ``immediate``: ``N`` rows per rank through :class:`pcppass.compiler.PcpBackend`, one sync right
  after every write site (per-site sync, the method decode sharding started with);
* ``deferred``: the same with pcppass's single sync at the end of the step;
* ``deferred_nochecks``: ``deferred`` with every run-time check off (what the checks cost);
* ``nosync``: ``N`` rows per rank, no sync at all: the lower bound (replicas diverge; timing only).

``immediate`` and ``deferred`` run with the backend's checks on (:class:`~pcppass.checks.SyncChecks`
defaults); each records the transport its graph used (:mod:`pcppass.bench.sync_info`). Sharded
variants also all-gather the final hidden rows, as an engine must. Before timing, a smoke runs a
few sharded steps with moving ownership and compares every cache bitwise across ranks (and checks
that ``nosync`` does make them differ). See docs/BENCH.md.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from pcppass.bench import sync_info
from pcppass.bench.environment import environment
from pcppass.bench.inputs import DecodeSetup, caches_equal_across_ranks, owned
from pcppass.bench.results import save_partial
from pcppass.bench.timing import bare_all_gather_us, time_graph, time_steps, timed

VARIANTS = ("replicated", "immediate", "deferred", "deferred_nochecks", "nosync")
DEFAULT_VARIANTS = ("replicated", "immediate", "deferred", "nosync")
SHARDED = ("immediate", "deferred", "deferred_nochecks", "nosync")
SYNCED = ("deferred", "immediate", "deferred_nochecks")


@dataclass(frozen=True)
class StepBenchConfig:
    models: tuple[str, ...] = ("deepseek_v32",)
    size: str = "full"
    world: int = 2
    rows_per_rank: tuple[int, ...] = (32,)
    contexts: tuple[int, ...] = (4096,)
    layers: tuple[int, ...] = (2,)
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    warmup: int = 3
    reps: int = 20
    smoke_steps: int = 3
    #: "device": pcppass.kernels.rows_cuda (no host reads); "reference": the plain-torch ops
    sync_kernels: str = "device"
    gather_hidden: bool = True
    cuda_graph: bool = False
    sync_microbench: bool = False
    micro_layers: int = 61
    micro_rows: tuple[int, ...] = (8, 32, 128)
    micro_reference: bool = False
    #: the cache-write ops' data-dependent value checks (host reads) during the steps
    op_value_checks: bool = False
    out: str = "bench/results"
    tag: str = ""
    timeout_s: float = 580.0


def configure_dynamo() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))
    try:  # equal sizes (rows, table columns) must not merge into one symbol
        torch.fx.experimental._config.use_duck_shape = False
    except AttributeError:
        pass


def compiled_variants(model: torch.nn.Module, name: str, variants: tuple[str, ...]) -> dict[str, Any]:
    """variant -> compiled step, and for the synced variants their backend."""
    from pcppass.compiler import PcpBackend, SyncChecks

    plain = torch.compile(model, fullgraph=True)
    out: dict[str, Any] = {"replicated": (plain, None), "nosync": (plain, None)}
    for v in variants:
        if v in SYNCED:
            checks = SyncChecks() if v != "deferred_nochecks" else SyncChecks(
                inputs=False, header=False, slot_conflicts=False, compile_fingerprint=False)
            backend = PcpBackend(schedule="immediate" if v == "immediate" else "deferred", inner="inductor",
                                 checks=checks, name=f"{name}-{v}")
            out[v] = (torch.compile(model, backend=backend, fullgraph=True), backend)
    return out


def bench_model(rank: int, world: int, cfg: StepBenchConfig, name: str, layers: int,
                log: Callable[[str], None]) -> dict:
    from pcppass.models import build_model
    from pcppass.runtime.stats import SYNC_COUNTERS

    torch._dynamo.reset()
    t0 = time.time()
    model = build_model(name, cfg.size, dtype=torch.bfloat16, device="cuda", num_layers=layers)
    requests = max(cfg.rows_per_rank) * world
    extra = 4 * cfg.smoke_steps + 2  # smoke steps of up to three sharded variants + the control
    setup = DecodeSetup(model, requests, max(cfg.contexts), extra, seed=1234)
    res: dict[str, Any] = {
        "model": name, "layers": layers,
        "params": sum(p.numel() for p in model.parameters()),
        "cache_bytes_per_rank": setup.cache_bytes(),
        "caches": {k: [list(v.shape), str(v.dtype)] for k, v in setup.caches.items()},
        "build_s": round(time.time() - t0, 1),
    }
    log(f"{name} x{layers}: built in {res['build_s']} s, caches {setup.cache_bytes() / 2**30:.1f} GiB")
    compiled = compiled_variants(model, name, cfg.variants)

    def call(variant: str, reqs: list[int], context: int, position: int):
        fn = compiled[variant][0]
        ids, positions, meta = setup.step(reqs, context, position)

        def step():
            hidden = fn(ids, positions, meta, setup.caches)
            if cfg.gather_hidden and variant in SHARDED:
                out = hidden.new_empty((hidden.shape[0] * world, hidden.shape[1]))
                dist.all_gather_into_tensor(out, hidden)
                return out
            return hidden

        return step

    # -- compile + correctness smoke (first N and context)
    n0, c0 = cfg.rows_per_rank[0], cfg.contexts[0]
    compile_s: dict[str, float] = {}
    smoke: dict[str, Any] = {}
    position = c0
    for v in [v for v in SYNCED if v in cfg.variants]:
        t = time.time()
        syncs = []
        for s in range(cfg.smoke_steps):
            SYNC_COUNTERS.take()
            call(v, owned(n0 * world, world, rank, s), c0, position)()
            torch.cuda.synchronize()
            counts = SYNC_COUNTERS.take()
            syncs.append([counts.collectives, counts.bytes_sent, counts.bytes_gathered])
            position += 1
            if s == 0:
                compile_s[v] = round(time.time() - t, 1)
        equal = caches_equal_across_ranks(setup.caches)
        backend = compiled[v][1]
        smoke[v] = {"steps": cfg.smoke_steps, "replicas_equal": all(equal.values()),
                    "differing_caches": [k for k, ok in equal.items() if not ok],
                    "syncs_per_step": syncs,
                    "graph_collectives": [r.collectives for r in backend.reports],
                    "reports": [r.reason for r in backend.reports],
                    **sync_info.transport(backend), "checks": sync_info.checks(backend)}
        log(f"{name}: smoke {v}: replicas equal={smoke[v]['replicas_equal']} syncs={syncs[-1]} "
            f"transport={smoke[v]['transport']} (compile+first step {compile_s[v]} s)")
    if "nosync" in cfg.variants or "replicated" in cfg.variants:
        t = time.time()
        call("nosync", owned(n0 * world, world, rank, 0), c0, position)()
        torch.cuda.synchronize()
        compile_s["plain"] = round(time.time() - t, 1)
        equal = caches_equal_across_ranks(setup.caches)
        smoke["nosync_control"] = {"replicas_equal": all(equal.values()),
                                   "differing_caches": [k for k, ok in equal.items() if not ok],
                                   "expected": "replicas differ (no sync)"}
        log(f"{name}: nosync control: replicas equal={smoke['nosync_control']['replicas_equal']}")
    res["compile_s"] = compile_s
    res["smoke"] = smoke

    # -- timings
    configs = []
    for n in cfg.rows_per_rank:
        for c in cfg.contexts:
            entry: dict[str, Any] = {"rows_per_rank": n, "context": c, "requests": n * world, "variants": {}}
            steps = {}
            for v in cfg.variants:
                reqs = list(range(n * world)) if v == "replicated" else owned(n * world, world, rank, 0)
                steps[v] = call(v, reqs, c, c)
                SYNC_COUNTERS.take()
                steps[v]()
                torch.cuda.synchronize()
                counts = SYNC_COUNTERS.take()
                ms = time_steps(steps[v], cfg.warmup, cfg.reps)
                entry["variants"][v] = {**timed(ms, "eager-launch"), "rows": len(reqs),
                                        "sync_collectives": counts.collectives,
                                        "sync_bytes_sent": counts.bytes_sent,
                                        "sync_bytes_gathered": counts.bytes_gathered}
            deferred = entry["variants"].get("deferred", {})
            if deferred.get("sync_bytes_sent"):
                entry["bare_all_gather_sync_bytes"] = bare_all_gather_us(deferred["sync_bytes_sent"])
            if cfg.cuda_graph:
                for v, step in steps.items():
                    ok, why = sync_info.capturable(compiled[v][1])
                    if not ok:
                        entry["variants"][v]["cuda_graph"] = {"captured": False, "reason": why}
                        continue
                    ms, status = time_graph(step, cfg.warmup, cfg.reps)
                    if ms is None:
                        entry["variants"][v]["cuda_graph"] = {"captured": False, "reason": status}
                    else:
                        entry["variants"][v]["cuda_graph"] = {"captured": True, **timed(ms, "cuda-graph")}
            derive(entry)
            configs.append(entry)
            log(f"{name} x{layers}: N={n} C={c}: " + ", ".join(
                f"{v}={d.get('slowest_rank_ms', float('nan')):.3f}ms"
                + (f"/graph {d['cuda_graph']['slowest_rank_ms']:.3f}" if d.get("cuda_graph", {}).get("captured")
                   else "")
                for v, d in entry["variants"].items()))
    res["configs"] = configs
    del compiled, setup, model
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return res


def _fractions(times: dict[str, float | None], prefix: str) -> dict[str, float]:
    """Sync cost and speedups of one timing mode: ideal = replicated / nosync, a variant's speedup
    = replicated / variant, its fraction of the ideal = nosync / variant."""
    rep, nos = times.get("replicated"), times.get("nosync")
    d: dict[str, float] = {}
    if rep and nos:
        d[f"{prefix}ideal_speedup"] = rep / nos
    for v in SYNCED:
        val = times.get(v)
        if val and nos:
            d[f"{prefix}{v}_sync_ms"] = val - nos
            d[f"{prefix}{v}_fraction_of_ideal"] = nos / val
        if val and rep:
            d[f"{prefix}{v}_speedup"] = rep / val
    return d


def derive(entry: dict) -> None:
    """Derived numbers from the slowest-rank medians, eager and (when captured) CUDA graph."""
    v = entry["variants"]
    eager = {name: d.get("slowest_rank_ms") for name, d in v.items()}
    graph = {name: d["cuda_graph"]["slowest_rank_ms"] for name, d in v.items()
             if d.get("cuda_graph", {}).get("captured")}
    d = {**_fractions(eager, ""), **_fractions(graph, "graph_")}
    for prefix in ("", "graph_"):
        bare = entry.get("bare_all_gather_sync_bytes", {}).get("graph_us" if prefix else "eager_us")
        sync = d.get(f"{prefix}deferred_sync_ms")
        if bare and sync is not None:
            d[f"{prefix}deferred_sync_vs_bare_all_gather"] = sync * 1000 / bare
    entry["derived"] = d


def bench_rank(rank: int, world: int, cfg: StepBenchConfig) -> dict:
    """One rank of the decode-step bench (started by :func:`pcppass.engine.launch.launch`)."""
    import pcppass.kernels  # noqa: F401
    from pcppass.bench.sync_micro import sync_microbench
    from pcppass.kernels import checks, rows_cuda

    configure_dynamo()
    result: dict[str, Any] = {"environment": environment(), "config": asdict(cfg), "models": {}, "errors": []}

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def save() -> None:
        if rank == 0:
            save_partial(cfg.out, f"bench_{cfg.tag}", result)

    with rows_cuda.kernels_enabled(cfg.sync_kernels == "device"), checks.value_checks(cfg.op_value_checks):
        if cfg.sync_microbench:
            try:
                result["sync_microbench"] = sync_microbench(rank, world, cfg, log)
            except Exception:
                result["errors"].append({"stage": "sync_microbench", "traceback": traceback.format_exc()[-3000:]})
                log(result["errors"][-1]["traceback"])
            save()
        for name in cfg.models:
            for layers in cfg.layers:
                key = name if layers == cfg.layers[0] else f"{name}_x{layers}"
                try:
                    result["models"][key] = bench_model(rank, world, cfg, name, layers, log)
                except Exception:
                    result["errors"].append({"stage": key, "traceback": traceback.format_exc()[-3000:]})
                    log(result["errors"][-1]["traceback"])
                    torch._dynamo.reset()
                    torch.cuda.empty_cache()
                save()
    return result
