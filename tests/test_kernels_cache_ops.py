"""Byte layouts of the paged cache-write ops, checked against expectations computed here by hand.

fp8 e4m3 bound used throughout (derived, not tuned): with ``y = x / s`` and ``q`` its
round-to-nearest e4m3 value, ``|q - y| <= |y| * 2**-4`` for normal ``|y| >= 2**-6`` (3 mantissa
bits: half an ulp is ``2**-4`` of the leading power of two) and ``|q - y| <= 2**-10`` in the
subnormal range (spacing ``2**-9``). So ``|q*s - x| <= |x|/16 + s * 2**-10``, plus float32 rounding
of the division and of the product (``<= 2**-22 * |x|`` together, taken generously).
"""

import math

import pytest
import torch

from kernels_cases import (
    case_concat_and_cache_mla,
    case_indexer_k_quant_and_cache,
    case_reshape_and_cache_flash,
    clone_args,
)
from pcppass.ops.quant import decode_ds_mla_rows, decode_indexer_block, decode_indexer_cache

ops = torch.ops.pcppass
FLT_MIN = 1.1754943508222875e-38


def e4m3_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x = x.double().abs()
    return x / 16 + scale.double() * 2.0**-10 + x * 2.0**-22


def assert_fp8_close(decoded: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> None:
    err = (decoded.double() - x.double()).abs()
    bound = e4m3_error_bound(x, scale)
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"


def paged_expected(before: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A per-row python loop: what a paged cache must hold after the write."""
    expected = before.clone()
    bs = before.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[s // bs, s % bs] = rows[t]
    return expected


# ------------------------------------------------------------------------ reshape_and_cache_flash


def test_reshape_and_cache_flash_auto_writes_rows_and_skips_padding():
    args = case_reshape_and_cache_flash("auto", torch.bfloat16)
    before = clone_args(args)
    ops.reshape_and_cache_flash(**args)
    assert torch.equal(args["key_cache"], paged_expected(before["key_cache"], args["slot_mapping"], args["key"]))
    assert torch.equal(args["value_cache"], paged_expected(before["value_cache"], args["slot_mapping"], args["value"]))


def test_reshape_and_cache_flash_auto_converts_to_cache_dtype():
    args = case_reshape_and_cache_flash("auto", torch.float32)
    before = clone_args(args)
    ops.reshape_and_cache_flash(**args)
    assert torch.equal(args["key_cache"],
                       paged_expected(before["key_cache"], args["slot_mapping"], args["key"].float()))


@pytest.mark.parametrize("layout", ["unbind", "hnd"])
def test_reshape_and_cache_flash_strided_caches(layout):
    """Caches are written through their own strides: views of a [2, nb, bs, H, D] tensor, or an
    HND allocation permuted to [nb, bs, H, D]."""
    args = case_reshape_and_cache_flash("auto", torch.bfloat16)
    nb, bs, H, D = args["key_cache"].shape
    if layout == "unbind":
        storage = torch.stack((args["key_cache"], args["value_cache"]))
        key_cache, value_cache = storage.unbind(0)
    else:
        storage = torch.stack((args["key_cache"], args["value_cache"])).permute(0, 1, 3, 2, 4).contiguous()
        key_cache, value_cache = storage[0].permute(0, 2, 1, 3), storage[1].permute(0, 2, 1, 3)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    ops.reshape_and_cache_flash(**{**args, "key_cache": key_cache, "value_cache": value_cache})
    assert torch.equal(key_cache, paged_expected(before_k, args["slot_mapping"], args["key"]))
    assert torch.equal(value_cache, paged_expected(before_v, args["slot_mapping"], args["value"]))


def test_reshape_and_cache_flash_fp8_bits_and_bound():
    args = case_reshape_and_cache_flash("fp8", torch.float8_e4m3fn)
    as_bytes = clone_args({**args, "key_cache": args["key_cache"].view(torch.uint8),
                           "value_cache": args["value_cache"].view(torch.uint8)})
    before = clone_args(args)
    ops.reshape_and_cache_flash(**args)
    ops.reshape_and_cache_flash(**as_bytes)
    k_scale = float(args["k_scale"])
    # expected bits: a per-element round trip through the float8 dtype of the clamped quotient
    expected_rows = torch.stack([
        (args["key"][t].float() / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn) for t in range(6)
    ])
    expected = paged_expected(before["key_cache"], args["slot_mapping"], expected_rows)
    assert torch.equal(args["key_cache"].view(torch.uint8), expected.view(torch.uint8))
    # a uint8 cache holds exactly the same bits
    assert torch.equal(as_bytes["key_cache"], args["key_cache"].view(torch.uint8))
    assert torch.equal(as_bytes["value_cache"], args["value_cache"].view(torch.uint8))
    bs = args["key_cache"].shape[1]
    for t, s in enumerate(args["slot_mapping"].tolist()):
        if s >= 0:
            decoded = args["value_cache"][s // bs, s % bs].float() * float(args["v_scale"])
            assert_fp8_close(decoded, args["value"][t].float(), args["v_scale"])


# --------------------------------------------------------------------------- concat_and_cache_mla


def test_concat_and_cache_mla_auto():
    args = case_concat_and_cache_mla("auto")
    before = clone_args(args)
    ops.concat_and_cache_mla(**args)
    rows = torch.cat((args["kv_c"], args["k_pe"]), dim=1)
    assert torch.equal(args["kv_cache"], paged_expected(before["kv_cache"], args["slot_mapping"], rows))


def test_concat_and_cache_mla_fp8_per_tensor():
    args = case_concat_and_cache_mla("fp8")
    before = clone_args(args)
    ops.concat_and_cache_mla(**args)
    bs = args["kv_cache"].shape[1]
    s_val = float(args["scale"])
    written = torch.zeros(args["kv_cache"].shape[:2], dtype=torch.bool)
    for t, s in enumerate(args["slot_mapping"].tolist()):
        if s < 0:
            continue
        written[s // bs, s % bs] = True
        row = args["kv_cache"][s // bs, s % bs].float() * s_val
        source = torch.cat((args["kv_c"][t], args["k_pe"][t])).float()
        # values past 448 * scale saturate; the rest obey the e4m3 bound
        assert_fp8_close(row, source.clamp(-448 * s_val, 448 * s_val), args["scale"])
    assert torch.equal(args["kv_cache"][~written].view(torch.uint8), before["kv_cache"][~written].view(torch.uint8))


def test_concat_and_cache_mla_fp8_ds_mla_656_byte_rows():
    args = case_concat_and_cache_mla("fp8_ds_mla")
    assert args["kv_cache"].shape[-1] == 656  # DeepSeek: L=512, R=64
    before = clone_args(args)
    ops.concat_and_cache_mla(**args)
    cache, bs = args["kv_cache"], args["kv_cache"].shape[1]
    written = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for t, s in enumerate(args["slot_mapping"].tolist()):
        if s < 0:
            continue
        written[s // bs, s % bs] = True
        row = cache[s // bs, s % bs]
        kv_c = args["kv_c"][t].float()
        for tile in range(4):
            chunk = kv_c[128 * tile : 128 * (tile + 1)]
            # scale bytes [512 + 4*tile, +4): exactly max(amax / 448, FLT_MIN) in float32
            want = torch.tensor(max(float(chunk.abs().max() / torch.tensor(448.0)), FLT_MIN), dtype=torch.float32)
            got = row[512 + 4 * tile : 516 + 4 * tile].view(torch.float32)[0]
            assert torch.equal(got, want), (t, tile, got, want)
            codes = row[128 * tile : 128 * (tile + 1)].view(torch.float8_e4m3fn).float()
            assert_fp8_close(codes * got, chunk, got)
        # RoPE bytes [528, 656): exactly the bf16 values of k_pe
        assert torch.equal(row[528:656], args["k_pe"][t].to(torch.bfloat16).view(torch.uint8))
        # the exported decoder agrees with this by-hand decoding
        dec_kv_c, dec_k_pe = decode_ds_mla_rows(row)
        assert_fp8_close(dec_kv_c, kv_c, dec_kv_c.abs().max() / 448 + FLT_MIN)
        assert torch.equal(dec_k_pe, args["k_pe"][t])
    # the all-zero tile (row 3, tile 2) has the floor scale and zero codes
    s3 = int(args["slot_mapping"][3])
    zero_tile_row = cache[s3 // bs, s3 % bs]
    assert float(zero_tile_row[520:524].view(torch.float32)[0]) == FLT_MIN
    assert bool((zero_tile_row[256:384] == 0).all())
    assert torch.equal(cache[~written], before["kv_cache"][~written])


# ----------------------------------------------------------------------- indexer_k_quant_and_cache


def ue8m0_by_hand(v: float) -> float:
    return 2.0 ** math.ceil(math.log2(v))


@pytest.mark.parametrize("quant_block_size,scale_fmt", [(128, "ue8m0"), (64, "ue8m0"), (64, "fp32")])
def test_indexer_k_quant_and_cache_block_split(quant_block_size, scale_fmt):
    args = case_indexer_k_quant_and_cache(quant_block_size, scale_fmt)
    before = clone_args(args)
    ops.indexer_k_quant_and_cache(**args)
    cache = args["kv_cache"]
    D, nq = 128, 128 // quant_block_size
    per_token = D + 4 * nq
    bs = cache.shape[1] // per_token
    touched = torch.zeros_like(cache, dtype=torch.bool)
    for t, s in enumerate(args["slot_mapping"].tolist()):
        if s < 0:
            continue
        b, o = s // bs, s % bs
        value_pos = slice(o * D, (o + 1) * D)  # block-split: values of token o
        scale_pos = slice(bs * D + o * 4 * nq, bs * D + (o + 1) * 4 * nq)  # then its scales after all values
        touched[b, value_pos] = True
        touched[b, scale_pos] = True
        scales = cache[b, scale_pos].view(torch.float32)
        codes = cache[b, value_pos].view(torch.float8_e4m3fn).float()
        k = args["k"][t].float()
        for j in range(nq):
            block = k[j * quant_block_size : (j + 1) * quant_block_size]
            raw = float(torch.clamp(block.abs().max(), min=1e-4) / torch.tensor(448.0))
            want = ue8m0_by_hand(raw) if scale_fmt == "ue8m0" else raw
            assert float(scales[j]) == want, (t, j, float(scales[j]), want)
            assert_fp8_close(codes[j * quant_block_size : (j + 1) * quant_block_size] * scales[j], block, scales[j])
        # exported decoders agree
        assert torch.equal(decode_indexer_cache(cache, D, quant_block_size)[b, o],
                           decode_indexer_block(cache[b], D, quant_block_size)[o])
        assert_fp8_close(decode_indexer_cache(cache, D, quant_block_size)[b, o], k, scales.max())
    assert torch.equal(cache[~touched], before["kv_cache"][~touched])
    assert int(touched.sum()) == 5 * per_token  # 6 rows, one skipped


def test_indexer_cache_three_dim_form_holds_the_same_bytes():
    args = case_indexer_k_quant_and_cache(128, "ue8m0")
    nb = args["kv_cache"].shape[0]
    three_d = clone_args(args)
    three_d["kv_cache"] = three_d["kv_cache"].view(nb, -1, 132)
    ops.indexer_k_quant_and_cache(**args)
    ops.indexer_k_quant_and_cache(**three_d)
    assert torch.equal(three_d["kv_cache"].view(nb, -1), args["kv_cache"])


def test_all_padding_writes_nothing():
    args = case_concat_and_cache_mla("fp8_ds_mla")
    args["slot_mapping"] = torch.full_like(args["slot_mapping"], -1)
    before = args["kv_cache"].clone()
    ops.concat_and_cache_mla(**args)
    assert torch.equal(args["kv_cache"], before)
