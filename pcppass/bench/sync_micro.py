"""Sync-cost microbenchmark: the sync part of a deep DeepSeek-V3.2-shaped step alone, through the real
``pcppass::sync_*`` ops, per write site vs one packed collective, against bare all-gathers of the
same bytes (``pcppass bench --sync-microbench``; results in the "Replica sync" section of
docs/BENCH.md).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch
import torch.distributed as dist

from pcppass.bench.inputs import caches_equal_across_ranks
from pcppass.bench.step_config import StepBenchConfig
from pcppass.bench.timing import across_ranks, bare_all_gather_us, time_graph, time_steps
from pcppass.runtime.collectives import all_gather_single

MLA_ROW = 656  # fp8_ds_mla: 512 e4m3 + 4 fp32 tile scales + 64 bf16
INDEXER_VALUES, INDEXER_SCALES = 128, 4
MICRO_BLOCK = 64


def sync_microbench(rank: int, world: int, cfg: StepBenchConfig, log: Callable[[str], None]) -> dict:
    """The sync part of a ``micro_layers``-layer step, three ways, each per site and deferred:

    * ``reference``: the plain-torch ``pcppass::sync_*`` ops (host reads; ``--micro-reference``);
    * ``per_cache``: the host-read-free torch kernels of :mod:`pcppass.sync.rows_cuda`, one
      scatter per cache (what the rewrite emitted before ``sync_scatter_rows_all``);
    * ``batched``: the ops as the rewrite emits them now: ``sync_pack`` (one Triton launch for all
      caches), ``sync_read_header``, ONE ``sync_scatter_rows_all`` (one Triton launch).
    """
    from pcppass.sync import rows_cuda
    from pcppass.sync.rows import decode_layouts, encode_layout, write_rows
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
        all_gather_single(gathered, packed)
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
                all_gather_single(site_out, site_buf)

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
                entry[f"{label}_eager_us"] = statistics.median(across_ranks(statistics.median(ms))) * 1000
                if device_kernels:
                    gms, status = time_graph(fn, 3, cfg.reps * 5)
                    entry[f"{label}_graph_us"] = (statistics.median(across_ranks(statistics.median(gms))) * 1000
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
