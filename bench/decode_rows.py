"""How each decode attention kernel's time follows the rows of a step, on one GPU.

    python bench/decode_rows.py --rows 4,8,16,32,64 --context 32768 --out bench/results --tag h200

Decode sharding gives each rank ``1 / P`` of the rows; it only pays where a kernel's time falls
with its rows. A kernel with one program per row (and split) leaves SMs idle below a row count
and then takes as long as at that count. Per row count (inputs of
:func:`pcppass.bench.kernels.v32_input_set` and the dense kernels' builders, CUDA-graph
replays, median):

* DeepSeek-V3.2's indexer; its top-2048 with a row's candidates found by one program per part of
  the row (the launcher) and by the row's own program (``part=0``), their picks compared bitwise;
* sparse MLA at every split of :data:`~pcppass.engine.attention.launch.SPARSE_SPLITS` (error
  against 1024 picks per split) and the split :func:`~pcppass.engine.attention.launch.sparse_split_for`
  picks for those rows; the three together as the launcher runs them under
  :func:`~pcppass.engine.attention.launch.decode_rows_per_rank` (the rows) and without it;
* bf16 GQA and bf16 dense MLA (up to 32 rows: their caches grow with the rows).

Writes ``<out>/decode_rows_<tag>.json`` (device, versions, date, configuration, every time),
``.md`` (µs by kernel and rows) and ``.png`` (the V3.2 kernels' µs by rows, log-log).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from pcppass.bench.environment import environment
from pcppass.bench.kernels import V32, V32Inputs, gqa_inputs, input_sets, mla_inputs, v32_input_set
from pcppass.bench.results import pyplot, write
from pcppass.bench.timing import time_graph
from pcppass.engine.attention.launch import (
    SPARSE_MLA_TILES,
    SPARSE_MLA_TRITON_TILES,
    SPARSE_SPLITS,
    decode_rows_per_rank,
    gqa_attention,
    indexer_scores,
    mla_attention,
    sparse_tiles,
)
from pcppass.engine.attention.select import SELECT_TILES, select_topk_triton

DENSE_MAX_ROWS = 32


def v32_inputs(rows: int, context: int) -> list[V32Inputs]:
    """Enough sets of the V3.2 kernels' inputs (those of :func:`pcppass.bench.kernels.v32_cases`)
    that their caches come from HBM, not L2."""
    return [v32_input_set(rows, context, s)
            for s in range(input_sets(rows * min(V32.topk, context) * V32.latent_row_bytes))]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the largest reference value (inf where the finite entries differ)."""
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    got, want = got[finite].float(), want[finite].float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def time_calls(calls, reps: int) -> float | str:
    """Median µs per call of ``calls`` replayed from one CUDA graph, or why they could not run."""
    def replay_all():
        for call in calls:
            call()

    try:
        replay_all()
        torch.cuda.synchronize()
        ms, status = time_graph(replay_all, 2, reps)
    except Exception as exc:  # a launch the compiler rejects (shared memory, registers) is reported
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    return statistics.median(ms) * 1000 / len(calls) if ms is not None else status


def v32_row(rows: int, context: int, reps: int) -> dict:
    sets = v32_inputs(rows, context)
    s0 = sets[0]
    out: dict = {}
    out["indexer"] = time_calls([lambda s=s: indexer_scores(s.q, s.w, s.icache, s.step, V32.dim) for s in sets], reps)
    whole = replace(SELECT_TILES, part=0)
    out["topk_picks_equal"] = bool(torch.equal(select_topk_triton(s0.scores, V32.topk),
                                               select_topk_triton(s0.scores, V32.topk, whole)))
    out["topk"] = time_calls([lambda s=s: select_topk_triton(s.scores, V32.topk) for s in sets], reps)
    out["topk_one_program"] = time_calls([lambda s=s: select_topk_triton(s.scores, V32.topk, whole) for s in sets],
                                         reps)

    def sparse(s, tiles):
        return mla_attention(s.q_lat, s.q_pe, s.mcache, s.step, 0.07, True, s.picked, tiles=tiles)

    want = sparse(s0, replace(SPARSE_MLA_TRITON_TILES, sparse_split=1024))
    for split in SPARSE_SPLITS:
        for suffix, kernel_tiles in (("", SPARSE_MLA_TILES), ("_triton", SPARSE_MLA_TRITON_TILES)):
            tiles = replace(kernel_tiles, sparse_split=split)
            out[f"sparse_mla_{split}{suffix}"] = time_calls([lambda s=s, t=tiles: sparse(s, t) for s in sets], reps)
            out[f"sparse_mla_{split}{suffix}_rel_err"] = rel_err(sparse(s0, tiles), want)
    with decode_rows_per_rank(rows):
        out["sparse_split_chosen"] = sparse_tiles(s0.q_lat.shape[1], s0.picked.shape[1], s0.q_lat.device).sparse_split

    def chain(s, triton_only=False):
        picked = select_topk_triton(indexer_scores(s.q, s.w, s.icache, s.step, V32.dim), V32.topk)
        tiles = sparse_tiles(s.q_lat.shape[1], V32.topk, s.q_lat.device)
        return mla_attention(s.q_lat, s.q_pe, s.mcache, s.step, 0.07, True, picked,
                             tiles=replace(tiles, gluon=False) if triton_only else tiles)

    out["v32_chain_fixed_split"] = time_calls([lambda s=s: chain(s) for s in sets], reps)
    with decode_rows_per_rank(rows):
        out["v32_chain"] = time_calls([lambda s=s: chain(s) for s in sets], reps)
        out["v32_chain_triton"] = time_calls([lambda s=s: chain(s, True) for s in sets], reps)
    return out


