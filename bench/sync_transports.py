"""Replica-sync transports side by side on P GPUs, under CUDA-graph replay.

    python bench/sync_transports.py --world 2 --rows 8,32,128 --out bench/results --tag h200x2

61 layers of DeepSeek-V3.2 rows (MLA fp8_ds_mla 656 B + indexer 132 B per token and layer), R rows
per rank (one of them padding, slot -1), in the same processes and on the same caches (allocated
in symmetric memory, so both transports can run on them), each sync captured in a CUDA graph and
timed by replaying it (median per rank; the table shows the slowest rank's median):

* ``per_site``: one sync per layer (its two caches): pack + all-gather + checked scatter;
* ``allgather``: the deferred sync, ONE pack + all-gather + checked scatter for all 122 caches;
  ``allgather_nochecks``: header and two-owner checks off;
* ``peer``: ONE peer-store launch (rows into every peer's replica, epoch barrier, checks);
  ``peer_nochecks``: checks off;
* ``bare``: one NCCL all-gather of the all-gather transport's bytes (the collective alone);
* ``floor``: bytes each rank receives (the other ranks' rows) / 450 GB/s (NVLink, one direction).

``--baseline JSON`` adds the deferred sync of an earlier build, measured by its own
``pcppass bench --sync-microbench`` in the same session (``deferred_batched_graph_us``).

Correctness, per row count, after graph replays (never only eager): each rank writes fresh bytes
into its own rows, replays the sync's graph, then every cache must be bitwise equal on all ranks,
the peer-store result must equal the all-gather result byte for byte, and the device status must be
clean. ``kernels`` times ``sync_pack`` and the checked scatter alone (graph replay) and reports
the bytes they move (read + written) per second against a device-to-device copy in the same run.

``--models llama,deepseek_v32`` adds 2-layer full-width decode steps through the backend with each
transport (see :func:`decode_steps`).

Writes ``<out>/sync_transports_<tag>.json`` (device, versions, date, configuration, every rank's
numbers), ``.md`` (tables) and ``.png`` (plot).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from pcppass.runtime.collectives import all_gather_single

MLA_ROW = 656
INDEXER_VALUES, INDEXER_SCALES = 128, 4
BLOCK = 64
NVLINK_BYTES_PER_S = 450e9
FP = "5eed" * 8


@dataclass(frozen=True)
class Config:
    world: int = 2
    layers: int = 61
    rows: tuple[int, ...] = (8, 32, 128)
    kernel_rows: tuple[int, ...] = (128, 2048)
    reps: int = 200
    trials: int = 3
    models: tuple[str, ...] = ()
    contexts: tuple[int, ...] = (4096,)
    model_rows: tuple[int, ...] = (8, 32)
    out: str = "bench/results"
    tag: str = "local"
    baseline: str = ""
    timeout_s: float = 560.0


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _every_rank(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def graph_us(fn: Callable[[], Any], reps: int) -> dict[str, Any]:
    """Capture ``fn`` (warmed up already) in a CUDA graph; median µs of its replays, every rank's."""
    from pcppass.bench.timing import time_graph

    ms, status = time_graph(fn, 10, reps)
    if ms is None:
        raise RuntimeError(f"could not capture: {status}")
    medians = _every_rank(statistics.median(ms) * 1000)
    return {"rank_us": medians, "us": max(medians)}


def captured(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + written), the HBM ceiling of this run."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    return 2 * nbytes / statistics.median(times)


# ---------------------------------------------------------------------------------------------
# The 61-layer sync
# ---------------------------------------------------------------------------------------------


