"""GPU timing: CUDA events around calls issued back to back, CUDA-graph replays, medians.

Every figure the benches publish comes from here: warm-up first, then ``reps`` calls each between
two events, the median per rank; across ranks the slowest rank's median (a sharded step ends with
its slowest rank).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch
import torch.distributed as dist

from pcppass.runtime.collectives import all_gather_single


def summary(ms: list[float]) -> dict[str, float]:
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


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph | None, str]:
    """``fn`` (already warmed up) captured in a CUDA graph, or None and why it could not be."""
    graph = torch.cuda.CUDAGraph()
    try:
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # a step that reads the device on the host cannot be captured
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    return graph, "captured"


def time_graph(fn: Callable[[], Any], warmup: int, reps: int) -> tuple[list[float] | None, str]:
    """Capture ``fn`` in a CUDA graph and time its replays."""
    graph, status = capture(fn)
    if graph is None:
        return None, status
    return time_steps(graph.replay, warmup, reps), status


def graph_median_us(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median µs of ``fn``'s CUDA-graph replays after one eager call (which compiles it); raises if
    it cannot be captured."""
    fn()
    torch.cuda.synchronize()
    ms, status = time_graph(fn, warmup, reps)
    if ms is None:
        raise RuntimeError(status)
    return statistics.median(ms) * 1000


def across_ranks(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def timed(ms_this_rank: list[float], mode: str) -> dict[str, Any]:
    """Median over this rank's reps, plus every rank's median (the step ends with the slowest)."""
    mine = summary(ms_this_rank)
    medians = across_ranks(mine["median_ms"])
    return {**mine, "mode": mode, "rank_medians_ms": medians, "slowest_rank_ms": max(medians)}


def bare_all_gather_us(nbytes: int, reps: int = 200, graph: bool = True) -> dict[str, float]:
    """One all-gather of ``nbytes`` per rank: eager and CUDA-graph replay, µs per call."""
    buf = torch.randint(0, 255, (max(nbytes, 1),), dtype=torch.uint8, device="cuda")
    out = torch.empty(buf.numel() * dist.get_world_size(), dtype=torch.uint8, device="cuda")

    def gather():
        all_gather_single(out, buf)

    res = {"bytes_per_rank": nbytes,
           "eager_us": statistics.median(time_steps(gather, 10, reps)) * 1000}
    if graph:
        ms, _ = time_graph(gather, 10, reps)
        if ms is not None:
            res["graph_us"] = statistics.median(ms) * 1000
    return res
