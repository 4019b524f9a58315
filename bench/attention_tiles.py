"""Launch shapes of the paged attention kernels side by side on one GPU.

    python bench/attention_tiles.py --rows 32,64 --context 16384,32768 --out bench/results --tag h200
        [--v32 indexer,sparse_mla,topk_select] [--dense gqa_bf16,gqa_fp8,mla_bf16,mla_fp8_ds_mla]

For each decode shape of :func:`pcppass.bench.kernels.v32_cases` (the same inputs, several input
sets so the caches come from HBM), every :class:`~pcppass.kernels.attention.launch.IndexerTiles`
and :class:`~pcppass.kernels.attention.launch.MlaTiles` of the grid below is timed from CUDA-graph
replays (median), beside the launchers' defaults. Before it is timed, each shape's output is
compared with the default's on the same inputs (indexer: max relative error of the visible scores;
sparse MLA: max relative error), so a fast shape that computes something else shows as such.
The indexer runs on DeepSeek-V3.2's e4m3 query (one scale per head, folded into the weights).

Writes ``<out>/attention_tiles_<tag>.json`` (device, versions, date, configuration, every shape's
time and error) and ``.md`` (per kernel and decode shape: the default and the five fastest).
``--dense gqa_bf16,gqa_fp8,mla_bf16,mla_fp8_ds_mla`` adds Llama's GQA (bf16 and fp8 K/V) and
DeepSeek-V2's dense MLA (bf16 and fp8_ds_mla) over the grids of :func:`gqa_grid` and
:func:`dense_mla_grid`.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from dataclasses import asdict

import torch

from pcppass.bench.environment import environment
from pcppass.bench.kernels import DATASHEET_HBM, V32, V32Inputs, input_sets, v32_input_set
from pcppass.bench.results import write
from pcppass.bench.timing import time_graph
from pcppass.kernels.attention.select import SELECT_TILES, SelectTiles, select_topk_triton
from pcppass.kernels.attention.launch import (
    INDEXER_TILES,
    SPARSE_MLA_TILES,
    GqaTiles,
    IndexerTiles,
    MlaTiles,
    gqa_tiles,
    mla_tiles,
)

DIM, TOPK = V32.dim, V32.topk
KERNELS = ("indexer", "sparse_mla", "topk_select", "topk_parts", "gqa_bf16", "gqa_fp8", "mla_bf16", "mla_fp8_ds_mla")


def indexer_grid() -> list[IndexerTiles]:
    shapes = [IndexerTiles(bn=bn, chunk=chunk, warps=4, stages=stages, table_in_registers=regs)
              for bn, chunk, stages, regs in itertools.product((128, 256), (1024, 2048), (2, 3), (False, True))]
    return [INDEXER_TILES] + [s for s in shapes if s != INDEXER_TILES]


def mla_grid() -> list[MlaTiles]:
    shapes = [MlaTiles(heads=64, bn=32, warps=8, stages=stages, sparse_split=split, dequant_tile=dequant)
              for stages, split, dequant in itertools.product((2, 3, 4), (256, 512, 1024), (False, True))]
    return [SPARSE_MLA_TILES] + [s for s in shapes if s != SPARSE_MLA_TILES]


def v32_inputs(rows: int, context: int) -> list[V32Inputs]:
    """``input_sets`` sets of the V3.2 kernels' inputs (those of :func:`pcppass.bench.kernels.v32_cases`)."""
    return [v32_input_set(rows, context, s) for s in range(input_sets(rows * min(TOPK, context) * V32.latent_row_bytes))]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    got, want = got[finite].float(), want[finite].float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def time_calls(calls, reps: int) -> float | str:
    def replay_all():
        for call in calls:
            call()

    try:
        replay_all()
        torch.cuda.synchronize()
        ms, status = time_graph(replay_all, 2, reps)
    except Exception as exc:  # a shape the compiler rejects (shared memory, registers) is reported
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    return statistics.median(ms) * 1000 / len(calls) if ms is not None else status


