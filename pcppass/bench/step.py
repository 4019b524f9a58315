"""The decode-step bench: one decode step replicated and decode-sharded on P GPUs, side by side.

Per model, in the same processes and on the same caches, every variant of one decode step of
``N * P`` requests at context ``C``:

* ``replicated``: every rank runs all ``N * P`` rows; no sync (decode as vLLM runs it with PCP);
* ``immediate``: ``N`` rows per rank through :class:`pcppass.compiler.PcpBackend`, one sync right
  after every write site (per-site sync, the method decode sharding started with);
* ``deferred``: the same with pcppass's single sync at the end of the step, the transport chosen
  by the backend (peer stores where the caches live in symmetric memory, the all-gather otherwise);
* ``deferred_allgather``: ``deferred`` with the all-gather transport forced;
* ``<variant>_nochecks``: a synced variant with every check off (what the checks cost; only beside
  the checked variant, with ``--also-checks-off``);
* ``nosync``: ``N`` rows per rank, no sync at all: the lower bound (replicas diverge; timing only).

Synced variants run with the backend's checks on (:class:`~pcppass.checks.SyncChecks` defaults)
and record the checks and the transport their graphs carry (:mod:`pcppass.bench.sync_info`).
Sharded variants also all-gather the final hidden rows, as an engine must. Each variant launches
its attention kernels for its own rows per rank (:func:`pcppass.engine.attention.launch.decode_rows_per_rank`:
``N * P`` replicated, ``N`` sharded), as a deployment of either would. Before timing, a smoke
runs a few sharded steps with moving ownership and compares every cache bitwise across ranks (and
checks that ``nosync`` does make them differ). With ``cuda_graph`` a step is captured when
:func:`pcppass.runtime.capturable.capturable` says it can be (on CUDA the checks run on the device);
after its timed replays one more replay with rotated owners at a new position runs, then the
device status is read and every cache compared bitwise across ranks. See docs/BENCH.md.
"""

from __future__ import annotations

import itertools
import time
import traceback
from dataclasses import asdict, fields
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from pcppass.bench import sync_info
from pcppass.runtime import capturable
from pcppass.bench.environment import environment
from pcppass.bench.inputs import DecodeSetup, caches_equal_across_ranks, owned
from pcppass.bench.results import save_partial
from pcppass.bench.step_config import NOCHECKS, SHARDED, SYNCED, SYNCED_KINDS, StepBenchConfig
from pcppass.bench.sync_micro import sync_microbench
from pcppass.bench.timing import bare_all_gather_us, capture, time_steps, timed
from pcppass.runtime.collectives import all_gather_single
from pcppass.engine.attention.launch import decode_rows_per_rank


def checks_off() -> Any:
    """``SyncChecks`` with every switch off."""
    from pcppass.checks import SyncChecks

    return SyncChecks(**{f.name: False for f in fields(SyncChecks) if isinstance(f.default, bool)})


def model_specs(models: tuple[str, ...], layers: tuple[int, ...]) -> list[tuple[str, int]]:
    """``("llama", "deepseek_v32:16")`` with ``layers`` (2,) -> [("llama", 2), ("deepseek_v32", 16)]:
    ``name:L`` runs that model with L layers only."""
    out = []
    for spec in models:
        name, _, count = spec.partition(":")
        out += [(name, int(count))] if count else [(name, n) for n in layers]
    return out


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
    """variant -> (compiled step, its backend or None)."""
    from pcppass.compiler import PcpBackend, SyncChecks

    plain = torch.compile(model, fullgraph=True)
    out: dict[str, Any] = {"replicated": (plain, None), "nosync": (plain, None)}
    for v in variants:
        if v in SYNCED:
            schedule, transport = SYNCED_KINDS[v.removesuffix(NOCHECKS)]
            checks = checks_off() if v.endswith(NOCHECKS) else SyncChecks()
            backend = PcpBackend(schedule=schedule, inner="inductor", checks=checks, transport=transport,
                                 name=f"{name}-{v}")
            out[v] = (torch.compile(model, backend=backend, fullgraph=True), backend)
    return out


