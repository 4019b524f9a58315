"""DeepSeek-V4 compressor ops over several decode-like steps, against a slow per-token python loop
that works from the raw per-position kv / score values (not from the state cache), so the ring
addressing of the state cache is checked too."""

import math

import pytest
import torch

from kernels_cases import case_compressor_save_state, clone_args, cos_sin_table, gen
from pcppass.ops.quant import decode_indexer_cache, split_indexer_cache

ops = torch.ops.pcppass


def test_save_state_rows_exact_and_padding_skipped():
    args = case_compressor_save_state(overlap=True)
    before = clone_args(args)
    ops.compressor_save_state(**args)
    expected = before["state_cache"].clone()
    bs = expected.shape[1]
    ratio = args["compress_ratio"]
    for t, s in enumerate(args["slot_mapping"].tolist()):
        if s >= 0:
            p = int(args["positions"][t])
            score = args["score"][t].float() + args["ape"][p % ratio]
            expected[s // bs, s % bs] = torch.cat((args["kv"][t].float(), score))
    assert torch.equal(args["state_cache"], expected)


def reference_compressed_row(kv_all, score_all, ape, p, ratio, overlap, hd, norm_weight, eps, cos_sin):
    """One compressed row, token by token, in float64."""
    entries = []
    if overlap and p - 2 * ratio + 1 >= 0:
        for q in range(p - 2 * ratio + 1, p - ratio + 1):
            entries.append((kv_all[q, :hd], score_all[q, :hd].float() + ape[q % ratio, :hd]))
    half = slice(hd, 2 * hd) if overlap else slice(0, hd)
    for q in range(p - ratio + 1, p + 1):
        entries.append((kv_all[q, half], score_all[q, half].float() + ape[q % ratio, half]))
    kv = torch.stack([e[0].double() for e in entries])
    score = torch.stack([e[1].double() for e in entries])
    weights = torch.exp(score - score.max(dim=0).values)
    weights = weights / weights.sum(dim=0)
    pooled = (weights * kv).sum(dim=0)
    normed = pooled / torch.sqrt((pooled * pooled).mean() + eps) * norm_weight.double()
    rot = cos_sin.shape[1]
    cos, sin = cos_sin[p // ratio, : rot // 2].double(), cos_sin[p // ratio, rot // 2 :].double()
    out = normed.clone()
    for i in range(rot // 2):
        a, b = normed[hd - rot + 2 * i], normed[hd - rot + 2 * i + 1]
        out[hd - rot + 2 * i] = a * cos[i] - b * sin[i]
        out[hd - rot + 2 * i + 1] = b * cos[i] + a * sin[i]
    return out


@pytest.mark.parametrize(
    "overlap,ratio,kv_cache_dtype",
    [(True, 4, "auto"), (False, 8, "auto"), (True, 4, "fp8_indexer")],
)
def test_compress_store_over_steps_matches_per_token_loop(overlap, ratio, kv_cache_dtype):
    g = gen(20)
    hd, coff, bs_state, step_tokens, qbs = 16, 2 if overlap else 1, 4, 3, 8
    width = coff * hd
    ring_blocks = math.ceil((coff * ratio + step_tokens) / bs_state)  # window + one step's positions
    ring_tables = {"a": [5, 1, 6, 4][:ring_blocks], "b": [2, 7, 0, 3][:ring_blocks]}
    compressed_tables = {"a": [3, 0], "b": [1, 2]}
    lengths = {"a": 29, "b": 22}
    nb, bs = 4, 4
    kv_all = {r: torch.randn(n, width, generator=g).bfloat16() for r, n in lengths.items()}
    score_all = {r: torch.randn(n, width, generator=g).bfloat16() for r, n in lengths.items()}
    ape = torch.randn(ratio, width, generator=g)
    norm_weight = torch.randn(hd, generator=g)
    cos_sin = cos_sin_table(16, 8)
    state_cache = torch.randn(8, bs_state, 2 * width, generator=g)
    if kv_cache_dtype == "auto":
        compressed = torch.randn(nb, bs, hd, generator=g)
    else:
        compressed = torch.randint(0, 256, (nb, bs * (hd + 4 * (hd // qbs))), generator=g, dtype=torch.uint8)
    compressed_before = compressed.clone()

    def ring_slot(r, p):
        q = p % (len(ring_tables[r]) * bs_state)
        return ring_tables[r][q // bs_state] * bs_state + q % bs_state

    def compressed_slot(r, p):
        if (p + 1) % ratio:
            return -1
        c = p // ratio
        return compressed_tables[r][c // bs] * bs + c % bs

    written = {}
    for start in range(0, max(lengths.values()), step_tokens):
        rows = [(r, p) for r in ("a", "b") for p in range(start, min(start + step_tokens, lengths[r]))]
        rows.append(None)  # one padding row per step
        kv = torch.stack([kv_all[x[0]][x[1]] if x else torch.full((width,), float("nan")).bfloat16() for x in rows])
        score = torch.stack([score_all[x[0]][x[1]] if x else torch.zeros(width).bfloat16() for x in rows])
        positions = torch.tensor([x[1] if x else 0 for x in rows])
        state_slots = torch.tensor([ring_slot(*x) if x else -1 for x in rows])
        table = torch.tensor([ring_tables[x[0]] if x else [0] * ring_blocks for x in rows])
        slots = torch.tensor([compressed_slot(*x) if x else -1 for x in rows])
        ops.compressor_save_state(kv, score, ape, positions, state_cache, state_slots, ratio)
        ops.compressor_compress_store(positions, state_cache, table, norm_weight, 1e-6, cos_sin, compressed, slots,
                                      ratio, overlap, kv_cache_dtype, qbs)
        for x, s in zip(rows, slots.tolist()):
            if s >= 0:
                written[s] = x

    assert len(written) == 29 // ratio + 22 // ratio
    if kv_cache_dtype == "auto":
        decoded = compressed
    else:
        decoded = decode_indexer_cache(compressed, hd, qbs)
        scales = split_indexer_cache(compressed, hd, qbs)[1]
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    for s, (r, p) in written.items():
        untouched[s] = False
        want = reference_compressed_row(kv_all[r], score_all[r], ape, p, ratio, overlap, hd, norm_weight, 1e-6,
                                        cos_sin)
        got = decoded[s // bs, s % bs].double()
        if kv_cache_dtype == "auto":
            # float32 pipeline vs float64 loop: a few float32 roundings of O(1) values
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            scale = scales[s // bs, s % bs]
            mantissa, _ = torch.frexp(scale)
            assert bool((mantissa == 0.5).all())  # ue8m0: powers of two
            block_scale = scale.repeat_interleave(qbs).double()
            bound = want.abs() / 16 + block_scale * 2.0**-10 + 1e-5 * (want.abs() + 1)
            assert bool(((got - want).abs() <= bound).all())
    if kv_cache_dtype == "auto":
        assert torch.equal(compressed.view(nb * bs, hd)[untouched], compressed_before.view(nb * bs, hd)[untouched])
    else:
        for now, then in zip(split_indexer_cache(compressed, hd, qbs), split_indexer_cache(compressed_before, hd, qbs)):
            assert torch.equal(now.flatten(0, 1)[untouched].view(torch.uint8), then.flatten(0, 1)[untouched].view(torch.uint8))