def sweep(grid: list, run, sets: list, reps: int) -> list[dict]:
    """Every launch shape of ``grid``: its output on the first input set against the first
    shape's (the launcher's default), then its time over all sets; ``run(tiles, inputs)``."""
    want = run(grid[0], sets[0])
    results = []
    for tiles in grid:
        try:
            err = rel_err(run(tiles, sets[0]), want)
        except Exception as exc:
            results.append({"tiles": asdict(tiles), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            continue
        us = time_calls([lambda s=s: run(tiles, s) for s in sets], reps)
        results.append({"tiles": asdict(tiles), "rel_err": err, **({"us": us} if isinstance(us, float) else
                                                                   {"error": us})})
    return results


def run_indexer(tiles: IndexerTiles, s: V32Inputs) -> torch.Tensor:
    from pcppass.kernels.attention.launch import indexer_scores

    return indexer_scores(s.q, s.w, s.icache, s.step, DIM, tiles)


def run_sparse_mla(tiles: MlaTiles, s: V32Inputs) -> torch.Tensor:
    from pcppass.kernels.attention.launch import mla_attention

    return mla_attention(s.q_lat, s.q_pe, s.mcache, s.step, 0.07, True, s.picked, tiles=tiles)


def select_grid() -> list[SelectTiles]:
    shapes = [SelectTiles(chunk=chunk, warps=warps, sample=sample)
              for chunk, warps, sample in itertools.product((1024, 2048, 4096), (4, 8, 16), (1024, 2048, 4096))]
    return [SELECT_TILES] + [s for s in shapes if s != SELECT_TILES]


def select_parts_grid() -> list[SelectTiles]:
    """The top-k with a row's candidates found by parts (calls of few rows): part length,
    candidate chunk, warps and sample."""
    shapes = [SelectTiles(warps=warps, sample=sample, candidate_chunk=cand, part=part)
              for part, cand, warps, sample in itertools.product((2048, 4096, 8192), (1024, 2048, 4096), (4, 8),
                                                                 (1024, 2048))]
    return [SELECT_TILES] + [s for s in shapes if s != SELECT_TILES]


def run_select(tiles: SelectTiles, s: V32Inputs) -> torch.Tensor:
    return select_topk_triton(s.scores, TOPK, tiles)


def gqa_grid(fp8: bool) -> list[GqaTiles]:
    shapes = [GqaTiles(bn=bn, warps=4, stages=stages, f16_dots=fp8, table_in_registers=regs)
              for bn, stages, regs in itertools.product((64, 128), (2, 3, 4), (False, True))]
    default = gqa_tiles(True, fp8)
    return [default] + [s for s in shapes if s != default]


def dense_mla_grid(ds_mla: bool) -> list[MlaTiles]:
    if ds_mla:
        shapes = [MlaTiles(bn=bn, warps=4, stages=stages, separate_loads=separate)
                  for bn, stages, separate in itertools.product((32, 64), (2, 3), (False, True))]
        shapes += [MlaTiles(bn=bn, warps=warps, stages=stages, dequant_tile=True)
                   for bn, warps, stages in itertools.product((32, 64), (4, 8), (2, 3))]
    else:
        shapes = [MlaTiles(bn=bn, warps=4, stages=stages, table_in_registers=regs)
                  for bn, stages, regs in itertools.product((32, 64), (2, 3, 4), (False, True))]
    default = mla_tiles(True, ds_mla, False)
    return [default] + [s for s in shapes if s != default]


def dense_sweeps(rows: int, context: int, reps: int, kernels: list[str]) -> dict[str, list[dict]]:
    """Llama's GQA (bf16 and fp8 K/V) and DeepSeek-V2's dense MLA (bf16 and fp8_ds_mla): their
    caches are larger than L2, so one input set."""
    from pcppass.bench.kernels import gqa_inputs, mla_inputs
    from pcppass.kernels.attention.launch import gqa_attention, mla_attention

    out = {}
    for fp8 in (False, True):
        if ("gqa_fp8" if fp8 else "gqa_bf16") not in kernels:
            continue
        q, k, v, step, *scales = gqa_inputs(rows, context, fp8)
        out["gqa_fp8" if fp8 else "gqa_bf16"] = sweep(
            gqa_grid(fp8), lambda tiles, _: gqa_attention(q, k, v, step, q.shape[2] ** -0.5, *scales, tiles=tiles),
            [None], reps)
        del q, k, v
    q_lat, q_pe, step, caches = mla_inputs(rows, context)
    for ds_mla, cache in caches.items():
        if ("mla_fp8_ds_mla" if ds_mla else "mla_bf16") not in kernels:
            continue
        out["mla_fp8_ds_mla" if ds_mla else "mla_bf16"] = sweep(
            dense_mla_grid(ds_mla), lambda tiles, _: mla_attention(q_lat, q_pe, cache, step, 0.07, ds_mla, tiles=tiles),
            [None], reps)
    return out


def split_sweep(rows: int, context: int, reps: int, splits: list[int]) -> dict[str, dict[int, float | str]]:
    """Decode rows' keys per split (``launch.GQA_SPLIT`` / ``MLA_SPLIT``) at the default launch
    shapes: fewer, longer programs against more, shorter ones and a larger combine."""
    from pcppass.bench.kernels import gqa_inputs, mla_inputs
    from pcppass.kernels.attention import launch

    calls = {}
    for fp8 in (False, True):
        q, k, v, step, *scales = gqa_inputs(rows, context, fp8)
        calls["gqa_fp8" if fp8 else "gqa_bf16"] = ("GQA_SPLIT", lambda q=q, k=k, v=v, step=step, scales=scales:
                                                   launch.gqa_attention(q, k, v, step, 0.088, *scales))
    q_lat, q_pe, step, caches = mla_inputs(rows, context)
    for ds_mla, cache in caches.items():
        calls["mla_fp8_ds_mla" if ds_mla else "mla_bf16"] = ("MLA_SPLIT", lambda c=cache, d=ds_mla:
                                                             launch.mla_attention(q_lat, q_pe, c, step, 0.07, d))
    out = {}
    for kernel, (constant, call) in calls.items():
        default = getattr(launch, constant)
        out[kernel] = {}
        try:
            for split in splits:
                setattr(launch, constant, split)
                out[kernel][split] = time_calls([call], reps)
        finally:
            setattr(launch, constant, default)
        print(f"{kernel} rows={rows} C={context} keys per split: {out[kernel]}", flush=True)
    return out


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# Paged attention launch shapes: {env.get('device')}", "",
             f"{env['date']} · torch {env['torch']} · triton {env.get('triton')} · CUDA graph replays, median", ""]
    for shape in result["shapes"]:
        for kernel in (k for k in KERNELS if k in shape):
            entries = [e for e in shape[kernel] if "us" in e]
            floor = shape["floor_bytes"][kernel] / DATASHEET_HBM * 1e6
            lines += [f"## {kernel}, {shape['rows']} rows, context {shape['context']} (byte floor {floor:.1f} µs)",
                      "", "| shape | µs | % of 4.8 TB/s | rel. error vs default |", "|---|---|---|---|"]
            default = shape[kernel][0]
            ranked = [e for e in [default] if "us" in e] + sorted(entries[1:] if "us" in default else entries,
                                                                  key=lambda e: e["us"])[:5]
            for e in ranked:
                name = ("default " if e is default else "") + ", ".join(f"{k}={v}" for k, v in e["tiles"].items())
                lines.append(f"| {name} | {e['us']:.1f} | {100 * floor / e['us']:.0f} | {e['rel_err']:.1e} |")
            failed = len(shape[kernel]) - len(entries)
            lines += ([f"", f"{failed} shapes failed to compile or run."] if failed else []) + [""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,64")
    parser.add_argument("--context", default="16384,32768")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--v32", default="indexer,sparse_mla,topk_select",
                        help="which V3.2 kernels to sweep (comma list of indexer, sparse_mla, topk_select, "
                             "topk_parts; empty: none)")
    parser.add_argument("--dense", default="", help="also these of gqa_bf16, gqa_fp8, mla_bf16, mla_fp8_ds_mla "
                                                    "(comma list)")
    parser.add_argument("--splits", default="", help="also time the dense kernels' default shapes at these "
                                                     "keys per split (comma list)")
    args = parser.parse_args()
    result = {"environment": environment(), "config": vars(args), "shapes": []}
    for rows, context in itertools.product(map(int, args.rows.split(",")), map(int, args.context.split(","))):
        v32 = [name for name in args.v32.split(",") if name]
        sets = v32_inputs(rows, context) if v32 else []
        shape = {"rows": rows, "context": context, "input_sets": len(sets),
                 "floor_bytes": {"indexer": rows * context * (DIM + 4) + rows * context * 4,
                                 "topk_select": rows * context * 4, "topk_parts": rows * context * 4,
                                 "sparse_mla": rows * min(TOPK, context) * V32.latent_row_bytes},
                 **{name: sweep(grid(), run, sets, args.reps) for name, grid, run in (
                     ("indexer", indexer_grid, run_indexer), ("sparse_mla", mla_grid, run_sparse_mla),
                     ("topk_select", select_grid, run_select), ("topk_parts", select_parts_grid, run_select))
                    if name in v32}}
        del sets
        torch.cuda.empty_cache()
        if args.dense:
            shape.update(dense_sweeps(rows, context, args.reps, args.dense.split(",")))
            shape["floor_bytes"].update({
                "gqa_bf16": rows * context * 8 * 128 * 2 * 2, "gqa_fp8": rows * context * 8 * 128 * 2,
                "mla_bf16": rows * context * 576 * 2, "mla_fp8_ds_mla": rows * context * 656})
        if args.splits:
            shape["keys_per_split_us"] = split_sweep(rows, context, args.reps, [int(x) for x in args.splits.split(",")])
        result["shapes"].append(shape)
        for kernel in KERNELS:
            if kernel not in shape:
                continue
            best = min((e for e in shape[kernel] if "us" in e), key=lambda e: e["us"], default=None)
            default = shape[kernel][0].get("us", shape[kernel][0].get("error"))
            found = f"best {best['us']:.1f} us {best['tiles']} err {best['rel_err']:.1e}" if best else "no shape ran"
            print(f"{kernel} rows={rows} C={context}: default {default}, {found}", flush=True)
        torch.cuda.empty_cache()
    print(write(args.out, f"attention_tiles_{args.tag}", result, markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