def bench_model(rank: int, world: int, cfg: StepBenchConfig, name: str, layers: int,
                log: Callable[[str], None]) -> dict:
    from pcppass.models import build_model

    torch._dynamo.reset()
    t0 = time.time()
    model = build_model(name, cfg.size, dtype=torch.bfloat16, device="cuda", num_layers=layers)
    requests = max(cfg.rows_per_rank) * world
    synced = [v for v in SYNCED if v in cfg.variants]
    # positions past the context: the smoke's steps and its nosync control, then one fresh position
    # per replay check (a row rewritten with the bytes it holds would prove nothing)
    smoke_positions = cfg.smoke_steps * len(synced) + 2
    replay_checks = len(cfg.rows_per_rank) * len(cfg.contexts) * len(cfg.variants)
    extra = smoke_positions + replay_checks + 1
    setup = DecodeSetup(model, requests, max(cfg.contexts), extra, seed=1234)
    symmetric = setup.move_caches_to_symmetric_memory() if cfg.symmetric_caches else "not asked for"
    res: dict[str, Any] = {
        "model": name, "layers": layers,
        "params": sum(p.numel() for p in model.parameters()),
        "cache_bytes_per_rank": setup.cache_bytes(),
        "caches": {k: [list(v.shape), str(v.dtype)] for k, v in setup.caches.items()},
        "caches_in_symmetric_memory": symmetric is None,
        "build_s": round(time.time() - t0, 1),
    }
    if symmetric is not None and cfg.symmetric_caches:
        res["symmetric_memory_refused"] = symmetric
    log(f"{name} x{layers}: built in {res['build_s']} s, caches {setup.cache_bytes() / 2**30:.1f} GiB, "
        f"symmetric memory: {symmetric or 'yes'}")
    compiled = compiled_variants(model, name, cfg.variants)

    def call(variant: str, n: int, context: int, position: int, turn: int = 0) -> tuple[Callable[[], Any], tuple]:
        """The step of ``variant`` (and its inputs) for ``n`` rows per rank; owners rotated by ``turn``."""
        fn = compiled[variant][0]
        reqs = list(range(n * world)) if variant == "replicated" else owned(n * world, world, rank, turn)
        inputs = setup.step(reqs, context, position)
        ids, positions, meta = inputs

        def step():
            # kernels launched for this variant's rows per rank, as its deployment would set them
            with decode_rows_per_rank(len(reqs)):
                hidden = fn(ids, positions, meta, setup.caches)
            if cfg.gather_hidden and variant in SHARDED:
                out = hidden.new_empty((hidden.shape[0] * world, hidden.shape[1]))
                all_gather_single(out, hidden)
                return out
            return hidden

        return step, inputs

    res["compile_s"], res["smoke"] = smoke(cfg, world, call, compiled, setup, log, name)
    fresh = itertools.count(smoke_positions)
    configs = []
    for n in cfg.rows_per_rank:
        for c in cfg.contexts:
            configs.append(time_config(cfg, call, compiled, setup, n, c, world, fresh))
            log(f"{name} x{layers}: N={n} C={c}: " + ", ".join(
                f"{v}={d.get('slowest_rank_ms', float('nan')):.3f}ms"
                + (f"/graph {d['cuda_graph']['slowest_rank_ms']:.3f}" if d.get("cuda_graph", {}).get("captured")
                   else "")
                for v, d in configs[-1]["variants"].items()))
    res["configs"] = configs
    del compiled, setup, model
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return res


def smoke(cfg: StepBenchConfig, world: int, call: Callable, compiled: dict, setup: DecodeSetup,
          log: Callable[[str], None], name: str) -> tuple[dict, dict]:
    """Compile every variant and run the correctness smoke: sharded steps with rotating owners must
    leave every cache bitwise equal across ranks; the ``nosync`` control must make them differ."""
    from pcppass.sync.stats import SYNC_COUNTERS

    n0, c0 = cfg.rows_per_rank[0], cfg.contexts[0]
    compile_s: dict[str, float] = {}
    out: dict[str, Any] = {}
    position = c0
    for v in [v for v in SYNCED if v in cfg.variants]:
        t = time.time()
        syncs = []
        for s in range(cfg.smoke_steps):
            SYNC_COUNTERS.take()
            call(v, n0, c0, position, turn=s)[0]()
            torch.cuda.synchronize()
            counts = SYNC_COUNTERS.take()
            syncs.append([counts.collectives, counts.bytes_sent, counts.bytes_gathered])
            position += 1
            if s == 0:
                compile_s[v] = round(time.time() - t, 1)
        equal = caches_equal_across_ranks(setup.caches)
        backend = compiled[v][1]
        out[v] = {"steps": cfg.smoke_steps, "replicas_equal": all(equal.values()),
                  "differing_caches": [k for k, ok in equal.items() if not ok],
                  "syncs_per_step": syncs,
                  "graph_collectives": [r.collectives for r in backend.reports],
                  "reports": [r.reason for r in backend.reports],
                  **sync_info.transport(backend), "checks": sync_info.checks(backend)}
        log(f"{name}: smoke {v}: replicas equal={out[v]['replicas_equal']} syncs={syncs[-1]} "
            f"transport={out[v]['transport']} (compile+first step {compile_s[v]} s)")
    if "nosync" in cfg.variants or "replicated" in cfg.variants:
        t = time.time()
        call("nosync", n0, c0, position)[0]()
        torch.cuda.synchronize()
        compile_s["plain"] = round(time.time() - t, 1)
        equal = caches_equal_across_ranks(setup.caches)
        out["nosync_control"] = {"replicas_equal": all(equal.values()),
                                 "differing_caches": [k for k, ok in equal.items() if not ok],
                                 "expected": "replicas differ (no sync)"}
        log(f"{name}: nosync control: replicas equal={out['nosync_control']['replicas_equal']}")
    return compile_s, out


