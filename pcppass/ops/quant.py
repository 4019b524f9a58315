"""fp8 e4m3 quantisers and the byte layouts of the quantised caches (encode and decode).

The cache-write ops encode with these functions; the models decode with them when attention reads
a quantised cache. All arithmetic is float32; fp8 conversion is round-to-nearest-even after clamping
to the finite range (what CUDA's ``__nv_cvt_float_to_fp8(..., __NV_SATFINITE, E4M3)`` does).

fp8_ds_mla row (``L`` latent dims, multiple of 128; ``R`` RoPE dims), ``L + 4*L/128 + 2*R`` bytes::

    | e4m3 tile 0 | ... | e4m3 tile L/128-1 | fp32 scale 0 | ... | fp32 scale L/128-1 | bf16 k_pe[0..R) |
    0             128                       L                                   L+4*L/128            +2R

    tile scale = max(amax(tile) / 448, FLT_MIN); byte = e4m3(x / scale)     (DeepSeek: 512+16+128 = 656)

Indexer block (``D`` dims, ``nq = D / quant_block_size`` scales per token, ``bs`` tokens), block-split::

    | tok 0: D e4m3 | tok 1: D e4m3 | ... | tok bs-1 | tok 0: nq fp32 | tok 1: nq fp32 | ... |
    0               D               2D         bs*D                    bs*D+4*nq

    scale = max(amax(quant block), 1e-4) / 448; "ue8m0": rounded UP to a power of two (exactly).
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
FLT_MIN = torch.finfo(torch.float32).tiny
DS_MLA_TILE = 128
INDEXER_AMAX_FLOOR = 1e-4
SCALE_FORMATS = ("ue8m0", "fp32")


# ---------------------------------------------------------------------------------------- fp8 e4m3


def divide_exact(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """IEEE ``x / divisor``. A Python-scalar divisor makes PyTorch's CUDA kernel multiply by the
    rounded reciprocal (one ulp off the CPU result); a same-device tensor divisor divides."""
    return x / torch.full_like(x, divisor)


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(x / scale, +-448))`` in float32; ``scale`` broadcasts against ``x``.
    The scale is moved to ``x``'s device: a CPU scalar divisor would become a reciprocal multiply."""
    y = x.float() / scale.float().to(x.device)
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def as_e4m3(t: torch.Tensor) -> torch.Tensor:
    """View raw e4m3 bits (uint8) as ``float8_e4m3fn``; float8 tensors pass through."""
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t


def dequant_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``e4m3 * scale`` (``values`` as float8_e4m3fn or its uint8 bits)."""
    return as_e4m3(values).float() * scale.float()


def store_as(values_e4m3: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """e4m3 values in the representation of a cache: float8 itself or its uint8 bits."""
    return values_e4m3.view(torch.uint8) if cache_dtype == torch.uint8 else values_e4m3


def float32_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` float32 -> ``[..., 4n]`` uint8 (little-endian, as in device memory)."""
    return x.to(torch.float32).contiguous().view(torch.uint8)


def bytes_float32(b: torch.Tensor) -> torch.Tensor:
    """``[..., 4n]`` uint8 -> ``[..., n]`` float32."""
    return b.contiguous().view(torch.float32)


# ------------------------------------------------------------------------------------ fp8_ds_mla


