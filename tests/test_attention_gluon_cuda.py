"""The Gluon MLA kernels over fp8_ds_mla rows (what the launcher runs on Hopper): DeepSeek-V3.2's
sparse MLA (``gluon_kernels.sparse_mla_kernel``) and dense MLA (DeepSeek-V2's 16 heads per program,
``gluon_kernels.dense_mla_kernel``), against a float32 reference and the Triton kernel (skipped
without an sm_90 GPU).

The kernel rounds every latent value once to float16 in units of its key tile's largest scale, so
the tests draw caches whose scales differ from key to key inside a tile (up to 2^11) and from tile
to tile (2^40), rows whose picks are partly unused, a row at position 0 and padding rows, at each
split the launcher picks for 4 to 32 decode rows per rank; and check what must hold bitwise: a row
alone and among others, a CUDA-graph replay, and queries or caches scaled by powers of two.
"""

from dataclasses import replace

import pytest
import torch

from attention_cases import make_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs a Hopper GPU (sm_90)")

HEADS, LATENT, ROPE, TOPK = 128, 512, 64, 2048
SCALE = 0.07


def v32_cache(step, magnitudes: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla rows of random latents, key ``n``'s latent and RoPE values times ``magnitudes[n]``
    (float32), so its tile scales are too."""
    from pcppass.ops.quant import encode_ds_mla_rows

    g = torch.Generator(device="cuda").manual_seed(11)
    kv = torch.randn(step.num_blocks * step.block_size, LATENT + ROPE, device="cuda", generator=g)
    kv = kv * magnitudes[:, None]
    return encode_ds_mla_rows(kv[:, :LATENT], kv[:, LATENT:]).view(step.num_blocks, step.block_size, -1)


def scaled_cache(step, small_keys_win: bool) -> torch.Tensor:
    """fp8_ds_mla rows of keys whose magnitudes are 2^-11..2^0 at random (inside every 64-key
    block), times 2^20 or 2^-20 by block (tiles 2^40 apart); with ``small_keys_win`` the large
    keys are negative, so queries of positive values give them no weight."""
    from pcppass.ops.quant import encode_ds_mla_rows

    g = torch.Generator(device="cuda").manual_seed(9)
    n = step.num_blocks * 64
    inside = torch.exp2(-11 * torch.rand(n, device="cuda", generator=g))
    large = torch.arange(n, device="cuda") // 64 % 2 == 0
    kv = torch.randn(n, LATENT + ROPE, device="cuda", generator=g)
    if small_keys_win:
        kv = torch.where(large[:, None], -kv.abs(), kv)
    kv = kv * (inside * torch.where(large, 2.0**20, 2.0**-20))[:, None]
    return encode_ds_mla_rows(kv[:, :LATENT], kv[:, LATENT:]).view(step.num_blocks, 64, -1)


def float32_reference(step, q_lat, q_pe, cache, index) -> torch.Tensor:
    """``softmax(q_lat . kv + q_pe . k_pe) @ kv`` over the picks in float32, the cache's values
    decoded exactly (no bf16 rounding of the dequantised latents)."""
    from pcppass.ops.quant import decode_ds_mla_rows

    rows, valid = step.gathered(cache, index)
    kv_c, k_pe = decode_ds_mla_rows(rows, LATENT, ROPE)
    scores = torch.einsum("thl,tsl->ths", q_lat.float(), kv_c) + torch.einsum("thr,tsr->ths", q_pe.float(), k_pe.float())
    scores = scores.mul(SCALE).masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("ths,tsl->thl", torch.softmax(scores, -1).nan_to_num(), kv_c)


def head_errors(out, ref, live) -> torch.Tensor:
    """Per (row, head): the largest error over the largest reference value of that head."""
    out, ref = out[live].float(), ref[live].float()
    return (out - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)


def picks(step, unused_every: int = 0, k: int = TOPK) -> torch.Tensor:
    """Each row's top-k stand-in: ``k`` distinct visible positions, ascending, -1 past a short
    row's positions and (``unused_every``) at every such pick."""
    g = torch.Generator(device="cuda").manual_seed(5)
    out = torch.full((step.rows.positions.shape[0], k), -1, dtype=torch.int64, device="cuda")
    for r, p in enumerate(step.rows.positions.tolist()):
        chosen = torch.randperm(p + 1, device="cuda", generator=g)[:k].sort().values
        out[r, :chosen.shape[0]] = chosen
    if unused_every:
        out[:, ::unused_every] = -1
    return out


def both_kernels(q_lat, q_pe, cache, step, index, rows_per_rank=None):
    """(Gluon output, Triton output) of the launcher's sparse MLA."""
    from pcppass.engine.attention import launch

    assert launch.gluon_sparse_fits(q_lat, q_pe, cache, True)
    with launch.decode_rows_per_rank(rows_per_rank):
        tiles = launch.sparse_tiles(HEADS, index.shape[1], q_lat.device)
        gluon = launch.mla_attention(q_lat, q_pe, cache, step.rows, SCALE, True, index, tiles=tiles)
        triton = launch.mla_attention(q_lat, q_pe, cache, step.rows, SCALE, True, index,
                                      tiles=replace(tiles, gluon=False))
    return gluon, triton


def queries(t: int, seed: int = 3, heads: int = HEADS):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(t, heads, LATENT, device="cuda", generator=g).to(torch.bfloat16),
            torch.randn(t, heads, ROPE, device="cuda", generator=g).to(torch.bfloat16))


