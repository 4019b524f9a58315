"""``pcppass bench``: time one decode step replicated and decode-sharded on P GPUs, side by side.

    pcppass bench --model deepseek_v32,llama --world 2 --rows-per-rank 8,32 --context 4096,32768

Spawns P processes (NCCL, one GPU each), builds each full-width model, fills paged caches for
``N * P`` decode requests of context ``C`` (random bytes: the timing does not depend on them) and
times one decode step per variant, in the same processes and on the same caches:

* ``replicated``: every rank runs all ``N * P`` rows; no sync (decode as vLLM runs it with PCP);
* ``immediate``: ``N`` rows per rank through :class:`pcppass.compiler.PcpBackend`, one sync
  collective right after every write site;
* ``deferred``: the same with pcppass's single packed collective at the end of the step;
* ``deferred_checked``: ``deferred`` with every run-time check on (input validation, header
  fingerprint, slot conflicts: the backend's defaults); the other sharded variants turn them off;
* ``nosync``: ``N`` rows per rank, no sync at all: the lower bound (replicas diverge; timing only).

Sharded variants also all-gather the final hidden rows (``--gather-hidden``), as an engine must.
Before timing, a correctness smoke runs a few sharded steps with moving ownership and compares every
cache bitwise across ranks (and checks that ``nosync`` does make them differ).

Every variant is compiled with Inductor. Steps are timed with CUDA events after a warm-up; the
median over ranks' medians is reported, with the slowest rank's. With ``--cuda-graph`` each
variant is also captured in a ``torch.cuda.CUDAGraph`` and replayed; a variant whose step cannot
be captured reports why. ``--sync-microbench`` adds the sync-cost microbenchmark: a 61-layer
DeepSeek-V3.2-shaped KV sync through the real ``pcppass::sync_*`` ops, per write site vs one
packed collective, against bare all-gathers of the same bytes.

Results: ``<out>/bench_<tag>.json`` (device, versions, date, configuration, every number) and
``<out>/bench_<tag>.md`` (tables). See docs/BENCH.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

VARIANTS = ("replicated", "immediate", "deferred", "deferred_checked", "nosync")
DEFAULT_VARIANTS = ("replicated", "immediate", "deferred", "nosync")
SHARDED = ("immediate", "deferred", "deferred_checked", "nosync")
#: NVLink multicast stays off on the shared GPU hosts (it can take their GPUs out of service)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class BenchConfig:
    models: tuple[str, ...] = ("deepseek_v32",)
    size: str = "full"
    world: int = 2
    rows_per_rank: tuple[int, ...] = (32,)
    contexts: tuple[int, ...] = (4096,)
    layers: int = 2
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


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _summary(ms: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ms, n=10) if len(ms) >= 2 else [ms[0]] * 9
    return {"median_ms": statistics.median(ms), "p10_ms": q[0], "p90_ms": q[-1],
            "mean_ms": statistics.fmean(ms), "reps": len(ms)}


def time_steps(fn: Callable[[], Any], warmup: int, reps: int) -> list[float]:
    """Per-call GPU time (ms) between CUDA events; calls are issued back to back."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def time_graph(fn: Callable[[], Any], warmup: int, reps: int) -> tuple[list[float] | None, str]:
    """Capture ``fn`` (already warmed up) in a CUDA graph and time its replays."""
    graph = torch.cuda.CUDAGraph()
    try:
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # a step that reads the device on the host cannot be captured
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    return time_steps(graph.replay, warmup, reps), "captured"