def ds_mla_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    return kv_lora_rank + 4 * (kv_lora_rank // DS_MLA_TILE) + 2 * rope_dim


def ds_mla_tile_scales(kv_c: torch.Tensor) -> torch.Tensor:
    """``[n, L]`` -> ``[n, L/128]`` float32 ``max(amax(tile) / 448, FLT_MIN)``."""
    tiles = kv_c.float().unflatten(-1, (-1, DS_MLA_TILE))
    return divide_exact(tiles.abs().amax(dim=-1), FP8_E4M3_MAX).clamp_min(FLT_MIN)


def encode_ds_mla_rows(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``kv_c [n, L]``, ``k_pe [n, R]`` -> uint8 rows ``[n, L + 4*L/128 + 2*R]``."""
    scales = ds_mla_tile_scales(kv_c)
    tiles = kv_c.float().unflatten(-1, (-1, DS_MLA_TILE))
    codes = quantize_e4m3(tiles, scales.unsqueeze(-1)).flatten(-2).view(torch.uint8)
    rope_bytes = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat((codes, float32_bytes(scales), rope_bytes), dim=-1)


def decode_ds_mla_rows(
    rows: torch.Tensor, kv_lora_rank: int = 512, rope_dim: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 rows ``[..., L + 4*L/128 + 2*R]`` -> (``kv_c`` float32 ``[..., L]``, ``k_pe`` bf16 ``[..., R]``)."""
    width = ds_mla_row_bytes(kv_lora_rank, rope_dim)
    if rows.dtype != torch.uint8 or rows.shape[-1] != width:
        raise ValueError(
            f"decode_ds_mla_rows: expected uint8 rows of {width} bytes (L={kv_lora_rank}, R={rope_dim}), "
            f"got {rows.dtype} {list(rows.shape)}"
        )
    num_tiles = kv_lora_rank // DS_MLA_TILE
    codes = rows[..., :kv_lora_rank].unflatten(-1, (num_tiles, DS_MLA_TILE))
    scales = bytes_float32(rows[..., kv_lora_rank : kv_lora_rank + 4 * num_tiles])
    kv_c = dequant_fp8(codes, scales.unsqueeze(-1)).flatten(-2)
    k_pe = rows[..., kv_lora_rank + 4 * num_tiles :].contiguous().view(torch.bfloat16)
    return kv_c, k_pe


# ----------------------------------------------------------------------------------- indexer fp8


def ue8m0_ceil(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``>= scale`` (positive float32), exactly: ``frexp`` instead of
    ``exp2(ceil(log2(x)))``, whose rounding can land one power of two low."""
    mantissa, exponent = torch.frexp(scale.float())  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    # 2**exponent built from its IEEE bits (scales are normal floats: >= 1e-4 / 448)
    return ((exponent + 127) << 23).to(torch.int32).view(torch.float32)


def indexer_scales(k: torch.Tensor, quant_block_size: int, scale_fmt: str) -> torch.Tensor:
    """``[n, D]`` -> ``[n, D/qbs]`` float32 ``max(amax, 1e-4) / 448`` (power of two for ue8m0)."""
    blocks = k.float().unflatten(-1, (-1, quant_block_size))
    scale = divide_exact(blocks.abs().amax(dim=-1).clamp_min(INDEXER_AMAX_FLOOR), FP8_E4M3_MAX)
    return ue8m0_ceil(scale) if scale_fmt == "ue8m0" else scale


def encode_indexer_rows(
    k: torch.Tensor, quant_block_size: int, scale_fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, D]`` -> (uint8 codes ``[n, D]``, uint8 scale bytes ``[n, 4*D/qbs]``)."""
    scales = indexer_scales(k, quant_block_size, scale_fmt)
    blocks = k.float().unflatten(-1, (-1, quant_block_size))
    codes = quantize_e4m3(blocks, scales.unsqueeze(-1)).flatten(-2).view(torch.uint8)
    return codes, float32_bytes(scales)


def quantize_indexer_query(q: torch.Tensor, weights: torch.Tensor, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3.2's indexer query: ``q [T, H, D]`` as e4m3 codes with one scale per head (the
    keys' scale rule over the head's ``D`` values), the scale folded into ``weights [T, H]``
    (``relu`` commutes with a positive factor). Returns (float8_e4m3fn ``[T, H, D]``, float32
    weights ``[T, H]``); the scores of the pair are those of the float32 query ``codes * scale``."""
    scales = indexer_scales(q.reshape(-1, q.shape[-1]), q.shape[-1], scale_fmt).view(q.shape[:-1])
    return quantize_e4m3(q, scales.unsqueeze(-1)), weights.float() * scales


def indexer_token_bytes(head_dim: int, quant_block_size: int) -> int:
    return head_dim + 4 * (head_dim // quant_block_size)


def split_indexer_cache(
    cache: torch.Tensor, head_dim: int, quant_block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-split uint8 cache ``[nb, bs*W]`` (or ``[nb, bs, W]``) -> (codes uint8 ``[nb, bs, D]``,
    scales float32 ``[nb, bs, D/qbs]``)."""
    per_token = indexer_token_bytes(head_dim, quant_block_size)
    flat = cache.reshape(cache.shape[0], -1)
    if cache.dtype != torch.uint8 or flat.shape[1] % per_token:
        raise ValueError(
            f"split_indexer_cache: expected a uint8 cache with a multiple of {per_token} bytes per block, "
            f"got {cache.dtype} {list(cache.shape)}"
        )
    bs = flat.shape[1] // per_token
    codes = flat[:, : bs * head_dim].unflatten(1, (bs, head_dim))
    scales = bytes_float32(flat[:, bs * head_dim :]).unflatten(1, (bs, head_dim // quant_block_size))
    return codes, scales


def decode_indexer_cache(cache: torch.Tensor, head_dim: int, quant_block_size: int) -> torch.Tensor:
    """Block-split uint8 cache -> float32 ``[nb, bs, D]`` (``code * scale`` per quant block)."""
    codes, scales = split_indexer_cache(cache, head_dim, quant_block_size)
    blocks = codes.unflatten(-1, (-1, quant_block_size))
    return dequant_fp8(blocks, scales.unsqueeze(-1)).flatten(-2)


def decode_indexer_block(block: torch.Tensor, head_dim: int, quant_block_size: int) -> torch.Tensor:
    """One block's bytes ``[bs*W]`` (or ``[bs, W]``) -> float32 ``[bs, D]``."""
    return decode_indexer_cache(block.unsqueeze(0), head_dim, quant_block_size)[0]