@pytest.mark.parametrize("rows_per_rank", [4, 8, 16, 32])
def test_sparse_mla_gluon_matches_float32_reference(rows_per_rank):
    """Rows of 3000-4500 positions, one of 700 (most picks unused), one at position 0, every
    fifth pick unused, two padding rows; each split the launcher picks for 4 / 8 / 16 / 32 rows
    per rank. The Gluon kernel is at least as close to the float32 reference as the Triton kernel
    (whose bf16 values round at 2^-9), and padding rows are zeros."""
    step = make_step([(1, 3000 + 301 * i) for i in range(5)] + [(1, 700), (1, 0)], 2, 64, 80, device="cuda")
    t = step.rows.positions.shape[0]
    cache = v32_cache(step, torch.ones(step.num_blocks * 64, device="cuda"))
    index = picks(step, unused_every=5)
    q_lat, q_pe = queries(t)
    gluon, triton = both_kernels(q_lat, q_pe, cache, step, index, rows_per_rank)
    ref = float32_reference(step, q_lat, q_pe, cache, index)
    err_gluon = float(head_errors(gluon, ref, step.live).max())
    err_triton = float(head_errors(triton, ref, step.live).max())
    print(f"{rows_per_rank} rows per rank: largest per-head error, Gluon {err_gluon:.1e}, Triton {err_triton:.1e}")
    assert err_gluon < 1e-2 and err_gluon <= err_triton * 1.1
    assert not gluon[~step.live].any() and gluon.isfinite().all()


def test_sparse_mla_gluon_one_split_writes_the_output_directly():
    """512 picks per row, fewer than a split's 1024: one split, the output normalised by the kernel
    itself (no partials, no combine); a padding row stays zeros."""
    step = make_step([(1, 900 + 211 * i) for i in range(5)] + [(1, 300)], 1, 64, 40, device="cuda")
    index = picks(step, unused_every=7, k=512)
    cache = v32_cache(step, torch.ones(step.num_blocks * 64, device="cuda"))
    q_lat, q_pe = queries(step.rows.positions.shape[0])
    gluon, triton = both_kernels(q_lat, q_pe, cache, step, index)  # 1024 picks per split
    ref = float32_reference(step, q_lat, q_pe, cache, index)
    err = float(head_errors(gluon, ref, step.live).max())
    print(f"one split: largest per-head error {err:.1e} (Triton {float(head_errors(triton, ref, step.live).max()):.1e})")
    assert err < 1e-2
    assert not gluon[~step.live].any() and gluon.isfinite().all()


@pytest.mark.parametrize("small_keys_win", [False, True])
def test_sparse_mla_gluon_scales_across_and_inside_tiles(small_keys_win):
    """Each row picks its first 2048 positions, so each tile of 32 picks is half a block. Keys'
    magnitudes: 2^-11..2^0 at random (inside every tile), times 2^20 or 2^-20 by block (tiles 2^40
    apart). With queries and large keys of opposite signs (``small_keys_win``) the large keys get no
    weight and the output is the small keys' (the accumulators move between units 2^40 apart);
    otherwise the large keys carry it. Every head within 1e-2 of the float32 reference."""
    step = make_step([(1, 4000 + 97 * i) for i in range(4)], 0, 64, 80, device="cuda")
    cache = scaled_cache(step, small_keys_win)
    index = torch.arange(TOPK, device="cuda").expand(step.rows.positions.shape[0], TOPK).contiguous()
    q_lat, q_pe = queries(step.rows.positions.shape[0])
    if small_keys_win:
        q_lat, q_pe = q_lat.abs(), q_pe.abs()
    gluon, triton = both_kernels(q_lat, q_pe, cache, step, index, 32)
    ref = float32_reference(step, q_lat, q_pe, cache, index)
    errors = head_errors(gluon, ref, step.live)
    print(f"tiles 2^40 apart, small keys {'win' if small_keys_win else 'lose'}: largest per-head error "
          f"{float(errors.max()):.1e} (Triton {float(head_errors(triton, ref, step.live).max()):.1e})")
    assert float(errors.max()) < 1e-2