def dense_row(rows: int, context: int, reps: int) -> dict:
    out = {}
    q, k, v, step, *_ = gqa_inputs(rows, context, False)
    out["gqa_bf16"] = time_calls([lambda: gqa_attention(q, k, v, step, 0.088)], reps)
    del q, k, v
    q_lat, q_pe, mstep, caches = mla_inputs(rows, context)
    out["mla_bf16"] = time_calls([lambda: mla_attention(q_lat, q_pe, caches[False], mstep, 0.07, False)], reps)
    return out


KERNELS = [("indexer", "V3.2 indexer"), ("topk", "top-2048, candidates by parts"),
           ("topk_one_program", "top-2048, one program per row"), *[
               (f"sparse_mla_{s}", f"sparse MLA, {s} picks per split") for s in SPARSE_SPLITS], *[
               (f"sparse_mla_{s}_triton", f"sparse MLA, Triton kernel, {s} picks per split") for s in SPARSE_SPLITS],
           ("v32_chain_fixed_split", "indexer + top-k + sparse MLA, 1024 picks per split"),
           ("v32_chain", "indexer + top-k + sparse MLA, split chosen for the rows"),
           ("v32_chain_triton", "the same with the Triton sparse MLA kernel"),
           ("gqa_bf16", "GQA bf16 (Llama-3.1-8B widths)"), ("mla_bf16", "dense MLA bf16 (DeepSeek-V2 widths)")]


def markdown(result: dict) -> str:
    env, rows = result["environment"], result["rows"]
    counts = sorted(rows, key=int)
    lines = [f"# Decode kernels by rows per step: {env.get('device', '')}", "",
             f"{env.get('date', '')} · torch {env.get('torch', '')} · triton {env.get('triton', '')} · context "
             f"{result['context']} · CUDA-graph replays, median µs", "",
             "| kernel | " + " | ".join(f"{n} rows" for n in counts) + " |",
             "|---|" + "---|" * len(counts)]
    for key, label in KERNELS:
        cells = []
        for n in counts:
            v = rows[n].get(key)
            cells.append(f"{v:.1f}" if isinstance(v, float) else ("–" if v is None else str(v)[:40]))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Split chosen for the rows (`sparse_split_for`): "
              + ", ".join(f"{n} rows: {rows[n]['sparse_split_chosen']}" for n in counts) + "; top-k picks equal both "
              "ways: " + ", ".join(f"{n} rows: {rows[n]['topk_picks_equal']}" for n in counts) + "; sparse MLA's "
              "error against the Triton kernel at 1024 picks per split, largest: Gluon "
              + f"{max(rows[n][f'sparse_mla_{s}_rel_err'] for n in counts for s in SPARSE_SPLITS):.1e}, Triton "
              + f"{max(rows[n][f'sparse_mla_{s}_triton_rel_err'] for n in counts for s in SPARSE_SPLITS):.1e}", ""]
    return "\n".join(lines)


PLOTTED = ["topk_one_program", "topk", "sparse_mla_1024_triton", "sparse_mla_1024", "v32_chain_triton", "v32_chain"]


def plot(result: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = sorted(result["rows"], key=int)
    labels = dict(KERNELS)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in PLOTTED:
        points = [(int(n), result["rows"][n][key]) for n in rows if isinstance(result["rows"][n].get(key), float)]
        ax.plot(*zip(*points), marker="o", label=labels[key])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode rows in the step")
    ax.set_ylabel("µs (CUDA-graph replay, median)")
    ax.set_title(f"DeepSeek-V3.2 decode kernels by rows, {result['context']} context, "
                 f"{result['environment'].get('device', '')}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4,8,16,32,64")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="h200")
    args = parser.parse_args()
    result = {"environment": environment(), "context": args.context, "reps": args.reps, "rows": {}}
    for rows in [int(r) for r in args.rows.split(",")]:
        entry = v32_row(rows, args.context, args.reps)
        if rows <= DENSE_MAX_ROWS:
            entry.update(dense_row(rows, args.context, args.reps))
        torch.cuda.empty_cache()
        result["rows"][rows] = entry
        print(rows, {k: round(v, 1) if isinstance(v, float) else v for k, v in entry.items()
                     if not k.endswith("rel_err")}, flush=True)
    print(write(args.out, f"decode_rows_{args.tag}", result, markdown, plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
