"""The paged attention kernels (pcppass.engine.attention) against the models' reference paths, on
CPU tensors under ``TRITON_INTERPRET=1`` (float32, so the kernels' dots are exact float32 and only
the summation order differs from the reference).

Kernel level: GQA (bf16-free float32 and fp8 caches), MLA dense and sparse (plain and fp8_ds_mla
rows), the lightning indexer's scores and its top-k (the same set as the reference's stable sort,
ties included), in per-row mode with one and several key splits and in tile mode. Model level:
each MLA/GQA reference model runs a small workload through the engine; every step runs the
reference path on a copy of the caches and the kernel path on the caches, and the hidden rows agree.
"""

import os

import pytest
import torch
import triton  # noqa: F401  (imported in compiled mode before the interpreter is switched on, as in the
# full suite: the kernels must not call the library's compiled-mode @triton.jit functions)

from attention_cases import (
    indexer_cache,
    kernel_vs_reference_run,
    make_step,
    mla_cache,
    reference_gqa,
    reference_indexer,
    reference_mla,
)

SEGMENTS = [(7, 10), (2, 3), (1, 20), (1, 0)]  # (rows, first position) per local request
#: fewer rows for a test that runs the kernel seven times (a prefill chunk, a decode row over keys
#: that span several splits and blocks, a row with one key)
SHORT_SEGMENTS = [(2, 10), (1, 20), (1, 0)]
PADDING = 2
BS, COLUMNS = 4, 7


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture(params=["row", "row_split", "tile"])
def mode(request, monkeypatch):
    """per-row programs with every key in one split, with 8-key splits, or tiles of rows."""
    from dataclasses import replace

    from pcppass.engine.attention import launch

    if request.param == "row_split":
        # splits that start inside a block (6 and 3 keys, 4-key blocks; 3 is shorter than a block)
        monkeypatch.setattr(launch, "GQA_SPLIT", 6)
        monkeypatch.setattr(launch, "MLA_SPLIT", 3)
        monkeypatch.setattr(launch, "SPARSE_MLA_TILES", replace(launch.SPARSE_MLA_TILES, sparse_split=4))
        monkeypatch.setattr(launch, "INDEXER_TILES", replace(launch.INDEXER_TILES, chunk=6, bn=16))
    if request.param == "tile":
        monkeypatch.setattr(launch, "ROW_MODE_MAX_ROWS", 0)
        monkeypatch.setattr(launch, "TILE_M", 8)
    return request.param


def close(out, ref, live, tol=1e-5):
    err = (out[live].float() - ref[live].float()).abs().max() / ref[live].float().abs().max()
    assert err < tol, err


@pytest.mark.parametrize("fp8", [False, True])
def test_gqa_matches_reference(mode, table_in_registers, fp8):
    from pcppass.engine.attention.launch import gqa_attention

    step = make_step(SEGMENTS, PADDING, BS, COLUMNS)
    g = torch.Generator().manual_seed(3)
    t = step.rows.positions.shape[0]
    q = torch.randn(t, 4, 16, generator=g)
    k_cache = torch.randn(step.num_blocks, BS, 2, 16, generator=g)
    v_cache = torch.randn(step.num_blocks, BS, 2, 16, generator=g)
    scales = (None, None)
    if fp8:
        scales = (torch.tensor([0.25]), torch.tensor([0.5]))
        k_cache, v_cache = (c.mul(4).to(torch.float8_e4m3fn) for c in (k_cache, v_cache))
    out = gqa_attention(q, k_cache, v_cache, step.rows, 0.25, *scales)
    close(out, reference_gqa(step, q, k_cache, v_cache, 0.25, *scales), step.live)
    assert torch.equal(out[~step.live], torch.zeros_like(out[~step.live]))


def sparse_picks(step, g: torch.Generator, picks: int = 6) -> torch.Tensor:
    """Up to ``picks`` distinct visible positions per row, -1 where a row has fewer and on padding."""
    t = step.rows.positions.shape[0]
    index = torch.full((t, picks), -1, dtype=torch.int64)
    for row, p in enumerate(step.rows.positions.tolist()):
        chosen = torch.randperm(p + 1, generator=g)[:picks]
        index[row, : chosen.numel()] = chosen
    index[step.rows.is_padding] = -1
    return index