def test_sparse_mla_gluon_powers_of_two_give_the_same_bytes():
    """Queries 2^24 and 2^-40 times larger with the scale divided back, and a cache whose values
    are 2^24 or 2^-24 times larger with the queries divided back: the very bytes (times the
    cache's factor), since every unit the kernel picks is a power of two."""
    from pcppass.engine.attention import launch

    step = make_step([(1, 3500 + 11 * i) for i in range(3)], 0, 64, 64, device="cuda")
    n = step.num_blocks * 64
    index = picks(step)
    q_lat, q_pe = queries(step.rows.positions.shape[0])
    cache = v32_cache(step, torch.ones(n, device="cuda"))
    with launch.decode_rows_per_rank(32):
        base = launch.mla_attention(q_lat, q_pe, cache, step.rows, SCALE, True, index)
        for magnitude in (24, -40):
            up = 2.0**magnitude
            got = launch.mla_attention(q_lat * up, q_pe * up, cache, step.rows, SCALE / up, True, index)
            assert torch.equal(got, base), magnitude
        for magnitude in (24, -24):
            up = 2.0**magnitude
            scaled = v32_cache(step, torch.full((n,), up, device="cuda"))
            got = launch.mla_attention(q_lat / up, q_pe / up, scaled, step.rows, SCALE, True, index)
            assert torch.equal(got, base * up), magnitude


def test_sparse_mla_gluon_rows_do_not_depend_on_their_step_and_graph_replays_match():
    """Row 0 alone and among 40 others: the same bytes; a CUDA-graph replay gives the eager bytes;
    a row whose picks are all unused gives zeros."""
    from pcppass.engine.attention import launch

    many = make_step([(1, 2500 + 53 * i) for i in range(41)], 0, 64, 80, device="cuda")
    r = many.rows
    first = launch.StepRows(r.tables[:1], r.positions[:1], r.token_to_req[:1], r.query_start_loc[:2],
                            r.is_padding[:1])
    cache = v32_cache(many, torch.ones(many.num_blocks * 64, device="cuda"))
    index = picks(many)
    index[7] = -1
    q_lat, q_pe = queries(41)
    with launch.decode_rows_per_rank(32):
        eager = launch.mla_attention(q_lat, q_pe, cache, r, SCALE, True, index)
        alone = launch.mla_attention(q_lat[:1], q_pe[:1], cache, first, SCALE, True, index[:1])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = launch.mla_attention(q_lat, q_pe, cache, r, SCALE, True, index)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(alone, eager[:1])
    assert torch.equal(captured, eager)
    assert not eager[7].any()


# --- dense MLA (every visible position), DeepSeek-V2 widths -------------------------------------


@pytest.fixture
def dense_tiles():
    """The launcher's dense fp8_ds_mla launch shape (on Hopper: the warp-specialised
    ``gluon_kernels.dense_mla_kernel``)."""
    from pcppass.engine.attention import launch

    return launch.MLA_FP8_TILES


def dense_kernels(q_lat, q_pe, cache, step, tiles):
    """(Gluon output, Triton output) of dense fp8_ds_mla MLA."""
    from pcppass.engine.attention import launch

    schedule = launch.tile_schedule(step.rows.query_start_loc, q_lat.shape[0], 1)
    assert launch.gluon_dense_fits(q_lat, q_pe, cache, True, schedule)
    gluon = launch.mla_attention(q_lat, q_pe, cache, step.rows, SCALE, True, tiles=tiles)
    triton = launch.mla_attention(q_lat, q_pe, cache, step.rows, SCALE, True, tiles=launch.MLA_FP8_TRITON_TILES)
    return gluon, triton


def dense_reference(step, q_lat, q_pe, cache) -> torch.Tensor:
    return float32_reference(step, q_lat, q_pe, cache, None)


