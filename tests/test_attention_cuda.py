"""The paged attention kernels on CUDA, against the models' reference paths (skipped without a GPU).

At the full models' widths in bf16: GQA (Llama-3.1-8B heads), dense MLA (DeepSeek-V2 heads, bf16 and
fp8_ds_mla rows), the DeepSeek-V3.2 indexer + top-2048 + sparse MLA (128 heads), per row with several
key splits and in tiles of prefill rows. Also: a row's output does not depend on the other rows of
its step (bitwise), a CUDA-graph replay gives the eager bytes, and the full-width models' kernel
paths agree with their reference paths step by step through the engine.
"""

import pytest
import torch

from attention_cases import (
    indexer_cache,
    kernel_vs_reference_run,
    make_step,
    mla_cache,
    reference_gqa,
    reference_indexer,
    reference_mla,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BF16_TOL = 2e-2  # bf16 operands (METHOD: 1e-3 .. 1e-2), relative to the largest reference value
DECODE = [(1, 4000), (1, 2500), (1, 17), (1, 0), (1, 3100)]  # one row per request: per-row programs, splits
PREFILL = [(300, 200), (40, 900)]  # more than 256 rows: tiles of rows


def rel_err(out, ref, live):
    return float((out[live].float() - ref[live].float()).abs().max() / ref[live].float().abs().max())


@pytest.mark.parametrize("segments", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("fp8", [False, True])
def test_gqa(segments, fp8):
    from pcppass.engine.attention.launch import gqa_attention

    step = make_step(segments, 3, 64, 72, device="cuda")
    t = step.rows.positions.shape[0]
    q = torch.randn(t, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(step.num_blocks, 64, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    scales = (None, None)
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scales = (torch.full((1,), 0.5, device="cuda"), torch.full((1,), 2.0, device="cuda"))
    out = gqa_attention(q, k, v, step.rows, 128**-0.5, *scales)
    assert rel_err(out, reference_gqa(step, q, k, v, 128**-0.5, *scales), step.live) < BF16_TOL
    assert not out[~step.live].any()


def test_gqa_fp8_queries_far_outside_float16():
    """fp8 GQA decode runs float16 dots, each query lane scaled by a power of two into float16's
    range: bf16 queries 2^24 and 2^-40 times larger (the scale on the scores divides it back)
    give the very bytes of unit queries."""
    from pcppass.engine.attention.launch import gqa_attention

    step = make_step(DECODE, 3, 64, 72, device="cuda")
    t = step.rows.positions.shape[0]
    q = torch.randn(t, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(step.num_blocks, 64, 8, 128, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
    scales = (torch.full((1,), 0.5, device="cuda"), torch.full((1,), 2.0, device="cuda"))
    out = gqa_attention(q, k, v, step.rows, 128**-0.5, *scales)
    assert out[step.live].isfinite().all()
    for magnitude in (24, -40):
        up = 2.0**magnitude
        assert torch.equal(gqa_attention(q * up, k, v, step.rows, 128**-0.5 / up, *scales), out), magnitude


@pytest.mark.parametrize("segments", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("ds_mla", [False, True])
def test_mla_dense(segments, ds_mla):
    from pcppass.engine.attention.launch import mla_attention

    step = make_step(segments, 3, 64, 72, device="cuda")
    t = step.rows.positions.shape[0]
    cache = mla_cache(step, 512, 64, ds_mla, dtype=torch.bfloat16, device="cuda")
    q_lat = torch.randn(t, 16, 512, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(t, 16, 64, device="cuda", dtype=torch.bfloat16)
    out = mla_attention(q_lat, q_pe, cache, step.rows, 0.07, ds_mla)
    assert rel_err(out, reference_mla(step, q_lat, q_pe, cache, 0.07, 512, ds_mla), step.live) < BF16_TOL


@pytest.mark.parametrize("e4m3_query", [False, True])
def test_v32_indexer_topk_sparse_mla(e4m3_query):
    """Scores within float32 rounding of the reference (bf16 queries), or within the rounding of
    Hopper's fp8 MMA for DeepSeek-V3.2's e4m3 queries (it aligns the products of one instruction to
    about 14 bits before their float32 sum, as DeepSeek's own fp8 indexer kernel runs); the
    top-2048 is the set the reference's stable sort picks from the same scores; sparse MLA over it
    matches the reference."""
    from pcppass.engine.attention.launch import indexer_scores, mla_attention, select_topk
    from pcppass.ops.quant import quantize_indexer_query

    step = make_step(DECODE, 2, 64, 72, device="cuda")
    t = step.rows.positions.shape[0]
    icache = indexer_cache(step, 128, 128, device="cuda", zero_every=5)
    q = torch.randn(t, 64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(t, 64, device="cuda").abs() * 0.01
    if e4m3_query:
        q, w = quantize_indexer_query(q, w, "ue8m0")
    scores = indexer_scores(q, w, icache, step.rows, 128)
    ref_scores, (ref_index, ref_valid) = reference_indexer(step, q, w, icache, 128, 128, 2048)
    live = step.live
    assert torch.equal(torch.isinf(scores[live]), torch.isinf(ref_scores[live]))
    finite = ~torch.isinf(ref_scores[live])
    got, want = scores[live][finite], ref_scores[live][finite]
    err = float((got - want).abs().max() / want.abs().max())
    print(f"indexer scores, {'e4m3' if e4m3_query else 'bf16'} queries: max error / max score {err:.2e}")
    assert err < (1e-3 if e4m3_query else 1e-5)
    picked = select_topk(ref_scores, 2048)
    for row in range(t):
        if live[row]:
            assert picked[row][picked[row] >= 0].tolist() == sorted(ref_index[row][ref_valid[row]].tolist())
    picked = select_topk(scores, 2048)
    cache = mla_cache(step, 512, 64, True, device="cuda")
    q_lat = torch.randn(t, 128, 512, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(t, 128, 64, device="cuda", dtype=torch.bfloat16)
    out = mla_attention(q_lat, q_pe, cache, step.rows, 0.07, True, picked)
    ref = reference_mla(step, q_lat, q_pe, cache, 0.07, 512, True, picked)
    assert rel_err(out, ref, live) < BF16_TOL


@pytest.mark.parametrize("rows_per_rank", [4, 8, 16, 32])
def test_sparse_mla_split_for_the_deployments_rows(rows_per_rank):
    """Sparse MLA launched for 4 / 8 / 16 / 32 decode rows per rank (128 / 256 / 512 / 1024 picks
    per split on an H200) matches the reference; under one setting a row's bytes are the same
    alone and among the step's other rows (the split follows the setting, never the step)."""
    from pcppass.engine.attention.launch import StepRows, decode_rows_per_rank, mla_attention, sparse_tiles

    step = make_step([(1, 2900 + 301 * i) for i in range(6)], 0, 64, 80, device="cuda")
    t = step.rows.positions.shape[0]
    g = torch.Generator(device="cuda").manual_seed(rows_per_rank)
    picked = torch.stack([torch.randperm(int(p) + 1, device="cuda", generator=g)[:2048].sort().values
                          for p in step.rows.positions])
    cache = mla_cache(step, 512, 64, True, device="cuda")
    q_lat = torch.randn(t, 128, 512, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(t, 128, 64, device="cuda", dtype=torch.bfloat16)
    ref = reference_mla(step, q_lat, q_pe, cache, 0.07, 512, True, picked)
    r = step.rows
    first = StepRows(r.tables[:1], r.positions[:1], r.token_to_req[:1], r.query_start_loc[:2], r.is_padding[:1])
    with decode_rows_per_rank(rows_per_rank):
        split = sparse_tiles(128, 2048, q_lat.device).sparse_split
        out = mla_attention(q_lat, q_pe, cache, r, 0.07, True, picked)
        alone = mla_attention(q_lat[:1], q_pe[:1], cache, first, 0.07, True, picked[:1])
    print(f"{rows_per_rank} rows per rank: {split} picks per split, error {rel_err(out, ref, step.live):.1e}")
    assert split == {4: 128, 8: 256, 16: 512, 32: 1024}[rows_per_rank]
    assert rel_err(out, ref, step.live) < BF16_TOL
    assert torch.equal(alone, out[:1])


@pytest.mark.parametrize("sparse", [False, True])
def test_fp8_ds_mla_dequantized_tiles(sparse):
    """fp8_ds_mla rows dequantised whole (``MlaTiles.dequant_tile``: one scores dot and one values
    dot per key tile) match the reference, dense (16 heads) and sparse (128 heads, 2048 picks)."""
    from dataclasses import replace

    from pcppass.engine.attention.launch import MLA_FP8_TILES, SPARSE_MLA_TILES, mla_attention

    step = make_step([(1, 2900 + 301 * i) for i in range(6)], 0, 64, 80, device="cuda")
    t, heads = step.rows.positions.shape[0], 128 if sparse else 16
    picked = None
    if sparse:
        g = torch.Generator(device="cuda").manual_seed(7)
        picked = torch.stack([torch.randperm(int(p) + 1, device="cuda", generator=g)[:2048].sort().values
                              for p in step.rows.positions])
    cache = mla_cache(step, 512, 64, True, device="cuda")
    q_lat = torch.randn(t, heads, 512, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(t, heads, 64, device="cuda", dtype=torch.bfloat16)
    tiles = replace(SPARSE_MLA_TILES if sparse else MLA_FP8_TILES, dequant_tile=True, gluon=False)  # the Triton kernel
    out = mla_attention(q_lat, q_pe, cache, step.rows, 0.07, True, picked, tiles=tiles)
    err = rel_err(out, reference_mla(step, q_lat, q_pe, cache, 0.07, 512, True, picked), step.live)
    print(f"{'sparse' if sparse else 'dense'} fp8_ds_mla, dequantised tiles: error {err:.1e}")
    assert err < BF16_TOL


def test_rows_do_not_depend_on_their_step_and_graph_replays_match():
    """Row 0 alone and among 63 other rows: the same bytes (fixed split sizes); a captured CUDA
    graph's replay gives the eager bytes."""
    from pcppass.engine.attention.launch import StepRows, gqa_attention, mla_attention

    many = make_step([(1, 3000 + 37 * i) for i in range(64)], 0, 64, 90, device="cuda")
    r = many.rows
    first = StepRows(r.tables[:1], r.positions[:1], r.token_to_req[:1], r.query_start_loc[:2], r.is_padding[:1])
    k = torch.randn(many.num_blocks, 64, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(gqa_attention(q[:1], k, v, first, 0.08), gqa_attention(q, k, v, many.rows, 0.08)[:1])
    cache = mla_cache(many, 512, 64, True, device="cuda")
    q_lat = torch.randn(64, 16, 512, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(64, 16, 64, device="cuda", dtype=torch.bfloat16)
    eager = mla_attention(q_lat, q_pe, cache, many.rows, 0.07, True)
    assert torch.equal(mla_attention(q_lat[:1], q_pe[:1], cache, first, 0.07, True), eager[:1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mla_attention(q_lat, q_pe, cache, many.rows, 0.07, True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("name", ["llama", "deepseek_v2", "deepseek_v32"])
def test_full_width_models_kernel_paths_match_reference_paths(name):
    """Two layers at full widths, bf16, prompts of up to 700 tokens (prefill chunks of 320 rows,
    then decode rows): every step's hidden rows agree with the reference path."""
    from pcppass.engine import WorkloadConfig
    from pcppass.models import build_model

    model = build_model(name, "full", device="cuda", num_layers=2)
    errors = kernel_vs_reference_run(
        model, dict(num_blocks=64, max_num_batched_tokens=320, max_model_len=1024, max_num_seqs=4),
        WorkloadConfig(num_requests=4, prompt_len=(200, 700), max_new_tokens=(3, 5), prefix_hit_rate=0.5,
                       block_size=64, vocab_size=model.config.vocab_size))
    assert len(errors) >= 5 and max(errors) < 5e-2, errors