def check_mla_against_reference(latent: int, ds_mla: bool, sparse: bool, seed: int) -> None:
    """MLA over the shared step (4 heads, 8 RoPE dims) against the reference."""
    from pcppass.engine.attention.launch import mla_attention

    rope = 8
    step = make_step(SEGMENTS, PADDING, BS, COLUMNS)
    cache = mla_cache(step, latent, rope, ds_mla)
    g = torch.Generator().manual_seed(seed)
    t = step.rows.positions.shape[0]
    q_lat, q_pe = torch.randn(t, 4, latent, generator=g), torch.randn(t, 4, rope, generator=g)
    index = sparse_picks(step, g) if sparse else None
    out = mla_attention(q_lat, q_pe, cache, step.rows, 0.1, ds_mla, index)
    close(out, reference_mla(step, q_lat, q_pe, cache, 0.1, latent, ds_mla, index), step.live)


@pytest.mark.parametrize("ds_mla", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
def test_mla_matches_reference(mode, table_in_registers, ds_mla, sparse):
    """(Sparse MLA runs per row in every mode: each row has its own positions. Dense fp8_ds_mla
    rows read their codes twice per program, the scores from a load of their own, and prefill
    tiles once: the per-row modes and the tile mode run both.)"""
    from pcppass.engine.attention import launch

    assert launch.MLA_FP8_TILES.separate_loads and not launch.MLA_PREFILL_TILES.separate_loads

    check_mla_against_reference(128, ds_mla, sparse, seed=4)


@pytest.mark.parametrize("sparse", [False, True])
def test_mla_dequantized_tiles_match_reference(mode, sparse, monkeypatch):
    """fp8_ds_mla rows dequantised whole (each code times its own 128-dim tile's scale, one scores
    dot and one values dot) in every mode; 256 latent dims, so two tiles with their own scales."""
    from dataclasses import replace

    from pcppass.engine.attention import launch

    for name in ("MLA_FP8_TILES", "MLA_PREFILL_TILES", "SPARSE_MLA_TILES"):
        monkeypatch.setattr(launch, name, replace(getattr(launch, name), dequant_tile=True))
    check_mla_against_reference(256, True, sparse, seed=5)


@pytest.fixture(params=[False, True], ids=["table_loads", "table_in_registers"])
def table_in_registers(request, mode, monkeypatch):
    """Per-row splits with the block table loaded per key tile, or held in registers."""
    from dataclasses import replace

    from pcppass.engine.attention import launch

    for name in ("GQA_TILES", "GQA_FP8_TILES", "MLA_TILES", "MLA_FP8_TILES", "SPARSE_MLA_TILES", "INDEXER_TILES"):
        monkeypatch.setattr(launch, name, replace(getattr(launch, name), table_in_registers=request.param))


@pytest.fixture
def f16_dots(mode, monkeypatch):
    """fp8 GQA with float16 dots in every mode (the decode launch shape has them; tiles of rows too)."""
    from dataclasses import replace

    from pcppass.engine.attention import launch

    for name in ("GQA_FP8_TILES", "GQA_PREFILL_TILES"):
        monkeypatch.setattr(launch, name, replace(getattr(launch, name), f16_dots=True))


def _queries(g, shape, up: float) -> torch.Tensor:
    """bf16 magnitudes in [1/16, 4] times ``up`` (a power of two): every value scales exactly."""
    signs = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return (signs * (torch.rand(shape, generator=g) * (4 - 1 / 16) + 1 / 16)).bfloat16() * up


def _fp8_gqa(step, magnitude: int, loud_head: int = 0):
    """(kernel output, reference output, largest value) of bf16 queries ``2^magnitude`` times
    larger than :func:`_queries` against fp8 caches, the scale on the scores ``2^-magnitude``
    times smaller; head 1's queries ``2^loud_head`` times larger still."""
    from pcppass.engine.attention.launch import gqa_attention

    g = torch.Generator().manual_seed(8)
    t = step.rows.positions.shape[0]
    up = 2.0**magnitude
    q = _queries(g, (t, 4, 16), up)
    q[:, 1] *= 2.0**loud_head
    k_cache, v_cache = (torch.randn(step.num_blocks, BS, 2, 16, generator=g).mul(4).to(torch.float8_e4m3fn)
                        for _ in range(2))
    scales = (torch.tensor([0.25]), torch.tensor([0.5]))
    return (gqa_attention(q, k_cache, v_cache, step.rows, 0.25 / up, *scales),
            reference_gqa(step, q.float(), k_cache, v_cache, 0.25 / up, *scales),
            float(v_cache.float().abs().max() * scales[1]))


def test_fp8_gqa_with_float16_dots(mode, f16_dots):
    """bf16 queries meet fp8 codes in float16 dots. Each query lane is scaled by a power of two
    into float16's range and its scores scaled back, so queries 2^24, 2^-40, 2^110 and 2^-110
    times larger (far outside float16's range; the scale on the scores divides it back) give the
    very bytes of the unit ones, and one head 2^40 times louder than the others does not cost
    them their precision. The output is the reference's (float32 throughout) to within its conversion to
    bf16 (one unit in the last place of the largest output: the interpreter truncates) and
    float16's rounding of the probabilities (2^-11 of each, so of at most the largest value)."""
    step = make_step(SHORT_SEGMENTS, PADDING, BS, COLUMNS)
    out, ref, largest_value = _fp8_gqa(step, 0)
    largest_out = float(ref[step.live].abs().max())
    tol = torch.finfo(torch.bfloat16).eps + 2**-11 * largest_value / largest_out
    close(out.float(), ref, step.live, tol=tol)
    for magnitude in (24, -40, 110, -110):
        scaled, *_ = _fp8_gqa(step, magnitude)
        assert torch.equal(scaled, out), magnitude
    # each lane has its own scale: a head 2^40 times louder (a scale shared with it would flush
    # the others to zero in float16) leaves the others their precision
    loud, loud_ref, _ = _fp8_gqa(step, 0, loud_head=40)
    close(loud.float(), loud_ref, step.live, tol=tol)


def test_indexer_scores_and_topk_match_reference(mode, table_in_registers):
    """Scores within float32 rounding; the top-k is exactly the reference's set, including the
    choice among tied scores (every third key is zero: its score is exactly 0 for every query)."""
    from pcppass.engine.attention.launch import indexer_scores, select_topk

    head_dim, qbs, k = 32, 16, 8
    step = make_step(SEGMENTS, PADDING, BS, COLUMNS)
    cache = indexer_cache(step, head_dim, qbs, zero_every=3)
    g = torch.Generator().manual_seed(5)
    t = step.rows.positions.shape[0]
    q, weights = torch.randn(t, 4, head_dim, generator=g), torch.randn(t, 4, generator=g).abs()
    scores = indexer_scores(q, weights, cache, step.rows, qbs)
    ref_scores, (ref_index, ref_valid) = reference_indexer(step, q, weights, cache, head_dim, qbs, k)
    live = step.live
    assert torch.equal(torch.isinf(scores[live]), torch.isinf(ref_scores[live]))
    finite = ~torch.isinf(ref_scores[live])
    close(scores[live][finite], ref_scores[live][finite], slice(None))
    picked = select_topk(ref_scores, k)  # the reference's scores: the selection alone is compared
    for row in range(t):
        if live[row]:
            expected = sorted(ref_index[row][ref_valid[row]].tolist())
            assert picked[row][picked[row] >= 0].tolist() == expected
    assert (select_topk(scores, k)[~live] == -1).all()


@pytest.mark.parametrize("head_dim,qbs", [(32, 32), (32, 16), (16, 16)])
def test_indexer_e4m3_queries_match_reference(mode, table_in_registers, head_dim, qbs):
    """DeepSeek-V3.2's query (e4m3 codes, one scale per head folded into the weights): with one key
    scale per token the codes of both sides meet in an fp8 dot, else (several scales, or heads
    narrower than an fp8 MMA's K) the float32 path runs over the same values; either way the
    scores are the reference's over ``codes * scale``."""
    from pcppass.engine.attention.launch import indexer_scores
    from pcppass.ops.quant import quantize_indexer_query


    step = make_step(SEGMENTS, PADDING, BS, COLUMNS)
    cache = indexer_cache(step, head_dim, qbs, zero_every=3)
    g = torch.Generator().manual_seed(6)
    t = step.rows.positions.shape[0]
    q, weights = quantize_indexer_query(torch.randn(t, 4, head_dim, generator=g) * 3,
                                        torch.randn(t, 4, generator=g).abs(), "ue8m0")
    assert q.dtype == torch.float8_e4m3fn
    scores = indexer_scores(q, weights, cache, step.rows, qbs)
    ref_scores, _ = reference_indexer(step, q, weights, cache, head_dim, qbs, 8)
    live = step.live
    assert torch.equal(torch.isinf(scores[live]), torch.isinf(ref_scores[live]))
    finite = ~torch.isinf(ref_scores[live])
    close(scores[live][finite], ref_scores[live][finite], slice(None))


@pytest.mark.parametrize("name,cache_dtype", [("llama", "auto"), ("llama", "fp8"), ("deepseek_v2", "fp8_ds_mla"),
                                              ("deepseek_v32", "fp8_ds_mla")])
def test_model_kernel_paths_match_reference_paths(name, cache_dtype):
    """A workload through the engine (prefill chunks, decode rows, a shared prefix): each step's
    hidden rows from the kernel path agree with the reference path on the same caches."""
    from pcppass.engine import WorkloadConfig
    from pcppass.models import build_model

    assert os.environ["TRITON_INTERPRET"] == "1"
    errors = kernel_vs_reference_run(
        build_model(name, "tiny", kv_cache_dtype=cache_dtype),
        dict(num_blocks=48, max_num_batched_tokens=20, max_model_len=48),
        WorkloadConfig(num_requests=2, prompt_len=(6, 16), max_new_tokens=(3, 4), prefix_hit_rate=0.5, block_size=8,
                       vocab_size=256))
    # fp8 caches: a last-bit difference in layer 1 can move one fp8 code that layer 2 writes
    assert len(errors) >= 4 and max(errors) < (1e-3 if cache_dtype == "fp8" else 1e-5), errors


def _sharded_kernel_steps(rank, world, name):
    from pcppass.compiler import PcpBackend
    from pcppass.bench.inputs import DecodeSetup, caches_equal_across_ranks, owned
    from pcppass.models import build_model
    from pcppass.models.common import force_paged_kernels

    with force_paged_kernels(True):
        model = build_model(name, "tiny")
        setup = DecodeSetup(model, requests=4, max_context=9, extra=4, seed=3, device="cpu")
        backend = PcpBackend(schedule="deferred", inner="eager")
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        for step in range(3):
            compiled(*setup.step(owned(4, world, rank, step), 9, 9 + step), setup.caches)
    ops = {str(n.target) for r in backend.reports for n in r.graph.graph.nodes if n.op == "call_function"}
    return caches_equal_across_ranks(setup.caches), [r.mode for r in backend.reports], ops


@pytest.mark.timeout(300)
def test_kernel_paths_shard_under_the_backend():
    """DeepSeek-V3.2's kernel path (indexer + top-k + sparse MLA in one read-only op) traces, is
    fully covered, shards with one deferred sync, and keeps replicas equal at P = 2."""
    from pcppass.engine.launch import launch

    for equal, modes, ops in launch(_sharded_kernel_steps, 2, "deepseek_v32", backend="gloo", timeout_s=280):
        assert all(equal.values()) and modes == ["sharded"]
        assert "pcppass.indexer_sparse_mla_attention" in ops