@pytest.mark.parametrize("heads", [16, 8, 32])
def test_dense_mla_gluon_matches_float32_reference(heads, dense_tiles):
    """Rows of 3000-4500 positions (four or five splits of 1024 keys, the last split partial), a
    request of three consecutive rows, a row of 700 positions, one at position 0, two padding rows;
    16 heads (one program per row), 8 (padded to 16) and 32 (two programs per row). The Gluon
    kernel is at least as close to the float32 reference as the Triton kernel and padding rows are
    zeros."""
    step = make_step([(1, 3000 + 301 * i) for i in range(5)] + [(3, 2000), (1, 700), (1, 0)], 2, 64, 80,
                     device="cuda")
    cache = v32_cache(step, torch.ones(step.num_blocks * 64, device="cuda"))
    q_lat, q_pe = queries(step.rows.positions.shape[0], heads=heads)
    gluon, triton = dense_kernels(q_lat, q_pe, cache, step, dense_tiles)
    ref = dense_reference(step, q_lat, q_pe, cache)
    err_gluon = float(head_errors(gluon, ref, step.live).max())
    err_triton = float(head_errors(triton, ref, step.live).max())
    print(f"dense, {heads} heads: largest per-head error, Gluon {err_gluon:.1e}, Triton {err_triton:.1e}")
    assert err_gluon < 1e-2 and err_gluon <= err_triton * 1.1
    assert not gluon[~step.live].any() and gluon.isfinite().all()


def test_dense_mla_gluon_values_alone(dense_tiles):
    """Rows of 1 to 3001 positions over a cache whose every row is the same (whatever the scores,
    the output is that row's latent), then zero queries (every visible key weighs the same: the
    output is the mean of the row's latents): the values path without the scores', within 5e-3 of
    the float32 reference for every row length."""
    lengths = [0, 1, 16, 63, 64, 65, 127, 128, 200, 1000, 2047, 2048, 3000]
    step = make_step([(1, p) for p in lengths], 0, 64, 80, device="cuda")
    cache = v32_cache(step, torch.ones(step.num_blocks * 64, device="cuda"))
    same = cache.clone()
    same.view(torch.uint8).flatten(0, 1)[:] = cache.view(torch.uint8).flatten(0, 1)[3]
    q_lat, q_pe = queries(len(lengths), heads=16)
    for kv, q, qpe, case in ((same, q_lat, q_pe, "one row everywhere"), (cache, q_lat * 0, q_pe * 0, "zero queries")):
        got, _ = dense_kernels(q, qpe, kv, step, dense_tiles)
        errors = head_errors(got, dense_reference(step, q, qpe, kv), step.live).amax(-1)
        print(f"dense, {case}: largest per-head error by row length",
              " ".join(f"{p}:{float(e):.1e}" for p, e in zip(lengths, errors)))
        assert float(errors.max()) < 5e-3, case