def _across_ranks(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _timed(ms_this_rank: list[float], mode: str) -> dict[str, Any]:
    """Median over this rank's reps, plus every rank's median (the step ends with the slowest)."""
    mine = _summary(ms_this_rank)
    medians = _across_ranks(mine["median_ms"])
    return {**mine, "mode": mode, "rank_medians_ms": medians, "slowest_rank_ms": max(medians)}


def bare_all_gather_us(nbytes: int, reps: int = 200, graph: bool = True) -> dict[str, float]:
    """One all-gather of ``nbytes`` per rank: eager and CUDA-graph replay, µs per call."""
    buf = torch.randint(0, 255, (max(nbytes, 1),), dtype=torch.uint8, device="cuda")
    out = torch.empty(buf.numel() * dist.get_world_size(), dtype=torch.uint8, device="cuda")

    def gather():
        dist.all_gather_into_tensor(out, buf)

    res = {"bytes_per_rank": nbytes,
           "eager_us": statistics.median(time_steps(gather, 10, reps)) * 1000}
    if graph:
        ms, status = time_graph(gather, 10, reps)
        if ms is not None:
            res["graph_us"] = statistics.median(ms) * 1000
    return res


# ---------------------------------------------------------------------------------------------
# Paged decode inputs for N * P requests of context C
# ---------------------------------------------------------------------------------------------


class DecodeSetup:
    """Caches and block tables for ``requests`` decode requests, each with ``context`` cached
    positions, plus room for ``extra`` more positions (smoke steps write past the context)."""

    def __init__(self, model: torch.nn.Module, requests: int, max_context: int, extra: int, seed: int,
                 device: str = "cuda"):
        from pcppass.engine.contract import slot_key, table_key

        self.model, self.requests, self.extra, self.device = model, requests, extra, device
        self.groups = {g.name: g for g in model.cache_groups()}
        self.slot_key, self.table_key = slot_key, table_key
        self.columns_max = {n: g.blocks_for(max_context + extra, 1) for n, g in self.groups.items()}
        num_blocks = {n: 1 + requests * c for n, c in self.columns_max.items()}  # block 0: null block
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)  # the same bytes on every rank: replicas start identical
        self.caches = {s.name: _random_cache((num_blocks[s.group], *s.block_shape), s.dtype, gen, device)
                       for s in model.cache_specs()}
        self.vocab = model.embed_tokens.num_embeddings

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.caches.values())

    def columns(self, group: str, context: int) -> int:
        return self.groups[group].blocks_for(context + self.extra, 1)

    def table_row(self, group: str, req: int, context: int) -> list[int]:
        base = 1 + req * self.columns_max[group]
        return list(range(base, base + self.columns(group, context)))

    def step(self, reqs: list[int], context: int, position: int) -> tuple:
        """``(input_ids, positions, meta)`` of one decode row per request in ``reqs`` at ``position``."""
        dev = self.device
        t = len(reqs)

        def i64(x):
            return torch.tensor(x, dtype=torch.int64, device=dev)

        meta = {
            "token_to_req": torch.arange(t, device=dev),
            "seq_lens": torch.full((t,), position + 1, dtype=torch.int64, device=dev),
            "query_start_loc": torch.arange(t + 1, device=dev),
            "is_padding": torch.zeros(t, dtype=torch.bool, device=dev),
        }
        for name, group in self.groups.items():
            rows = [self.table_row(name, r, context) for r in reqs]
            meta[self.table_key(name)] = i64(rows)
            meta[self.slot_key(name)] = i64([group.slot(row, position) for row in rows])
        ids = i64([(r * 7919 + position) % self.vocab for r in reqs])
        positions = torch.full((t,), position, dtype=torch.int64, device=dev)
        # One graph for every row count and context (the ShardedRunner marks rows the same way).
        for x in (ids, positions, *meta.values()):
            torch._dynamo.maybe_mark_dynamic(x, 0)
        for name in self.groups:
            torch._dynamo.maybe_mark_dynamic(meta[self.table_key(name)], 1)
        return ids, positions, meta


def _random_cache(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str) -> torch.Tensor:
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return torch.randn(shape, dtype=dtype, device=device, generator=gen)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)
    raw &= 0x77  # e4m3 / packed bytes: no NaN codes, no huge scales
    return raw.view(dtype) if dtype.itemsize == 1 else raw


def owned(requests: int, world: int, rank: int, step: int) -> list[int]:
    """Round-robin ownership, rotated every step so rows move between ranks."""
    return [i for i in range(requests) if (i + step) % world == rank]


def caches_equal_across_ranks(caches: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Per cache: bitwise equal to rank 0's copy on every rank."""
    out = {}
    for name, cache in caches.items():
        theirs = cache.clone()
        dist.broadcast(theirs, src=0)
        same = torch.tensor([int(torch.equal(theirs.view(torch.uint8), cache.view(torch.uint8)))],
                            device=cache.device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        out[name] = bool(same.item())
        del theirs
    return out


# ---------------------------------------------------------------------------------------------
# Model benchmark (one rank)
# ---------------------------------------------------------------------------------------------


def _configure_dynamo() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))
    try:  # equal sizes (rows, table columns) must not merge into one symbol
        torch.fx.experimental._config.use_duck_shape = False
    except AttributeError:
        pass


def _compiled_variants(model: torch.nn.Module, name: str, variants: tuple[str, ...]) -> dict[str, Any]:
    from pcppass.compiler import PcpBackend, SyncChecks

    # compile_fingerprint off: the graph text hashed for it holds each rank's device index
    # (device(type='cuda', index=<rank>)), so on several GPUs the ranks' fingerprints differ.
    fast = SyncChecks(inputs=False, header=False, slot_conflicts=False, compile_fingerprint=False)
    plain = torch.compile(model, fullgraph=True)
    out: dict[str, Any] = {"replicated": plain, "nosync": plain}
    for v in variants:
        if v in ("immediate", "deferred", "deferred_checked"):
            backend = PcpBackend(schedule="immediate" if v == "immediate" else "deferred", inner="inductor",
                                 checks=SyncChecks() if v == "deferred_checked" else fast, name=f"{name}-{v}")
            out[v] = (torch.compile(model, backend=backend, fullgraph=True), backend)
    return out