def time_config(cfg: StepBenchConfig, call: Callable, compiled: dict, setup: DecodeSetup, n: int, c: int,
                world: int, fresh: Iterator[int]) -> dict:
    """Every variant at ``n`` rows per rank and context ``c``: eager, then (``cuda_graph``) replays,
    each checked by a replay at position ``c + next(fresh)``, where no step wrote before."""
    from pcppass.sync.stats import SYNC_COUNTERS

    entry: dict[str, Any] = {"rows_per_rank": n, "context": c, "requests": n * world, "variants": {}}
    steps = {}
    for v in cfg.variants:
        steps[v] = call(v, n, c, c)
        SYNC_COUNTERS.take()
        steps[v][0]()
        torch.cuda.synchronize()
        counts = SYNC_COUNTERS.take()
        ms = time_steps(steps[v][0], cfg.warmup, cfg.reps)
        backend = compiled[v][1]
        entry["variants"][v] = {**timed(ms, "eager-launch"), "rows": len(steps[v][1][0]),
                                "sync_collectives": counts.collectives,
                                "sync_bytes_sent": counts.bytes_sent,
                                "sync_bytes_gathered": counts.bytes_gathered}
        if backend is not None:
            entry["variants"][v]["transport"] = sync_info.transport(backend)["transport"]
            entry["variants"][v]["checks"] = sync_info.checks(backend)
    sent = next((d["sync_bytes_sent"] for v, d in entry["variants"].items() if v in SYNCED and d["sync_bytes_sent"]),
                None)
    if sent:
        entry["bare_all_gather_sync_bytes"] = bare_all_gather_us(sent)
    if cfg.cuda_graph:
        for v, (step, inputs) in steps.items():
            ok, why = capturable.capturable(compiled[v][1])
            entry["variants"][v]["cuda_graph"] = (
                replayed(step, inputs, call(v, n, c, c + next(fresh), turn=1)[1], setup.caches, cfg) if ok
                else {"captured": False, "reason": why})
    derive(entry)
    return entry


def replayed(step: Callable[[], Any], inputs: tuple, rotated: tuple, caches: dict[str, torch.Tensor],
             cfg: StepBenchConfig) -> dict:
    """``step`` captured in a CUDA graph and timed by replaying it, on replicas made identical first;
    then the step's inputs are overwritten with ``rotated`` (owners rotated, a position no step
    wrote yet) and replayed once more. Then the device status is read (the checks record what they find there;
    nothing raises during replays) and every cache compared bitwise across ranks."""
    from pcppass.sync import device_checks

    make_replicas_identical(caches)
    graph, status = capture(step)
    if graph is None:
        return {"captured": False, "reason": status}
    ms = time_steps(graph.replay, cfg.warmup, cfg.reps)
    for dst, src in zip(flat_tensors(inputs), flat_tensors(rotated)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    error = device_checks.pending("cuda")
    equal = caches_equal_across_ranks(caches)
    del graph
    return {"captured": True, **timed(ms, "cuda-graph"), "replicas_equal_after_replays": all(equal.values()),
            "differing_caches": [k for k, ok in equal.items() if not ok],
            "device_status": str(error) if error is not None else "clean"}


def flat_tensors(inputs: tuple) -> list[torch.Tensor]:
    """The tensors of ``(input_ids, positions, meta)`` in a fixed order."""
    ids, positions, meta = inputs
    return [ids, positions, *(meta[k] for k in sorted(meta))]


def make_replicas_identical(caches: dict[str, torch.Tensor]) -> None:
    """Every rank's caches become rank 0's bytes (controls and replicated steps leave them apart)."""
    for cache in caches.values():
        dist.broadcast(cache.view(torch.uint8) if cache.is_contiguous() else cache, src=0)
    torch.cuda.synchronize()


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
    import pcppass.ops  # noqa: F401
    from pcppass.ops import checks
    from pcppass.sync import rows_cuda

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
        for name, layers in model_specs(cfg.models, cfg.layers):
            key = name if layers == cfg.layers[0] else f"{name}_x{layers}"
            try:
                result["models"][key] = bench_model(rank, world, cfg, name, layers, log)
            except Exception:
                result["errors"].append({"stage": key, "traceback": traceback.format_exc()[-3000:]})
                log(result["errors"][-1]["traceback"])
                torch._dynamo.reset()
                torch.cuda.empty_cache()
            save()
            if not dist.is_initialized():  # a failed sharded step aborted the group (fail-stop)
                result["errors"].append({"stage": "run", "traceback": "the process group was aborted: "
                                         "the models after this one were not run"})
                save()
                break
    return result