def test_dense_mla_gluon_blocks_of_16_padded_rows_and_poisoned_dead_keys(dense_tiles):
    """Blocks of 16 keys (four TMA boxes per 64-key tile), cache rows 768 bytes apart, and in the
    kernel's copy every row no query may see filled with 0xFF (NaN codes, scales and RoPE values):
    the very bytes of the clean, unpadded cache's output (the dead keys are copied, then masked),
    within 1e-2 of the float32 reference."""
    from pcppass.engine.attention import launch

    step = make_step([(1, 3000 + 301 * i) for i in range(5)] + [(1, 700), (1, 0)], 1, 16, 270, device="cuda")
    clean = v32_cache(step, torch.ones(step.num_blocks * 16, device="cuda"))
    poisoned = torch.full((step.num_blocks, 16, 768), 0xFF, dtype=torch.uint8, device="cuda")[..., :656]
    visible = torch.zeros(step.num_blocks * 16, dtype=torch.bool, device="cuda")
    r = step.rows
    for t in range(r.positions.shape[0]):
        if not r.is_padding[t]:
            j = torch.arange(int(r.positions[t]) + 1, device="cuda")
            visible[r.tables[r.token_to_req[t]][j // 16] * 16 + j % 16] = True
    poisoned.flatten(0, 1)[visible] = clean.view(torch.uint8).flatten(0, 1)[visible]
    assert not visible.all()
    q_lat, q_pe = queries(r.positions.shape[0], heads=16)
    schedule = launch.tile_schedule(r.query_start_loc, q_lat.shape[0], 1)
    assert launch.gluon_dense_fits(q_lat, q_pe, poisoned, True, schedule)
    got = launch.mla_attention(q_lat, q_pe, poisoned, r, SCALE, True, tiles=dense_tiles)
    want = launch.mla_attention(q_lat, q_pe, clean, r, SCALE, True, tiles=dense_tiles)
    assert torch.equal(got, want)
    err = float(head_errors(got, dense_reference(step, q_lat, q_pe, clean), step.live).max())
    print(f"dense, blocks of 16, padded and poisoned rows: largest per-head error {err:.1e}")
    assert err < 1e-2


def test_dense_mla_gluon_one_split_writes_the_output_directly(dense_tiles):
    """Block tables of 16 blocks (1024 keys, one split): the kernel normalises and writes the
    output itself; a padding row stays zeros."""
    step = make_step([(1, 500 + 101 * i) for i in range(5)] + [(1, 1023)], 1, 64, 16, device="cuda")
    cache = v32_cache(step, torch.ones(step.num_blocks * 64, device="cuda"))
    q_lat, q_pe = queries(step.rows.positions.shape[0], heads=16)
    gluon, triton = dense_kernels(q_lat, q_pe, cache, step, dense_tiles)
    ref = dense_reference(step, q_lat, q_pe, cache)
    err = float(head_errors(gluon, ref, step.live).max())
    print(f"dense, one split: largest per-head error {err:.1e} "
          f"(Triton {float(head_errors(triton, ref, step.live).max()):.1e})")
    assert err < 1e-2
    assert not gluon[~step.live].any() and gluon.isfinite().all()


@pytest.mark.parametrize("small_keys_win", [False, True])
def test_dense_mla_gluon_scales_across_and_inside_tiles(small_keys_win, dense_tiles):
    """Each 64-key tile is one block of the cache. Keys' magnitudes 2^-11..2^0 at random (inside
    every tile), times 2^20 or 2^-20 by block (tiles 2^40 apart); with queries and large keys of
    opposite signs (``small_keys_win``) the output is the small keys'. Every head within 1e-2 of
    the float32 reference."""
    step = make_step([(1, 4000 + 97 * i) for i in range(4)], 0, 64, 80, device="cuda")
    cache = scaled_cache(step, small_keys_win)
    q_lat, q_pe = queries(step.rows.positions.shape[0], heads=16)
    if small_keys_win:
        q_lat, q_pe = q_lat.abs(), q_pe.abs()
    gluon, triton = dense_kernels(q_lat, q_pe, cache, step, dense_tiles)
    ref = dense_reference(step, q_lat, q_pe, cache)
    errors = head_errors(gluon, ref, step.live)
    print(f"dense, tiles 2^40 apart, small keys {'win' if small_keys_win else 'lose'}: largest per-head error "
          f"{float(errors.max()):.1e} (Triton {float(head_errors(triton, ref, step.live).max()):.1e})")
    assert float(errors.max()) < 1e-2


def test_dense_mla_gluon_powers_of_two_give_the_same_bytes(dense_tiles):
    """Queries 2^24 and 2^-40 times larger with the scale divided back, and caches 2^24 or 2^-24
    times larger with the queries divided back: the very bytes (times the cache's factor)."""
    from pcppass.engine.attention import launch

    step = make_step([(1, 3500 + 11 * i) for i in range(3)], 0, 64, 64, device="cuda")
    n = step.num_blocks * 64
    q_lat, q_pe = queries(step.rows.positions.shape[0], heads=16)
    cache = v32_cache(step, torch.ones(n, device="cuda"))
    base = launch.mla_attention(q_lat, q_pe, cache, step.rows, SCALE, True, tiles=dense_tiles)
    for magnitude in (24, -40):
        up = 2.0**magnitude
        got = launch.mla_attention(q_lat * up, q_pe * up, cache, step.rows, SCALE / up, True, tiles=dense_tiles)
        assert torch.equal(got, base), magnitude
    for magnitude in (24, -24):
        up = 2.0**magnitude
        scaled = v32_cache(step, torch.full((n,), up, device="cuda"))
        got = launch.mla_attention(q_lat / up, q_pe / up, scaled, step.rows, SCALE, True, tiles=dense_tiles)
        assert torch.equal(got, base * up), magnitude


def test_dense_mla_gluon_rows_do_not_depend_on_their_step_and_graph_replays_match(dense_tiles):
    """Row 0 alone and among 40 others: the same bytes; a CUDA-graph replay gives the eager bytes."""
    from pcppass.engine.attention import launch

    many = make_step([(1, 2500 + 53 * i) for i in range(41)], 0, 64, 80, device="cuda")
    r = many.rows
    first = launch.StepRows(r.tables[:1], r.positions[:1], r.token_to_req[:1], r.query_start_loc[:2],
                            r.is_padding[:1])
    cache = v32_cache(many, torch.ones(many.num_blocks * 64, device="cuda"))
    q_lat, q_pe = queries(41, heads=16)
    eager = launch.mla_attention(q_lat, q_pe, cache, r, SCALE, True, tiles=dense_tiles)
    alone = launch.mla_attention(q_lat[:1], q_pe[:1], cache, first, SCALE, True, tiles=dense_tiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = launch.mla_attention(q_lat, q_pe, cache, r, SCALE, True, tiles=dense_tiles)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(alone, eager[:1])
    assert torch.equal(captured, eager)