def bench_model(rank: int, world: int, cfg: BenchConfig, name: str, log: Callable[[str], None]) -> dict:
    from pcppass.models import build_model
    from pcppass.runtime.stats import SYNC_COUNTERS

    torch._dynamo.reset()
    t0 = time.time()
    model = build_model(name, cfg.size, dtype=torch.bfloat16, device="cuda", num_layers=cfg.layers)
    requests = max(cfg.rows_per_rank) * world
    extra = 4 * cfg.smoke_steps + 2  # smoke steps of up to three sharded variants + the control
    setup = DecodeSetup(model, requests, max(cfg.contexts), extra, seed=1234)
    res: dict[str, Any] = {
        "model": name, "layers": cfg.layers,
        "params": sum(p.numel() for p in model.parameters()),
        "cache_bytes_per_rank": setup.cache_bytes(),
        "caches": {k: [list(v.shape), str(v.dtype)] for k, v in setup.caches.items()},
        "build_s": round(time.time() - t0, 1),
    }
    log(f"{name}: built in {res['build_s']} s, caches {setup.cache_bytes() / 2**30:.1f} GiB")
    compiled = _compiled_variants(model, name, cfg.variants)

    def call(variant: str, reqs: list[int], context: int, position: int):
        fn = compiled[variant][0] if isinstance(compiled[variant], tuple) else compiled[variant]
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
    for v in [v for v in ("deferred", "immediate", "deferred_checked") if v in cfg.variants]:
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
                    "reports": [r.reason for r in backend.reports]}
        log(f"{name}: smoke {v}: replicas equal={smoke[v]['replicas_equal']} syncs={syncs[-1]} "
            f"(compile+first step {compile_s[v]} s)")
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
                try:
                    SYNC_COUNTERS.take()
                    steps[v]()
                    torch.cuda.synchronize()
                    counts = SYNC_COUNTERS.take()
                    ms = time_steps(steps[v], cfg.warmup, cfg.reps)
                    entry["variants"][v] = {**_timed(ms, "eager-launch"), "rows": len(reqs),
                                            "sync_collectives": counts.collectives,
                                            "sync_bytes_sent": counts.bytes_sent,
                                            "sync_bytes_gathered": counts.bytes_gathered}
                except Exception as exc:
                    entry["variants"][v] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                    raise
            deferred = entry["variants"].get("deferred", {})
            if deferred.get("sync_bytes_sent"):
                entry["bare_all_gather_sync_bytes"] = bare_all_gather_us(deferred["sync_bytes_sent"])
            hidden = model.config.hidden_size * n * 2
            if cfg.gather_hidden:
                entry["bare_all_gather_hidden"] = bare_all_gather_us(hidden)
            if cfg.cuda_graph:
                for v, step in steps.items():
                    ms, status = time_graph(step, cfg.warmup, cfg.reps)
                    if ms is None:
                        entry["variants"][v]["cuda_graph"] = {"captured": False, "reason": status}
                    else:
                        entry["variants"][v]["cuda_graph"] = {"captured": True, **_timed(ms, "cuda-graph")}
            _derive(entry)
            configs.append(entry)
            log(f"{name}: N={n} C={c}: " + ", ".join(
                f"{v}={d.get('median_ms', float('nan')):.3f}ms" for v, d in entry["variants"].items()))
    res["configs"] = configs
    del compiled, setup, model
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return res


def _derive(entry: dict) -> None:
    """Sync cost and speedups from the slowest-rank medians (the step ends with the slowest rank)."""
    v = entry["variants"]

    def t(name):
        d = v.get(name, {})
        return d.get("slowest_rank_ms")

    rep, dfr, imm, nos = t("replicated"), t("deferred"), t("immediate"), t("nosync")
    d: dict[str, Any] = {}
    if dfr and nos:
        d["deferred_sync_ms"] = dfr - nos
        bare = entry.get("bare_all_gather_sync_bytes", {}).get("eager_us")
        if bare:
            d["deferred_sync_vs_bare_all_gather"] = (dfr - nos) * 1000 / bare
    if imm and nos:
        d["immediate_sync_ms"] = imm - nos
    if rep and nos:
        d["ideal_speedup"] = rep / nos
        for name, val in (("deferred", dfr), ("immediate", imm)):
            if val:
                d[f"{name}_speedup"] = rep / val
                d[f"{name}_fraction_of_ideal"] = (rep / val) / (rep / nos)
    def g(name):
        graph = v.get(name, {}).get("cuda_graph", {})
        return graph.get("slowest_rank_ms") if graph.get("captured") else None

    rep, dfr, nos = g("replicated"), g("deferred"), g("nosync")
    if dfr and nos:
        d["graph_deferred_sync_ms"] = dfr - nos
        bare = entry.get("bare_all_gather_sync_bytes", {}).get("graph_us")
        if bare:
            d["graph_deferred_sync_vs_bare_all_gather"] = (dfr - nos) * 1000 / bare
    if rep and nos and dfr:
        d["graph_ideal_speedup"] = rep / nos
        d["graph_deferred_speedup"] = rep / dfr
        d["graph_deferred_fraction_of_ideal"] = nos / dfr
    entry["derived"] = d


