"""Kernel bench: each paged attention kernel's time and achieved bandwidth against its floor.

``pcppass bench kernels`` (one GPU). For decode shapes of the full-width models (``rows`` rows,
each its own request at context ``C``, random block order), every kernel of
:mod:`pcppass.engine.attention` is timed from CUDA-graph replays; its **floor** is the bytes it
must read (each cache row it attends to once; queries and outputs are counted too) over the H200's
4.8 TB/s (datasheet HBM; a device copy is measured and recorded beside it). Where one call's bytes
would fit in L2, each replay cycles through several input sets so the caches are read from HBM.

Beside them: ``torch``'s flash SDPA on contiguous K/V of the same shape (what a production decode
kernel reaches), and the models' reference paths (gather every visible row, attend in plain torch),
which the CUDA paths replace.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from pcppass.bench.environment import environment
from pcppass.bench.timing import time_graph

L2_BYTES = 60 * 2**20
#: H200 HBM3e by the vendor's datasheet (bytes/s)
DATASHEET_HBM = 4.8e12


@dataclass(frozen=True)
class KernelBenchConfig:
    rows: tuple[int, ...] = (32, 64)
    contexts: tuple[int, ...] = (16384, 32768)
    reps: int = 20
    reference: bool = True
    out: str = "bench/results"
    tag: str = ""


@dataclass
class Case:
    kernel: str
    rows: int
    context: int
    floor_bytes: int
    flops: float
    calls: list[Callable[[], Any]]  # one per input set, cycled within one replay


def hbm_bandwidth(nbytes: int = 4 * 2**30) -> float:
    """Bytes read plus written per second by a device-to-device copy of float32 elements, after
    enough warm-up copies for the clocks to rise (information beside the datasheet's figure)."""
    src = torch.empty(nbytes // 8, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms, _ = time_graph(lambda: dst.copy_(src), 50, 20)
    return nbytes / (statistics.median(ms) / 1000)


def decode_rows(rows: int, context: int, block_size: int, first_request: int = 0):
    """StepRows of ``rows`` decode rows at position ``context - 1``, requests with their own
    randomly ordered blocks (block 0 stays the null block)."""
    from pcppass.engine.attention.launch import StepRows

    cols = -(-context // block_size)
    gen = torch.Generator().manual_seed(first_request)
    tables = torch.stack([1 + (first_request + r) * cols + torch.randperm(cols, generator=gen) for r in range(rows)])
    dev = "cuda"
    return StepRows(tables.to(dev), torch.full((rows,), context - 1, dtype=torch.int64, device=dev),
                    torch.arange(rows, device=dev), torch.arange(rows + 1, device=dev),
                    torch.zeros(rows, dtype=torch.bool, device=dev)), 1 + (first_request + rows) * cols


def input_sets(bytes_per_call: int) -> int:
    """How many input sets a replay cycles through so one call's bytes come from HBM."""
    return max(1, min(8, math.ceil(3 * L2_BYTES / max(bytes_per_call, 1))))


def gqa_inputs(rows: int, context: int, fp8: bool) -> tuple:
    """(q, K cache, V cache, step, k_scale, v_scale) of Llama-3.1-8B's GQA (32 q / 8 kv heads x 128)."""
    heads, kv_heads, dim, bs = 32, 8, 128, 64
    step, blocks = decode_rows(rows, context, bs)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    k = torch.randn(blocks, bs, kv_heads, dim, device="cuda").to(dtype)
    v = torch.randn(blocks, bs, kv_heads, dim, device="cuda").to(dtype)
    q = torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
    scales = (torch.ones(1, device="cuda"), torch.ones(1, device="cuda")) if fp8 else (None, None)
    return q, k, v, step, *scales


def gqa_case(rows: int, context: int, fp8: bool) -> Case:
    from pcppass.engine.attention.launch import gqa_attention

    q, k, v, step, *scales = gqa_inputs(rows, context, fp8)
    heads, dim = q.shape[1], q.shape[2]
    kv_bytes = rows * context * k.shape[2] * dim * 2 * k.element_size()
    return Case("gqa_fp8" if fp8 else "gqa_bf16", rows, context, kv_bytes + 2 * q.numel() * 2, 4.0 * rows * heads * context * dim,
                [lambda: gqa_attention(q, k, v, step, dim**-0.5, *scales)])


def mla_inputs(rows: int, context: int) -> tuple:
    """(q_lat, q_pe, step, {ds_mla: latent cache}) of DeepSeek-V2's dense MLA (16 heads, 512 + 64)
    over a bf16 and an fp8_ds_mla cache of the same rows."""
    from pcppass.ops.quant import encode_ds_mla_rows

    heads, latent, rope, bs = 16, 512, 64, 64
    step, blocks = decode_rows(rows, context, bs)
    q_lat = torch.randn(rows, heads, latent, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(rows, heads, rope, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(blocks * bs, latent + rope, device="cuda", dtype=torch.bfloat16)
    caches = {ds_mla: (encode_ds_mla_rows(kv[:, :latent], kv[:, latent:]) if ds_mla else kv).view(blocks, bs, -1)
              for ds_mla in (False, True)}
    return q_lat, q_pe, step, caches


def mla_cases(rows: int, context: int) -> list[Case]:
    """Dense MLA (DeepSeek-V2 widths: 16 heads) over bf16 and fp8_ds_mla latent caches; fp8_ds_mla
    twice, as the launcher runs it (the Gluon kernel on Hopper) and with the Triton kernel only."""
    from pcppass.engine.attention.launch import MLA_FP8_TRITON_TILES, mla_attention

    q_lat, q_pe, step, caches = mla_inputs(rows, context)
    heads, latent, rope = q_lat.shape[1], q_lat.shape[2], q_pe.shape[2]
    out = []
    for ds_mla, cache in caches.items():
        row_bytes = cache.shape[-1] * cache.element_size()
        flops = 2.0 * rows * heads * context * (2 * latent + rope)
        nbytes = rows * context * row_bytes + 2 * q_lat.numel() * 2
        out.append(Case("mla_fp8_ds_mla" if ds_mla else "mla_bf16", rows, context, nbytes, flops,
                        [lambda c=cache, d=ds_mla: mla_attention(q_lat, q_pe, c, step, 0.07, d)]))
        if ds_mla:
            out.append(Case("mla_fp8_ds_mla_triton", rows, context, nbytes, flops,
                            [lambda c=cache: mla_attention(q_lat, q_pe, c, step, 0.07, True,
                                                           tiles=MLA_FP8_TRITON_TILES)]))
    return out


@dataclass(frozen=True)
class V32Widths:
    """DeepSeek-V3.2's widths, as the V3.2 kernel cases run them."""

    indexer_heads: int = 64
    dim: int = 128  # indexer head dim, one quantisation block
    topk: int = 2048
    heads: int = 128
    latent: int = 512
    rope: int = 64
    block_size: int = 64

    @property
    def latent_row_bytes(self) -> int:
        """One fp8_ds_mla row: e4m3 latent codes, a float32 scale per 128 of them, bf16 RoPE values."""
        return self.latent + 4 * (self.latent // 128) + 2 * self.rope


V32 = V32Widths()


@dataclass(frozen=True)
class V32Inputs:
    """One input set of the V3.2 kernels (:func:`v32_input_set`)."""

    step: Any  # pcppass.engine.attention.launch.StepRows
    icache: torch.Tensor  # fp8 indexer cache, ue8m0 keys
    mcache: torch.Tensor  # fp8_ds_mla latent cache
    q: torch.Tensor  # e4m3 indexer query, its scales folded into ``w``
    w: torch.Tensor
    scores: torch.Tensor  # the indexer's scores
    picked: torch.Tensor  # their top-k
    q_lat: torch.Tensor
    q_pe: torch.Tensor


def v32_input_set(rows: int, context: int, index: int) -> V32Inputs:
    """Input set ``index`` of the V3.2 kernels at ``rows`` decode rows of context ``context``."""
    from pcppass.engine.attention.launch import indexer_scores, select_topk
    from pcppass.ops.quant import encode_ds_mla_rows, encode_indexer_rows, quantize_indexer_query

    bs, dim = V32.block_size, V32.dim
    step, blocks = decode_rows(rows, context, bs, first_request=index * rows)
    keys = torch.randn(blocks * bs, dim, device="cuda", dtype=torch.bfloat16)
    codes, scales = encode_indexer_rows(keys, dim, "ue8m0")
    icache = torch.cat((codes.view(blocks, bs * dim), scales.view(blocks, bs * 4)), 1)
    del keys
    kv = torch.randn(blocks * bs, V32.latent + V32.rope, device="cuda", dtype=torch.bfloat16)
    mcache = encode_ds_mla_rows(kv[:, :V32.latent], kv[:, V32.latent:]).view(blocks, bs, -1)
    del kv
    q, w = quantize_indexer_query(torch.randn(rows, V32.indexer_heads, dim, device="cuda", dtype=torch.bfloat16),
                                  torch.randn(rows, V32.indexer_heads, device="cuda").abs(), "ue8m0")
    scores = indexer_scores(q, w, icache, step, dim)
    return V32Inputs(step, icache, mcache, q, w, scores, select_topk(scores, V32.topk),
                     torch.randn(rows, V32.heads, V32.latent, device="cuda", dtype=torch.bfloat16),
                     torch.randn(rows, V32.heads, V32.rope, device="cuda", dtype=torch.bfloat16))


def v32_cases(rows: int, context: int) -> list[Case]:
    """DeepSeek-V3.2: the lightning indexer (64 heads x 128, e4m3 queries and ue8m0 keys), the top-2048 selection,
    sparse MLA over the selected rows (128 heads, fp8_ds_mla), and the three in a row; the selection
    is timed as the models run it (the Triton radix select) and as ``torch.topk`` over int64 keys."""
    from pcppass.engine.attention.launch import indexer_scores, mla_attention, select_topk
    from pcppass.engine.attention.select import select_topk_triton

    hi, dim, topk, heads, latent, rope = V32.indexer_heads, V32.dim, V32.topk, V32.heads, V32.latent, V32.rope
    index_bytes = rows * context * (dim + 4)
    sparse_bytes = rows * min(topk, context) * V32.latent_row_bytes
    cases: dict[str, Case] = {}
    for s in range(input_sets(sparse_bytes)):
        inputs = v32_input_set(rows, context, s)
        step, icache, mcache, q, w, scores, picked, q_lat, q_pe = (
            inputs.step, inputs.icache, inputs.mcache, inputs.q, inputs.w, inputs.scores, inputs.picked, inputs.q_lat,
            inputs.q_pe)
        calls = {
            "indexer_scores": lambda q=q, w=w, c=icache, st=step: indexer_scores(q, w, c, st, dim),
            "topk_select": lambda sc=scores: select_topk_triton(sc, topk),
            "topk_select_torch": lambda sc=scores: select_topk(sc, topk),
            "sparse_mla": lambda c=mcache, st=step, p=picked, ql=q_lat, qp=q_pe: mla_attention(
                ql, qp, c, st, 0.07, True, p),
            "v32_indexer_topk_sparse_mla": lambda q=q, w=w, ic=icache, mc=mcache, st=step, ql=q_lat, qp=q_pe: (
                mla_attention(ql, qp, mc, st, 0.07, True, select_topk_triton(indexer_scores(q, w, ic, st, dim), topk))),
        }
        floors = {"indexer_scores": (index_bytes + rows * scores.shape[1] * 4, 2.0 * rows * context * hi * dim),
                  "topk_select": (rows * scores.shape[1] * 4, 0.0),
                  "topk_select_torch": (rows * scores.shape[1] * 4, 0.0),
                  "sparse_mla": (sparse_bytes, 2.0 * rows * heads * topk * (2 * latent + rope)),
                  "v32_indexer_topk_sparse_mla": (index_bytes + sparse_bytes,
                                                  2.0 * rows * (context * hi * dim + heads * topk * (2 * latent + rope)))}
        for name, fn in calls.items():
            nbytes, flops = floors[name]
            cases.setdefault(name, Case(name, rows, context, nbytes, flops, [])).calls.append(fn)
    return list(cases.values())


def sdpa_case(rows: int, context: int) -> Case:
    """torch's flash SDPA, one query per row over contiguous K/V (the GQA case's bytes)."""
    heads, kv_heads, dim = 32, 8, 128
    q = torch.randn(rows, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(rows, kv_heads, context, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    return Case("torch_sdpa_contiguous", rows, context, 2 * k.numel() * 2, 4.0 * rows * heads * context * dim, [fn])


def reference_cases(rows: int, context: int) -> list[Case]:
    """The models' reference paths at the same shapes (gather every visible row, then attend)."""
    from pcppass.models.common import attend, causal_full_rows, gather_rows

    heads, kv_heads, dim, bs = 32, 8, 128, 64
    step, blocks = decode_rows(rows, context, bs)
    k = torch.randn(blocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16)

    def gqa_reference():
        index, valid = causal_full_rows(step.tables, step.positions, bs)
        return attend(q, gather_rows(k, step.tables, index, bs), gather_rows(v, step.tables, index, bs), valid,
                      dim**-0.5)

    return [Case("gqa_reference_path", rows, context, rows * context * kv_heads * dim * 4, 4.0 * rows * heads * context * dim,
                 [gqa_reference])]


def run_case(case: Case, reps: int, bandwidth: float) -> dict[str, Any]:
    def replay_all():
        for call in case.calls:
            call()

    replay_all()
    torch.cuda.synchronize()
    ms, status = time_graph(replay_all, 2, reps)
    if ms is None:
        return {"kernel": case.kernel, "error": status}
    us = statistics.median(ms) * 1000 / len(case.calls)
    return {"kernel": case.kernel, "rows": case.rows, "context": case.context, "us": us,
            "floor_us": case.floor_bytes / DATASHEET_HBM * 1e6, "bytes": case.floor_bytes,
            "achieved_tb_s": case.floor_bytes / us / 1e6, "fraction_of_datasheet": case.floor_bytes / us / 1e6 / 4.8,
            "fraction_of_measured_copy": case.floor_bytes / us / 1e6 / (bandwidth / 1e12),
            "tflop_s": case.flops / us / 1e6, "input_sets": len(case.calls)}


def bench(cfg: KernelBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    bandwidth = hbm_bandwidth()
    log(f"device copy (read + write): {bandwidth / 1e12:.2f} TB/s; floors use the datasheet's "
        f"{DATASHEET_HBM / 1e12:.1f} TB/s")
    result: dict[str, Any] = {"environment": environment(), "config": asdict(cfg), "hbm_bytes_per_s": bandwidth,
                              "cases": [], "errors": []}
    for rows in cfg.rows:
        for context in cfg.contexts:
            builders: list[Callable[[], list[Case]]] = [
                lambda: [gqa_case(rows, context, False)], lambda: [gqa_case(rows, context, True)],
                lambda: mla_cases(rows, context), lambda: v32_cases(rows, context), lambda: [sdpa_case(rows, context)]]
            if cfg.reference and context == min(cfg.contexts):
                builders.append(lambda: reference_cases(rows, context))
            for build in builders:
                t0 = time.time()
                try:
                    for case in build():
                        entry = run_case(case, cfg.reps, bandwidth)
                        result["cases"].append(entry)
                        log(f"{case.kernel} rows={rows} C={context}: " + (
                            f"{entry['us']:.1f} us, floor {entry['floor_us']:.1f} us, "
                            f"{100 * entry['fraction_of_datasheet']:.0f}% of 4.8 TB/s, {entry['tflop_s']:.0f} TFLOP/s"
                            if "us" in entry else entry["error"]))
                except Exception as exc:  # one failing kernel must not lose the others' numbers
                    result["errors"].append({"rows": rows, "context": context, "error": f"{type(exc).__name__}: {exc}"[:800]})
                    log(result["errors"][-1]["error"])
                torch.cuda.empty_cache()
                log(f"  ({time.time() - t0:.1f} s)")
    return result


def markdown(result: dict) -> str:
    """The table; floors (bytes / 4.8 TB/s) are recomputed from the bytes, so older results
    (whose JSON floors used a device-copy figure) render the same way."""
    from pcppass.bench.results import fmt

    env = result["environment"]
    lines = [f"# pcppass bench kernels: {env.get('device')}", "",
             f"{env['date']} · torch {env['torch']} · triton {env.get('triton')} · CUDA {env.get('cuda')} · "
             f"floors: bytes / {DATASHEET_HBM / 1e12:.1f} TB/s (datasheet HBM); device copy in this run: "
             f"{result['hbm_bytes_per_s'] / 1e12:.2f} TB/s read + write", "",
             "| kernel | rows | context | µs | floor µs | bytes read | TB/s | % of 4.8 TB/s | TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in result["cases"]:
        if "us" not in e:
            lines.append(f"| {e['kernel']} | | | error: {e['error']} | | | | | |")
            continue
        tb_s = e["bytes"] / e["us"] / 1e6
        lines.append(f"| {e['kernel']} | {e['rows']} | {e['context']} | {fmt(e['us'], '.1f')} | "
                     f"{fmt(e['bytes'] / DATASHEET_HBM * 1e6, '.1f')} | {e['bytes']:,} | {fmt(tb_s, '.2f')} | "
                     f"**{fmt(100 * tb_s / (DATASHEET_HBM / 1e12), '.0f')}** | {fmt(e['tflop_s'], '.0f')} |")
    for err in result.get("errors", []):
        lines.append(f"- error rows={err['rows']} C={err['context']}: {err['error']}")
    return "\n".join(lines) + "\n"