class Layers:
    """``layers`` MLA and indexer caches in symmetric memory, identical on every rank, and this
    rank's ``rows`` slots (the last one padding)."""

    def __init__(self, layers: int, rows: int, rank: int, world: int):
        from pcppass.sync.rows import encode_layout
        from pcppass.sync.peer import symmetric_empty
        from pcppass.spec import ResolvedLayout

        nb = 2 + world * rows
        gen = torch.Generator(device="cuda")
        gen.manual_seed(7)
        self.mla = [symmetric_empty((nb, BLOCK, MLA_ROW), torch.uint8, "cuda") for _ in range(layers)]
        self.idx = [symmetric_empty((nb, BLOCK * (INDEXER_VALUES + INDEXER_SCALES)), torch.uint8, "cuda")
                    for _ in range(layers)]
        for c in (*self.mla, *self.idx):
            c.copy_(torch.randint(0, 256, c.shape, dtype=torch.uint8, device="cuda", generator=gen))
        self.mla_layout = ResolvedLayout("paged_rows", BLOCK, MLA_ROW)
        self.idx_layout = ResolvedLayout("block_split", BLOCK, INDEXER_VALUES + INDEXER_SCALES,
                                         segments=((0, INDEXER_VALUES, INDEXER_VALUES),
                                                   (BLOCK * INDEXER_VALUES, INDEXER_SCALES, INDEXER_SCALES)))
        self.encoded = encode_layout(self.mla_layout) + encode_layout(self.idx_layout)
        # rank r owns blocks 1 + r*rows + i; one padding row per rank (slot -1)
        self.slots = (1 + rank * rows + torch.arange(rows, device="cuda")) * BLOCK + 3
        self.slots[-1] = -1
        self.idx_slots = self.slots.clone()
        self.rank, self.world, self.rows = rank, world, rows

    def caches(self, layers: range | None = None) -> list[torch.Tensor]:
        layers = layers if layers is not None else range(len(self.mla))
        return [c for i in layers for c in (self.mla[i], self.idx[i])]

    def sync_args(self, layers: range | None = None) -> tuple:
        caches = self.caches(layers)
        n = len(caches)
        cache_slots = [self.slots if i % 2 == 0 else self.idx_slots for i in range(n)]
        layouts = self.encoded * (n // 2)
        sites = "\n".join(f"layer {i // 2} {'mla' if i % 2 == 0 else 'indexer'}" for i in range(n))
        return caches, cache_slots, layouts, [self.slots, self.idx_slots], [n + i % 2 for i in range(n)], sites

    def write_own_rows(self, seed: int) -> None:
        """Fresh bytes in this rank's rows (different on every rank), as an owner's op writes."""
        from pcppass.sync.rows import write_rows

        own = self.slots[self.slots >= 0]
        gen = torch.Generator(device="cuda")
        gen.manual_seed(seed * 1000 + self.rank)
        for cache in self.caches():
            lay = self.mla_layout if cache.dim() == 3 else self.idx_layout
            write_rows(cache, own, torch.randint(0, 256, (own.numel(), lay.bytes_per_row), dtype=torch.uint8,
                                                 device="cuda", generator=gen), lay)

    def digest(self) -> str:
        h = hashlib.sha256()
        for c in self.caches():
            h.update(c.cpu().numpy().tobytes())
        return h.hexdigest()


def allgather_sync(layers: Layers, group: str, checks: bool, which: range | None = None) -> Callable[[], None]:
    ops = torch.ops.pcppass
    caches, cache_slots, layouts, payloads, slots_segments, sites = layers.sync_args(which)
    n, world = len(caches), layers.world

    def run() -> None:
        packed = ops.sync_pack(FP, caches, cache_slots, layouts, payloads)
        gathered = packed.new_empty(packed.numel() * world)
        all_gather_single(gathered, packed)
        index = ops.sync_read_header(gathered, world, FP, n + len(payloads), checks)
        ops.sync_scatter_rows_all(caches, gathered, index, list(range(n)), slots_segments, layouts, group, sites,
                                  checks)
    return run


def peer_sync(layers: Layers, group: str, checks: bool) -> Callable[[], None]:
    ops = torch.ops.pcppass
    caches, cache_slots, layouts, payloads, slots_segments, sites = layers.sync_args()

    def run() -> None:
        ops.sync_peer_store(FP, caches, cache_slots, layouts, payloads, slots_segments, group, sites, checks,
                            checks, False)
    return run


def check_replicas(layers: Layers, graph: torch.cuda.CUDAGraph, seed: int) -> tuple[bool, str]:
    """Fresh own rows, one replay, then: every cache equal on every rank, device status clean."""
    from pcppass.bench.inputs import caches_equal_across_ranks
    from pcppass.sync import device_checks

    layers.write_own_rows(seed)
    graph.replay()
    torch.cuda.synchronize()
    equal = caches_equal_across_ranks({str(i): c for i, c in enumerate(layers.caches())})
    error = device_checks.pending("cuda")
    digest = layers.digest() if error is None else str(error)
    # a peer's next sync stores into this rank's replica: everyone reads this step's state first
    dist.barrier()
    return all(equal.values()) and error is None, digest


def sync_rank(rank: int, world: int, cfg: Config) -> dict:
    import pcppass.sync.peer_store  # noqa: F401  (registers pcppass::sync_peer_store)
    import pcppass.sync.rows_cuda  # noqa: F401  (registers the CUDA sync kernels)
    from pcppass.bench.environment import environment

    group = dist.group.WORLD.group_name
    out: dict[str, Any] = {"environment": environment(), "config": asdict(cfg), "rows": {}, "kernels": {}}
    out["copy_bytes_per_s"] = copy_bandwidth()
    for rows in cfg.rows:
        layers = Layers(cfg.layers, rows, rank, world)
        variants = {
            "per_site": _per_site(layers, group),
            "allgather": allgather_sync(layers, group, True),
            "allgather_nochecks": allgather_sync(layers, group, False),
            "peer": peer_sync(layers, group, True),
            "peer_nochecks": peer_sync(layers, group, False),
        }
        entry: dict[str, Any] = {"variants": {}, "correct": {}}
        digests: dict[str, list[str]] = {}
        for name, fn in variants.items():
            fn()
            fn()
            torch.cuda.synchronize()
            entry["variants"][name] = graph_us(fn, cfg.reps)
            graph = captured(fn)
            results = [check_replicas(layers, graph, seed) for seed in range(1, cfg.trials + 1)]
            entry["correct"][name] = all(ok for ok, _ in results)
            digests[name] = [d for _, d in results]
            del graph
        # the same fresh rows give the same bytes whatever the transport
        entry["same_bytes_as_allgather"] = {name: d == digests["allgather"] for name, d in digests.items()}
        caches, cache_slots, layouts, payloads = layers.sync_args()[:4]
        packed = torch.ops.pcppass.sync_pack(FP, caches, cache_slots, layouts, payloads)
        entry["bytes_per_rank"] = packed.numel()
        entry["row_bytes_per_rank"] = (rows - 1) * cfg.layers * (MLA_ROW + INDEXER_VALUES + INDEXER_SCALES)
        bare = torch.randint(0, 255, (packed.numel(),), dtype=torch.uint8, device="cuda")
        bare_out = torch.empty(packed.numel() * world, dtype=torch.uint8, device="cuda")
        entry["variants"]["bare"] = graph_us(lambda: all_gather_single(bare_out, bare), cfg.reps)
        entry["floor_us"] = (world - 1) * rows * cfg.layers * (MLA_ROW + INDEXER_VALUES + INDEXER_SCALES) \
            / NVLINK_BYTES_PER_S * 1e6
        out["rows"][str(rows)] = entry
        if rank == 0:
            print(f"[sync {time.strftime('%H:%M:%S')}] R={rows}: " + ", ".join(
                f"{k}={v['us']:.1f}" for k, v in entry["variants"].items()) + f" correct={entry['correct']}",
                flush=True)
        del layers, variants
        torch.cuda.empty_cache()
    for rows in cfg.kernel_rows:
        out["kernels"][str(rows)] = _kernel_rates(rows, rank, world, cfg, group)
    if cfg.models:
        out["models"] = decode_steps(rank, world, cfg)
    return out


def _per_site(layers: Layers, group: str) -> Callable[[], None]:
    syncs = [allgather_sync(layers, group, True, range(i, i + 1)) for i in range(len(layers.mla))]

    def run() -> None:
        for sync in syncs:
            sync()
    return run


def _kernel_rates(rows: int, rank: int, world: int, cfg: Config, group: str) -> dict:
    """``sync_pack`` and the checked scatter alone: bytes read + written per second."""
    ops = torch.ops.pcppass
    layers = Layers(cfg.layers, rows, rank, world)
    caches, cache_slots, layouts, payloads, slots_segments, sites = layers.sync_args()
    n = len(caches)
    packed = ops.sync_pack(FP, caches, cache_slots, layouts, payloads)
    gathered = packed.new_empty(packed.numel() * world)
    all_gather_single(gathered, packed)
    index = ops.sync_read_header(gathered, world, FP, n + len(payloads), True)

    def scatter() -> None:
        ops.sync_scatter_rows_all(caches, gathered, index, list(range(n)), slots_segments, layouts, group, sites,
                                  True)

    def pack() -> None:
        ops.sync_pack(FP, caches, cache_slots, layouts, payloads)

    row_bytes = (rows - 1) * cfg.layers * (MLA_ROW + INDEXER_VALUES + INDEXER_SCALES)
    moved = {"pack": row_bytes + packed.numel(), "scatter": 2 * (world - 1) * row_bytes}
    res = {"rows": rows, "bytes_moved": moved}
    for name, fn in (("pack", pack), ("scatter", scatter)):
        fn()
        torch.cuda.synchronize()
        t = graph_us(fn, cfg.reps)
        res[name] = {**t, "bytes_per_s": moved[name] / (t["us"] * 1e-6)}
    del layers
    torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------
# Decode steps through the backend, each transport
# ---------------------------------------------------------------------------------------------


def decode_steps(rank: int, world: int, cfg: Config) -> dict:
    """2-layer full-width decode steps (``pcppass.bench.inputs.DecodeSetup``) through the backend,
    caches copied into symmetric memory: the backend picks peer stores there; the all-gather
    transport is forced with ``PcpBackend(transport="allgather")``. Each step captured in a CUDA
    graph; ``nosync`` (no sync at all) is the lower bound."""
    from pcppass import PcpBackend, SyncChecks
    from pcppass.bench.inputs import DecodeSetup, caches_equal_across_ranks, owned
    from pcppass.models import build_model
    from pcppass.sync import device_checks
    from pcppass.sync.peer import symmetric_empty

    results: dict[str, Any] = {}
    for name in cfg.models:
        torch._dynamo.reset()
        model = build_model(name, "full", dtype=torch.bfloat16, device="cuda", num_layers=2)
        requests = max(cfg.model_rows) * world
        setup = DecodeSetup(model, requests, max(cfg.contexts), 16, seed=1234)
        for key, cache in list(setup.caches.items()):
            sym = symmetric_empty(cache.shape, cache.dtype, "cuda")
            sym.copy_(cache)
            setup.caches[key] = sym
        del cache
        torch.cuda.empty_cache()
        nochecks = SyncChecks(inputs=False, header=False, slot_conflicts=False)
        variants = {
            "nosync": None,
            "allgather": PcpBackend(inner="inductor", transport="allgather", name=f"{name}-ag"),
            "peer": PcpBackend(inner="inductor", name=f"{name}-peer"),
            "peer_nochecks": PcpBackend(inner="inductor", checks=nochecks, name=f"{name}-peern"),
        }
        plain = torch.compile(model, fullgraph=True)
        entry: dict[str, Any] = {"configs": [], "transports": {}}
        position = max(cfg.contexts)
        for variant, backend in variants.items():
            fn = plain if backend is None else torch.compile(model, backend=backend, fullgraph=True)
            for n in cfg.model_rows:
                for c in cfg.contexts:
                    reqs = owned(n * world, world, rank, 0)
                    ids, positions, meta = setup.step(reqs, c, c)
                    step = lambda: fn(ids, positions, meta, setup.caches)  # noqa: E731
                    step()
                    torch.cuda.synchronize()
                    t = graph_us(step, 50)
                    entry["configs"].append({"variant": variant, "rows_per_rank": n, "context": c, **t})
            if backend is not None:
                entry["transports"][variant] = [getattr(r, "transport", None) for r in backend.reports]
                # correctness after a replay: new positions, owners rotated, replicas equal
                reqs = owned(cfg.model_rows[0] * world, world, rank, 1)
                ids, positions, meta = setup.step(reqs, max(cfg.contexts), position)
                position += 1
                graph = captured(lambda: fn(ids, positions, meta, setup.caches))
                graph.replay()
                torch.cuda.synchronize()
                equal = caches_equal_across_ranks(setup.caches)
                entry.setdefault("replicas_equal_after_replay", {})[variant] = all(equal.values())
                error = device_checks.pending("cuda")
                entry.setdefault("device_status", {})[variant] = str(error) if error else "clean"
                del graph
        results[name] = entry
        del model, setup, plain
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return results


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def markdown(result: dict, baseline: dict | None) -> str:
    env, cfg = result["environment"], result["config"]
    lines = [f"# Replica-sync transports: {env.get('device')} × {cfg['world']}", "",
             f"{env['date']} · torch {env['torch']} · triton {env.get('triton')} · NCCL {env.get('nccl')} · "
             f"CUDA {env.get('cuda')} · {cfg['layers']} layers of DeepSeek-V3.2 rows (656 + 132 B) · "
             "µs per sync, CUDA-graph replay, slowest rank's median", ""]
    base = (baseline or {}).get("sync_microbench", {}).get("rows", {})
    lines += ["| rows/rank | B/rank | per-site | deferred all-gather (main) | all-gather | all-gather, checks off | "
              "peer stores | peer stores, checks off | bare all-gather | wire floor | all-gather / bare | "
              "peer / floor | replicas equal after replays | peer bytes = all-gather bytes |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rows, e in result["rows"].items():
        v = {k: x["us"] for k, x in e["variants"].items()}
        old = base.get(rows, {}).get("deferred_batched_graph_us")
        lines.append(
            f"| {rows} | {e['bytes_per_rank']:,} | {v['per_site']:.0f} | {_num(old)} | **{v['allgather']:.1f}** | "
            f"{v['allgather_nochecks']:.1f} | **{v['peer']:.1f}** | {v['peer_nochecks']:.1f} | {v['bare']:.1f} | "
            f"{e['floor_us']:.1f} | {v['allgather'] / v['bare']:.2f}× | {v['peer'] / e['floor_us']:.1f}× | "
            f"{all(e['correct'].values())} | {all(e['same_bytes_as_allgather'].values())} |")
    lines += ["", f"Device-to-device copy in this run: {result['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + written).",
              "", "| kernel | rows/rank | bytes moved | µs (graph replay) | GB/s | % of copy bandwidth |",
              "|---|---|---|---|---|---|"]
    for rows, k in result["kernels"].items():
        for name in ("pack", "scatter"):
            rate = k[name]["bytes_per_s"]
            lines.append(f"| {name} | {rows} | {k['bytes_moved'][name]:,} | {k[name]['us']:.1f} | {rate / 1e9:.0f} | "
                         f"{100 * rate / result['copy_bytes_per_s']:.0f}% |")
    for name, m in result.get("models", {}).items():
        lines += ["", f"## {name}: 2-layer full-width decode step, ms (CUDA-graph replay, slowest rank)", "",
                  f"transports chosen: {m['transports']}; replicas equal after a replay: "
                  f"{m.get('replicas_equal_after_replay')}; device status: {m.get('device_status')}", "",
                  "| rows/rank | context | " + " | ".join(sorted({c['variant'] for c in m['configs']})) + " |",
                  "|---|---|" + "---|" * len({c['variant'] for c in m['configs']})]
        names = sorted({c['variant'] for c in m['configs']})
        for key in sorted({(c["rows_per_rank"], c["context"]) for c in m["configs"]}):
            by = {c["variant"]: c["us"] / 1000 for c in m["configs"] if (c["rows_per_rank"], c["context"]) == key}
            lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(f"{by.get(v, float('nan')):.3f}" for v in names) + " |")
    return "\n".join(lines) + "\n"


def _num(x: Any) -> str:
    return f"{x:.1f}" if isinstance(x, (int, float)) else "–"


def plot(result: dict, baseline: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(result["rows"])
    base = (baseline or {}).get("sync_microbench", {}).get("rows", {})
    series = {
        "deferred all-gather (main)": [base.get(r, {}).get("deferred_batched_graph_us", 0) or 0 for r in rows],
        "all-gather (improved)": [result["rows"][r]["variants"]["allgather"]["us"] for r in rows],
        "peer stores": [result["rows"][r]["variants"]["peer"]["us"] for r in rows],
        "bare all-gather": [result["rows"][r]["variants"]["bare"]["us"] for r in rows],
        "wire floor": [result["rows"][r]["floor_us"] for r in rows],
    }
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(rows))], vals, width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(rows))], [f"{r} rows/rank" for r in rows])
    ax.set_ylabel("µs per sync (CUDA-graph replay)")
    ax.set_title(f"61-layer DeepSeek-V3.2 sync, P={result['config']['world']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--rows", type=ints, default=(8, 32, 128))
    parser.add_argument("--kernel-rows", type=ints, default=(128, 2048))
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--models", type=lambda s: tuple(x for x in s.split(",") if x), default=())
    parser.add_argument("--contexts", type=ints, default=(4096,))
    parser.add_argument("--model-rows", type=ints, default=(8, 32))
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="local")
    parser.add_argument("--baseline", default="", help="JSON of an earlier build's pcppass bench --sync-microbench")
    parser.add_argument("--timeout", type=float, default=560.0)
    args = parser.parse_args()
    cfg = Config(world=args.world, layers=args.layers, rows=args.rows, kernel_rows=args.kernel_rows, reps=args.reps,
                 models=args.models, contexts=args.contexts, model_rows=args.model_rows, out=args.out, tag=args.tag,
                 baseline=args.baseline, timeout_s=args.timeout)
    from pcppass.bench.environment import SAFE_ENV
    from pcppass.engine.launch import launch

    os.environ.update(SAFE_ENV)
    ranks = launch(sync_rank, cfg.world, cfg, timeout_s=cfg.timeout_s)
    result = ranks[0]
    baseline = json.loads(Path(cfg.baseline).read_text()) if cfg.baseline else None
    if baseline:
        result["baseline"] = {"environment": baseline.get("environment"),
                              "sync_microbench": baseline.get("sync_microbench")}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"sync_transports_{cfg.tag}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    text = markdown(result, baseline)
    stem.with_suffix(".md").write_text(text)
    try:
        plot(result, baseline, stem.with_suffix(".png"))
    except ImportError:
        pass
    print(text)


if __name__ == "__main__":
    main()