# ---------------------------------------------------------------------------------------------
# Sync-cost microbenchmark: real pcppass::sync_* ops, DeepSeek-V3.2-shaped caches
# ---------------------------------------------------------------------------------------------

MLA_ROW = 656  # fp8_ds_mla: 512 e4m3 + 4 fp32 tile scales + 64 bf16
INDEXER_VALUES, INDEXER_SCALES = 128, 4
MICRO_BLOCK = 64


def sync_microbench(rank: int, world: int, cfg: BenchConfig, log: Callable[[str], None]) -> dict:
    """The sync part of a ``micro_layers``-layer step, three ways, each per site and deferred:

    * ``reference``: the plain-torch ``pcppass::sync_*`` ops (host reads; ``--micro-reference``);
    * ``per_cache``: the host-read-free torch kernels of :mod:`pcppass.kernels.rows_cuda`, one
      scatter per cache (what the rewrite emitted before ``sync_scatter_rows_all``);
    * ``batched``: the ops as the rewrite emits them now: ``sync_pack`` (one Triton launch for all
      caches), ``sync_read_header``, ONE ``sync_scatter_rows_all`` (one Triton launch).
    """
    from pcppass.kernels import rows_cuda
    from pcppass.kernels.rows import decode_layouts, encode_layout, write_rows
    from pcppass.spec import ResolvedLayout

    ops = torch.ops.pcppass
    group = dist.group.WORLD.group_name
    fp = "5eed" * 8
    mla_layout = encode_layout(ResolvedLayout("paged_rows", MICRO_BLOCK, MLA_ROW))
    idx_layout = encode_layout(ResolvedLayout(
        "block_split", MICRO_BLOCK, INDEXER_VALUES + INDEXER_SCALES,
        segments=((0, INDEXER_VALUES, INDEXER_VALUES),
                  (MICRO_BLOCK * INDEXER_VALUES, INDEXER_SCALES, INDEXER_SCALES))))
    layers = cfg.micro_layers
    out: dict[str, Any] = {"layers": layers, "world": world, "mla_row_bytes": MLA_ROW,
                           "indexer_row_bytes": INDEXER_VALUES + INDEXER_SCALES, "rows": {}}

    def sync(impl: str, caches: list[torch.Tensor], slots: list[torch.Tensor], layouts: list[int],
             payloads: list[torch.Tensor], slot_segments: list[int], verify: bool) -> None:
        """One packed all-gather syncing ``caches`` (``slot_segments``: payload of each cache's slots)."""
        n = len(caches)
        pack = rows_cuda.pack if impl == "per_cache" else ops.sync_pack
        packed = pack(fp, caches, slots, layouts, payloads)
        gathered = packed.new_empty(packed.numel() * world)
        dist.all_gather_into_tensor(gathered, packed)
        header = rows_cuda.read_header if impl == "per_cache" else ops.sync_read_header
        index = header(gathered, world, fp, n + len(payloads), verify)
        decoded = decode_layouts(layouts)
        if impl == "batched":
            ops.sync_scatter_rows_all(caches, gathered, index, list(range(n)), [n + k for k in slot_segments],
                                      layouts, group, "\n".join("c" * n), verify)
            return
        scatter = rows_cuda.scatter_rows if impl == "per_cache" else ops.sync_scatter_rows
        for i, (cache, lay) in enumerate(zip(caches, decoded)):
            scatter(cache, gathered, index, i, n + slot_segments[i], encode_layout(lay), group, "c", verify)

    for rows in cfg.micro_rows:
        nb = 2 + world * rows
        gen = torch.Generator(device="cuda")
        gen.manual_seed(7)
        mla = [torch.randint(0, 256, (nb, MICRO_BLOCK, MLA_ROW), dtype=torch.uint8, device="cuda", generator=gen)
               for _ in range(layers)]
        idx = [torch.randint(0, 256, (nb, MICRO_BLOCK * (INDEXER_VALUES + INDEXER_SCALES)), dtype=torch.uint8,
                             device="cuda", generator=gen) for _ in range(layers)]
        # rank r owns blocks 1 + r*rows + i; one padding row per rank (slot -1)
        slots = (1 + rank * rows + torch.arange(rows, device="cuda")) * MICRO_BLOCK + 3
        slots[-1] = -1
        idx_slots = slots.clone()

        def per_site(impl: str, verify: bool = False):
            def run():
                for layer in range(layers):
                    sync(impl, [mla[layer], idx[layer]], [slots, idx_slots], mla_layout + idx_layout,
                         [slots, idx_slots], [0, 1], verify)
            return run

        def deferred(impl: str, verify: bool = False):
            caches = [c for layer in range(layers) for c in (mla[layer], idx[layer])]
            cache_slots = [s for _ in range(layers) for s in (slots, idx_slots)]
            layouts = [x for _ in range(layers) for x in mla_layout + idx_layout]
            slot_segments = [i % 2 for i in range(len(caches))]

            def run():
                sync(impl, caches, cache_slots, layouts, [slots, idx_slots], slot_segments, verify)
            return run

        packed_bytes = rows_cuda.pack(fp, [mla[0], idx[0]], [slots, idx_slots], mla_layout + idx_layout,
                                      [slots, idx_slots]).numel()
        all_bytes = rows_cuda.pack(fp, [c for layer in range(layers) for c in (mla[layer], idx[layer])],
                                   [s for _ in range(layers) for s in (slots, idx_slots)],
                                   [x for _ in range(layers) for x in mla_layout + idx_layout],
                                   [slots, idx_slots]).numel()
        site_buf = torch.zeros(packed_bytes, dtype=torch.uint8, device="cuda")
        site_out = torch.empty(packed_bytes * world, dtype=torch.uint8, device="cuda")

        def bare_per_site():
            for _ in range(layers):
                dist.all_gather_into_tensor(site_out, site_buf)

        entry: dict[str, Any] = {"bytes_per_rank_deferred": all_bytes, "bytes_per_rank_per_site": packed_bytes,
                                 "collectives_per_site_method": layers, "collectives_deferred": 1}
        reps_slow = max(5, cfg.reps // 2)
        runs = []
        if cfg.micro_reference:
            runs += [("per_site_reference_checked", per_site("reference", True), False, reps_slow),
                     ("deferred_reference_checked", deferred("reference", True), False, reps_slow),
                     ("per_site_reference", per_site("reference"), False, reps_slow),
                     ("deferred_reference", deferred("reference"), False, reps_slow)]
        runs += [("per_site_per_cache", per_site("per_cache"), True, cfg.reps),
                 ("deferred_per_cache", deferred("per_cache"), True, cfg.reps),
                 ("per_site_batched", per_site("batched"), True, cfg.reps),
                 ("deferred_batched", deferred("batched"), True, cfg.reps)]
        for label, fn, device_kernels, reps in runs:
            with rows_cuda.kernels_enabled(device_kernels):
                ms = time_steps(fn, 2, reps)
                entry[f"{label}_eager_us"] = statistics.median(_across_ranks(statistics.median(ms))) * 1000
                if device_kernels:
                    gms, status = time_graph(fn, 3, cfg.reps * 5)
                    entry[f"{label}_graph_us"] = (statistics.median(_across_ranks(statistics.median(gms))) * 1000
                                                  if gms is not None else status)
        entry["bare_per_site_eager_us"] = statistics.median(time_steps(bare_per_site, 3, cfg.reps)) * 1000
        gms, status = time_graph(bare_per_site, 3, cfg.reps * 5)
        entry["bare_per_site_graph_us"] = statistics.median(gms) * 1000 if gms else status
        bare = bare_all_gather_us(all_bytes)
        entry["bare_single_eager_us"] = bare["eager_us"]
        entry["bare_single_graph_us"] = bare.get("graph_us")
        # Correctness of each device path: every rank first writes its own rows (bytes that differ
        # by rank, as an owner's op would), so replicas differ until the sync copies them over.
        all_caches = {f"mla{i}": c for i, c in enumerate(mla)} | {f"idx{i}": c for i, c in enumerate(idx)}
        own = slots[slots >= 0]
        owner_gen = torch.Generator(device="cuda")
        owner_gen.manual_seed(100 + rank)
        for impl in ("per_cache", "batched"):
            for layer in range(layers):
                for cache, lay in ((mla[layer], mla_layout), (idx[layer], idx_layout)):
                    (resolved,) = decode_layouts(lay)
                    fresh = torch.randint(0, 256, (own.numel(), resolved.bytes_per_row), dtype=torch.uint8,
                                          device="cuda", generator=owner_gen)
                    write_rows(cache, own, fresh, resolved)
            entry[f"{impl}_replicas_differ_before_sync"] = not all(caches_equal_across_ranks(all_caches).values())
            with rows_cuda.kernels_enabled(True):
                deferred(impl)()
            torch.cuda.synchronize()
            entry[f"{impl}_replicas_equal_after_sync"] = all(caches_equal_across_ranks(all_caches).values())
        out["rows"][str(rows)] = entry
        log(f"sync microbench R={rows}: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                                     for k, v in entry.items()))
        del mla, idx
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------
# Rank entry point and reporting
# ---------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            env["nccl"] = None
    env["env"] = {k: os.environ.get(k) for k in SAFE_ENV}
    return env


def bench_rank(rank: int, world: int, cfg: BenchConfig) -> dict:
    """One rank of the benchmark (started by :func:`pcppass.engine.launch.launch`)."""
    import pcppass.kernels  # noqa: F401
    from pcppass.kernels import checks, rows_cuda

    _configure_dynamo()
    partial = Path(cfg.out) / f"bench_{cfg.tag}.partial.json"
    result: dict[str, Any] = {"environment": environment(), "config": asdict(cfg), "models": {}, "errors": []}

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def save() -> None:
        if rank == 0:
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(result, indent=1, default=str))

    with rows_cuda.kernels_enabled(cfg.sync_kernels == "device"), checks.value_checks(cfg.op_value_checks):
        if cfg.sync_microbench:
            try:
                result["sync_microbench"] = sync_microbench(rank, world, cfg, log)
            except Exception:
                result["errors"].append({"stage": "sync_microbench", "traceback": traceback.format_exc()[-3000:]})
                log(result["errors"][-1]["traceback"])
            save()
        for name in cfg.models:
            try:
                result["models"][name] = bench_model(rank, world, cfg, name, log)
            except Exception:
                result["errors"].append({"stage": name, "traceback": traceback.format_exc()[-3000:]})
                log(result["errors"][-1]["traceback"])
                torch._dynamo.reset()
                torch.cuda.empty_cache()
            save()
    return result


def _fmt(x: Any, spec: str = ".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "–"


def markdown(result: dict) -> str:
    env, cfg = result["environment"], result["config"]
    lines = [f"# pcppass bench: {env.get('device')} × {cfg['world']}", "",
             f"{env['date']} · torch {env['torch']} · triton {env.get('triton')} · NCCL {env.get('nccl')} · "
             f"CUDA {env.get('cuda')} · sync kernels: {cfg['sync_kernels']} · layers {cfg['layers']} · "
             f"hidden all-gather in sharded steps: {cfg['gather_hidden']}", ""]
    for name, m in result.get("models", {}).items():
        lines += [f"## {name} ({cfg['size']} width, {m['layers']} layers, {m['params'] / 1e9:.2f} B params)", ""]
        smoke = m.get("smoke", {})
        for v, s in smoke.items():
            lines.append(f"- smoke `{v}`: replicas bitwise equal across ranks = **{s['replicas_equal']}**"
                         + (f" (differing: {len(s['differing_caches'])} caches; {s.get('expected')})"
                            if s.get("differing_caches") else "")
                         + (f"; sync per step (collectives, bytes sent, bytes gathered) = {s['syncs_per_step'][-1]}"
                            if "syncs_per_step" in s else ""))
        lines.append(f"- compile + first step (s): {m.get('compile_s')}")
        lines.append("")
        lines.append("| N/rank | context | replicated ms | immediate ms | deferred ms | nosync ms | sync colls "
                     "(imm/def) | sync B/rank | deferred sync ms | bare all-gather µs | sync / bare | "
                     "speedup def | ideal | % of ideal |")
        lines.append("|" + "---|" * 14)
        for e in m.get("configs", []):
            v, d = e["variants"], e.get("derived", {})

            def ms(name):
                return _fmt(v.get(name, {}).get("slowest_rank_ms"))

            bare = e.get("bare_all_gather_sync_bytes", {})
            lines.append(
                f"| {e['rows_per_rank']} | {e['context']} | {ms('replicated')} | {ms('immediate')} | "
                f"{ms('deferred')} | {ms('nosync')} | {v.get('immediate', {}).get('sync_collectives', '–')}/"
                f"{v.get('deferred', {}).get('sync_collectives', '–')} | "
                f"{v.get('deferred', {}).get('sync_bytes_sent', '–')} | {_fmt(d.get('deferred_sync_ms'))} | "
                f"{_fmt(bare.get('eager_us'), '.1f')} | {_fmt(d.get('deferred_sync_vs_bare_all_gather'), '.1f')}× | "
                f"{_fmt(d.get('deferred_speedup'), '.3f')} | {_fmt(d.get('ideal_speedup'), '.3f')} | "
                f"{_fmt(100 * d['deferred_fraction_of_ideal'] if 'deferred_fraction_of_ideal' in d else None, '.1f')} |")
        graphs = [(e, vn, vd["cuda_graph"]) for e in m.get("configs", []) for vn, vd in e["variants"].items()
                  if "cuda_graph" in vd]
        if graphs:
            failed = [(e, vn, g) for e, vn, g in graphs if not g.get("captured")]
            lines += ["", "CUDA-graph replay (slowest rank's median):", "",
                      "| N/rank | context | replicated ms | immediate ms | deferred ms | nosync ms | deferred sync ms | "
                      "bare all-gather graph µs | sync / bare | speedup def | ideal | % of ideal |",
                      "|" + "---|" * 12]
            for e in m.get("configs", []):
                v, d = e["variants"], e.get("derived", {})

                def gms(name):
                    g = v.get(name, {}).get("cuda_graph", {})
                    return _fmt(g.get("slowest_rank_ms")) if g.get("captured") else "–"

                bare = e.get("bare_all_gather_sync_bytes", {})
                frac = d.get("graph_deferred_fraction_of_ideal")
                lines.append(
                    f"| {e['rows_per_rank']} | {e['context']} | {gms('replicated')} | {gms('immediate')} | "
                    f"{gms('deferred')} | {gms('nosync')} | {_fmt(d.get('graph_deferred_sync_ms'))} | "
                    f"{_fmt(bare.get('graph_us'), '.1f')} | {_fmt(d.get('graph_deferred_sync_vs_bare_all_gather'), '.1f')}× | "
                    f"{_fmt(d.get('graph_deferred_speedup'))} | {_fmt(d.get('graph_ideal_speedup'))} | "
                    f"{_fmt(100 * frac if frac is not None else None, '.1f')} |")
            for e, vn, g in failed:
                lines.append(f"- N={e['rows_per_rank']} C={e['context']} `{vn}`: not captured ({g['reason']})")
        lines.append("")
    micro = result.get("sync_microbench")
    if micro:
        lines += [f"## Sync cost: {micro['layers']} layers, DeepSeek-V3.2 rows (MLA {micro['mla_row_bytes']} B + "
                  f"indexer {micro['indexer_row_bytes']} B), real `pcppass::sync_*` ops, µs per step", "",
                  "per_cache = one scatter op per cache (torch kernels); batched = one pack launch + one "
                  "`sync_scatter_rows_all` launch per collective (Triton). graph = CUDA-graph replay.", "",
                  "| rows/rank | B/rank | per-site per_cache graph | deferred per_cache eager | deferred per_cache graph | "
                  "per-site batched graph | deferred batched eager | deferred batched graph | bare per-site graph | "
                  "bare single eager | bare single graph | deferred batched graph / bare graph | replicas equal |",
                  "|" + "---|" * 13]
        for r, e in micro["rows"].items():
            g, b = e.get("deferred_batched_graph_us"), e.get("bare_single_graph_us")
            ratio = g / b if isinstance(g, float) and isinstance(b, float) else None
            equal = all(e.get(f"{i}_replicas_equal_after_sync") and e.get(f"{i}_replicas_differ_before_sync")
                        for i in ("per_cache", "batched"))
            lines.append(
                f"| {r} | {e['bytes_per_rank_deferred']} | {_fmt(e.get('per_site_per_cache_graph_us'), '.0f')} | "
                f"{_fmt(e.get('deferred_per_cache_eager_us'), '.0f')} | {_fmt(e.get('deferred_per_cache_graph_us'), '.0f')} | "
                f"{_fmt(e.get('per_site_batched_graph_us'), '.0f')} | {_fmt(e.get('deferred_batched_eager_us'), '.0f')} | "
                f"{_fmt(g, '.1f')} | {_fmt(e.get('bare_per_site_graph_us'), '.0f')} | "
                f"{_fmt(e.get('bare_single_eager_us'), '.1f')} | {_fmt(b, '.1f')} | {_fmt(ratio, '.2f')}× | {equal} |")
        if any("deferred_reference_eager_us" in e for e in micro["rows"].values()):
            lines += ["", "| rows/rank | per-site ref+checks | deferred ref+checks | per-site ref | deferred ref |",
                      "|" + "---|" * 5]
            for r, e in micro["rows"].items():
                lines.append(f"| {r} | " + " | ".join(_fmt(e.get(f"{k}_eager_us"), ".0f") for k in (
                    "per_site_reference_checked", "deferred_reference_checked", "per_site_reference",
                    "deferred_reference")) + " |")
        lines.append("")
    for err in result.get("errors", []):
        lines += [f"### error in {err['stage']}", "", "```", err["traceback"][-1500:], "```", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = [m for m in result.get("models", {}).values() if m.get("configs")]
    if not models:
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        labels = [f"N={e['rows_per_rank']}\nC={e['context'] // 1024}k" for e in m["configs"]]
        names = [v for v in VARIANTS if any(v in e["variants"] for e in m["configs"])]
        width = 0.8 / max(1, len(names))
        for i, v in enumerate(names):
            vals = [e["variants"].get(v, {}).get("slowest_rank_ms", 0) for e in m["configs"]]
            ax.bar([x + i * width for x in range(len(labels))], vals, width, label=v)
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(labels))], labels)
        ax.set_ylabel("decode step, ms (slowest rank)")
        ax.set_title(f"{m['model']} ({m['layers']} layers)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple]:
    return lambda text: tuple(kind(x) for x in text.split(",") if x)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="time a decode step replicated vs decode-sharded on P GPUs",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="deepseek_v32", type=_csv(str),
                   help="comma-separated built-in models (llama, deepseek_v2, deepseek_v32, deepseek_v4)")
    p.add_argument("--size", default="full", choices=("tiny", "full"))
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the built model")
    p.add_argument("--world", type=int, default=2, help="GPUs / PCP ranks (local processes)")
    p.add_argument("--rows-per-rank", default=(32,), type=_csv(int), help="decode rows per rank, comma-separated")
    p.add_argument("--context", default=(4096,), type=_csv(int), help="cached positions per request, comma-separated")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, type=_csv(str), help=f"subset of {','.join(VARIANTS)}")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--smoke-steps", type=int, default=3, help="sharded steps before the replica comparison")
    p.add_argument("--sync-kernels", default="device", choices=("device", "reference"),
                   help="device: the host-sync-free CUDA kernels of pcppass.kernels.rows_cuda; reference: plain ops")
    p.add_argument("--no-gather-hidden", dest="gather_hidden", action="store_false",
                   help="do not all-gather the final hidden rows in sharded steps")
    p.add_argument("--cuda-graph", action="store_true", help="also capture each step in a CUDA graph and replay it")
    p.add_argument("--sync-microbench", action="store_true",
                   help="add the 61-layer sync-cost microbenchmark through the real pcppass::sync_* ops")
    p.add_argument("--micro-rows", default=(8, 32, 128), type=_csv(int))
    p.add_argument("--micro-layers", type=int, default=61)
    p.add_argument("--micro-reference", action="store_true",
                   help="also time the reference (plain-torch, host-reading) sync ops in the microbenchmark")
    p.add_argument("--op-value-checks", action="store_true",
                   help="keep the cache-write ops' value checks on (they read the device on the host)")
    p.add_argument("--out", default="bench/results", help="directory for the JSON and markdown results")
    p.add_argument("--tag", default="", help="file name tag (default: device, world and date)")
    p.add_argument("--timeout", type=float, default=580.0, help="seconds for the whole multi-GPU run")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from pcppass.engine.launch import launch

    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"pcppass bench: unknown variant(s) {bad}; choose from {VARIANTS}")
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.world:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise SystemExit(f"pcppass bench: needs {args.world} CUDA GPUs, found {found}")
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    tag = args.tag or "{}_P{}_{}".format(torch.cuda.get_device_name(0).replace(" ", "-"), args.world,
                                         datetime.date.today().isoformat())
    cfg = BenchConfig(
        models=args.model, size=args.size, world=args.world, rows_per_rank=args.rows_per_rank,
        contexts=args.context, layers=args.layers, variants=args.variants, warmup=args.warmup, reps=args.reps,
        smoke_steps=args.smoke_steps, sync_kernels=args.sync_kernels, gather_hidden=args.gather_hidden,
        cuda_graph=args.cuda_graph, sync_microbench=args.sync_microbench, micro_layers=args.micro_layers,
        micro_rows=args.micro_rows, micro_reference=args.micro_reference, op_value_checks=args.op_value_checks,
        out=args.out, tag=tag, timeout_s=args.timeout,
    )
    results = launch(bench_rank, cfg.world, cfg, backend="nccl", timeout_s=cfg.timeout_s)
    result = results[0]
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_{tag}.json").write_text(json.dumps(result, indent=1, default=str))
    text = markdown(result)
    (out / f"bench_{tag}.md").write_text(text)
    if plot(result, out / f"bench_{tag}.png"):
        text += f"\n(plot: {out / f'bench_{tag}.png'})\n"
    partial = out / f"bench_{tag}.partial.json"
    if partial.exists():
        partial.unlink()
    print(text)
    return 1 if result.get("errors") else 0
