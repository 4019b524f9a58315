"""Fused ops (DeepSeek-V3.2 fused_norm_rope, DeepSeek-V4 SWA insert): byte-identical to the unfused
ops on the same normalised / rotated inputs, whole-token skip for slot -1, and the shared norm /
RoPE helpers checked against independent formulas."""

import pytest
import torch
import torch.nn.functional as F

from kernels_cases import (
    case_fused_norm_rope,
    case_swa_qnorm_rope_kv_insert,
    clone_args,
    cos_sin_table,
    gen,
)
from pcppass.ops.math import layer_norm, rms_norm, rope

ops = torch.ops.pcppass


# ---------------------------------------------------------------------------------- helpers


def test_norm_helpers_match_torch_functional():
    g = gen(10)
    x, w, b = torch.randn(5, 32, generator=g), torch.randn(32, generator=g), torch.randn(32, generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), F.rms_norm(x, (32,), w, 1e-6), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer_norm(x, w, b, 1e-6), F.layer_norm(x, (32,), w, b, 1e-6), rtol=1e-5, atol=1e-5)
    assert rms_norm(x.bfloat16(), None, 1e-6).dtype == torch.bfloat16


def test_rope_interleaved_is_complex_rotation_of_pairs():
    g = gen(11)
    x = torch.randn(4, 2, 24, generator=g, dtype=torch.float64).float()
    pos = torch.tensor([0, 3, 7, 15])
    table = cos_sin_table(16, 8)
    out = rope(x, pos, table, "interleaved", "last")
    assert torch.equal(out[..., :16], x[..., :16])  # only the last rot_dim dims move
    angles = torch.atan2(table[pos, 4:].double(), table[pos, :4].double()).unsqueeze(1)
    pairs = torch.view_as_complex(x[..., 16:].double().reshape(4, 2, 4, 2).contiguous())
    want = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)
    torch.testing.assert_close(out[..., 16:].double(), want, rtol=1e-6, atol=1e-6)


def test_rope_neox_rotates_halves_of_the_first_dims():
    g = gen(12)
    x = torch.randn(3, 20, generator=g)
    pos = torch.tensor([1, 2, 9])
    table = cos_sin_table(10, 8)
    out = rope(x, pos, table, "neox", "first")
    assert torch.equal(out[:, 8:], x[:, 8:])
    cos, sin = table[pos, :4], table[pos, 4:]
    x1, x2 = x[:, :4], x[:, 4:8]
    torch.testing.assert_close(out[:, :4], x1 * cos - x2 * sin, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:, 4:8], x2 * cos + x1 * sin, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ fused_norm_rope


@pytest.mark.parametrize("mla_kv_cache_dtype", ["auto", "fp8", "fp8_ds_mla"])
def test_fused_norm_rope_equals_unfused_ops(mla_kv_cache_dtype):
    args = case_fused_norm_rope(mla_kv_cache_dtype)
    unfused = clone_args(args)
    before = clone_args(args)
    q_out = ops.fused_norm_rope(**args)

    u = unfused
    live = u["slot_mapping"] >= 0
    kv_c_normed = rms_norm(u["kv_c"], u["kv_norm_weight"], u["kv_eps"])
    k_pe_roped = rope(u["k_pe"], u["positions"], u["cos_sin_cache"], "interleaved")
    ops.concat_and_cache_mla(kv_c_normed, k_pe_roped, u["mla_kv_cache"], u["slot_mapping"],
                             mla_kv_cache_dtype, u["mla_k_scale"])
    index_k = rope(layer_norm(u["index_k"], u["index_norm_weight"], u["index_norm_bias"], u["index_eps"]),
                   u["positions"], u["index_cos_sin_cache"], "neox", "first")
    # a skipped token writes neither cache: its indexer slot is masked in the unfused form
    indexer_slots = torch.where(live, u["indexer_slot_mapping"], -1)
    ops.indexer_k_quant_and_cache(index_k, u["indexer_k_cache"], indexer_slots, u["quant_block_size"], "ue8m0")

    assert torch.equal(args["mla_kv_cache"].view(torch.uint8), u["mla_kv_cache"].view(torch.uint8))
    assert torch.equal(args["indexer_k_cache"], u["indexer_k_cache"])
    q_ref = rms_norm(u["q_c"], u["q_norm_weight"], u["q_eps"])
    assert torch.equal(q_out[live], q_ref[live])
    assert bool((q_out[~live] == 0).all())  # whole-token skip: zero Q rows (row 4 held NaNs)
    # the op really wrote: the caches changed at the live rows
    assert not torch.equal(args["mla_kv_cache"].view(torch.uint8), before["mla_kv_cache"].view(torch.uint8))
    assert not torch.equal(args["indexer_k_cache"], before["indexer_k_cache"])


def test_fused_norm_rope_skipped_token_skips_its_indexer_row():
    """Row 1 has slot -1 but a live indexer slot: the whole token is skipped."""
    args = case_fused_norm_rope("auto")
    args["slot_mapping"] = torch.full_like(args["slot_mapping"], -1)
    before = clone_args(args)
    q_out = ops.fused_norm_rope(**args)
    assert torch.equal(args["indexer_k_cache"], before["indexer_k_cache"])
    assert torch.equal(args["mla_kv_cache"], before["mla_kv_cache"])
    assert bool((q_out == 0).all())


# ------------------------------------------------------------------------ swa_qnorm_rope_kv_insert


def test_swa_qnorm_rope_kv_insert_matches_unfused_and_skips_whole_tokens():
    args = case_swa_qnorm_rope_kv_insert()
    before = clone_args(args)
    q_out = ops.swa_qnorm_rope_kv_insert(**args)
    live = args["slot_mapping"] >= 0
    q_ref = rope(rms_norm(args["q"], None, args["eps"]), args["positions"], args["cos_sin_cache"],
                 "interleaved", "last")
    assert torch.equal(q_out[live], q_ref[live])
    assert bool((q_out[~live] == 0).all())
    kv_ref = rope(args["kv"], args["positions"], args["cos_sin_cache"], "interleaved", "last")
    expected = before["swa_cache"].clone()
    bs = expected.shape[1]
    for t, s in enumerate(args["slot_mapping"].tolist()):
        if s >= 0:
            expected[s // bs, s % bs] = kv_ref[t]
    assert torch.equal(args["swa_cache"], expected)
    # the non-rotated part of kv is stored as given
    s0 = int(args["slot_mapping"][1])
    assert torch.equal(args["swa_cache"][s0 // bs, s0 % bs, :48], args["kv"][1, :48])
