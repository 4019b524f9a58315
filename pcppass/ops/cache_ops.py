"""Paged cache-write ops with vLLM semantics (reference implementations in plain torch).

``pcppass::reshape_and_cache_flash``, ``pcppass::concat_and_cache_mla``,
``pcppass::indexer_k_quant_and_cache``. Source row ``t`` goes to ``slot_mapping[t]`` (int64,
``slot = block * block_size + offset``); a negative slot (vLLM pads with -1) skips the row.

The ``write_*`` functions are the single implementation of each store: the ops call them and so do
the fused ops, which is what makes a fused op byte-identical to the unfused sequence.

Real implementations validate everything (structure and values) before the first write; fake
implementations validate structure only (see :mod:`pcppass.ops.checks`).

On CUDA the stores read nothing back to the host: every row is encoded (the same quantisers, so the
same bytes) and one Triton kernel (:func:`pcppass.sync.row_kernels.store_rows`) stores the rows
whose slot is not negative, where the reference selects them with ``nonzero``. With the value
checks skipped during a capture (:func:`pcppass.ops.checks.value_checks_active`), a step that
calls these ops can be captured in a CUDA graph. :func:`masked_stores` runs that path on CPU
tensors too (under ``TRITON_INTERPRET=1``: tests).
"""

import contextlib
import math
from typing import Iterator

import torch

from pcppass.ops import checks
from pcppass.sync import row_kernels
from pcppass.ops.quant import (
    DS_MLA_TILE,
    SCALE_FORMATS,
    ds_mla_row_bytes,
    encode_ds_mla_rows,
    encode_indexer_rows,
    indexer_token_bytes,
    quantize_e4m3,
    store_as,
)
from pcppass.spec import ResolvedLayout

KV_CACHE_DTYPES = ("auto", "fp8")
MLA_CACHE_DTYPES = ("auto", "fp8", "fp8_ds_mla")


# ------------------------------------------------------------------------------- shared stores


def live_rows(slot_mapping: torch.Tensor) -> torch.Tensor:
    """Indices of the rows that write (``slot >= 0``), ascending."""
    return torch.nonzero(slot_mapping >= 0).squeeze(1)


def put_paged_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[slot // bs, slot % bs] = row`` for ``cache [nb, bs, ...]`` of any strides."""
    block_size = cache.shape[1]
    cache.index_put_((slots // block_size, slots % block_size), rows)


_MASKED_STORES_ON_CPU = [False]


@contextlib.contextmanager
def masked_stores(enabled: bool) -> Iterator[None]:
    """Run the block with the CUDA store path (encode every row, masked kernel store) on CPU
    tensors too; the kernels then need ``TRITON_INTERPRET=1``."""
    _MASKED_STORES_ON_CPU.append(enabled)
    try:
        yield
    finally:
        _MASKED_STORES_ON_CPU.pop()


def _masked(cache: torch.Tensor) -> bool:
    return cache.is_cuda or _MASKED_STORES_ON_CPU[-1]


def paged_layout(cache: torch.Tensor) -> ResolvedLayout:
    return ResolvedLayout("paged_rows", cache.shape[1], math.prod(cache.shape[2:]) * cache.element_size())


def store_paged_rows(cache: torch.Tensor, slot_mapping: torch.Tensor, encode) -> None:
    """``cache[slot // bs, slot % bs] = encode(rows)[t]`` for every ``slot_mapping[t] >= 0``.

    ``encode(idx)`` returns the stored rows for row indices ``idx`` (``None``: every row). On the
    masked path every row is encoded and the kernel skips negative slots; the reference path
    encodes the live rows only. Row encodings are row-independent, so the bytes are the same."""
    if _masked(cache) and row_kernels.store_rows(cache, paged_layout(cache), slot_mapping, encode(None)):
        return
    idx = live_rows(slot_mapping)
    put_paged_rows(cache, slot_mapping[idx], encode(idx))


def take_rows(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    return x if idx is None else x[idx]


def write_kv_rows(
    x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor
) -> None:
    def encode(idx):
        rows = take_rows(x, idx)
        if kv_cache_dtype == "auto":
            return rows.to(cache.dtype)
        return store_as(quantize_e4m3(rows, scale.reshape(())), cache.dtype)

    store_paged_rows(cache, slot_mapping, encode)


def write_mla_rows(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
) -> None:
    def encode(idx):
        c, pe = take_rows(kv_c, idx), take_rows(k_pe, idx)
        if kv_cache_dtype == "auto":
            return torch.cat((c.to(kv_cache.dtype), pe.to(kv_cache.dtype)), dim=-1)
        if kv_cache_dtype == "fp8":
            both = torch.cat((c.float(), pe.float()), dim=-1)
            return store_as(quantize_e4m3(both, scale.reshape(())), kv_cache.dtype)
        return encode_ds_mla_rows(c, pe)

    store_paged_rows(kv_cache, slot_mapping, encode)


def indexer_block_view(cache: torch.Tensor) -> torch.Tensor:
    """``[nb, bs*W]`` view of an indexer cache (``[nb, bs*W]`` or ``[nb, bs, W]``) sharing its storage."""
    return cache if cache.dim() == 2 else cache.view(cache.shape[0], -1)


def write_indexer_rows(
    k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, quant_block_size: int, scale_fmt: str
) -> None:
    """Block-split store: codes at ``[b, o*D : (o+1)*D]``, scales at ``[b, bs*D + o*4*nq : ...]``."""
    head_dim = k.shape[1]
    scale_bytes = 4 * (head_dim // quant_block_size)
    blocks = indexer_block_view(kv_cache)
    block_size = blocks.shape[1] // indexer_token_bytes(head_dim, quant_block_size)
    if _masked(kv_cache):
        layout = ResolvedLayout("block_split", block_size, head_dim + scale_bytes,
                                segments=((0, head_dim, head_dim), (block_size * head_dim, scale_bytes, scale_bytes)))
        codes, scales = encode_indexer_rows(k, quant_block_size, scale_fmt)
        if row_kernels.store_rows(blocks, layout, slot_mapping, torch.cat((codes, scales), dim=1)):
            return
    idx = live_rows(slot_mapping)
    slots = slot_mapping[idx]
    codes, scales = encode_indexer_rows(k[idx], quant_block_size, scale_fmt)
    block = (slots // block_size).unsqueeze(1)
    offset = (slots % block_size).unsqueeze(1)
    value_cols = offset * head_dim + torch.arange(head_dim, device=k.device)
    scale_cols = block_size * head_dim + offset * scale_bytes + torch.arange(scale_bytes, device=k.device)
    blocks.index_put_((block, value_cols), codes)
    blocks.index_put_((block, scale_cols), scales)


# ------------------------------------------------------------------------- structural checks


def check_kv_cache_args(op, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    checks.check_choice(op, "kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    checks.check_float(op, "key", key)
    checks.check_float(op, "value", value)
    checks.check_shape(op, "key", key, (None, None, None), "[T, H, D]")
    rows, heads = key.shape[0], key.shape[1]
    checks.check_shape(op, "value", value, (rows, heads, None), "[T, H, Dv] like 'key'")
    checks.check_slot_mapping(op, "slot_mapping", slot_mapping, rows, "key")
    cache_dtypes = checks.PLAIN_FLOAT_DTYPES if kv_cache_dtype == "auto" else checks.FP8_CACHE_DTYPES
    because = f"kv_cache_dtype={kv_cache_dtype!r}"
    checks.check_dtype(op, "key_cache", key_cache, cache_dtypes, because)
    checks.check_dtype(op, "value_cache", value_cache, cache_dtypes, because)
    checks.check_shape(op, "key_cache", key_cache, (None, None, heads, key.shape[2]), "[num_blocks, block_size, H, D]")
    checks.check_shape(
        op, "value_cache", value_cache, (key_cache.shape[0], key_cache.shape[1], heads, value.shape[2]),
        "[num_blocks, block_size, H, Dv] like 'key_cache'",
    )
    if kv_cache_dtype == "fp8":
        checks.check_scale(op, "k_scale", k_scale)
        checks.check_scale(op, "v_scale", v_scale)
    checks.check_same_device(op, "key_cache", key_cache, key=key, value=value, value_cache=value_cache,
                             slot_mapping=slot_mapping)


def check_mla_cache_args(op, kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale,
                         names=("kv_c", "k_pe", "kv_cache", "slot_mapping", "kv_cache_dtype", "scale")):
    """``names`` lets a fused op report its own argument names for the same roles."""
    n_kv_c, n_k_pe, n_cache, n_slots, n_dtype, n_scale = names
    checks.check_choice(op, n_dtype, kv_cache_dtype, MLA_CACHE_DTYPES)
    checks.check_float(op, n_kv_c, kv_c)
    checks.check_float(op, n_k_pe, k_pe)
    checks.check_shape(op, n_kv_c, kv_c, (None, None), "[T, L]")
    rows, latent = kv_c.shape
    checks.check_shape(op, n_k_pe, k_pe, (rows, None), f"[T, R] with T like '{n_kv_c}'")
    rope_dim = k_pe.shape[1]
    checks.check_slot_mapping(op, n_slots, slot_mapping, rows, n_kv_c)
    if kv_cache_dtype == "fp8_ds_mla":
        if checks.known_unequal(latent % DS_MLA_TILE, 0):
            checks.fail(op, n_kv_c, f"must have L a multiple of {DS_MLA_TILE} for fp8_ds_mla, got L={latent}")
        checks.check_dtype(op, n_cache, kv_cache, (torch.uint8,), f"{n_dtype}={kv_cache_dtype!r}")
        width = ds_mla_row_bytes(latent, rope_dim)
        what = f"[num_blocks, block_size, L + 4*L/128 + 2*R = {width}] (fp8_ds_mla bytes)"
    else:
        allowed = checks.PLAIN_FLOAT_DTYPES if kv_cache_dtype == "auto" else checks.FP8_CACHE_DTYPES
        checks.check_dtype(op, n_cache, kv_cache, allowed, f"{n_dtype}={kv_cache_dtype!r}")
        width = latent + rope_dim
        what = f"[num_blocks, block_size, L + R = {width}]"
    checks.check_shape(op, n_cache, kv_cache, (None, None, width), what)
    if kv_cache_dtype == "fp8":
        checks.check_scale(op, n_scale, scale)
    checks.check_same_device(op, n_cache, kv_cache, **{n_kv_c: kv_c, n_k_pe: k_pe, n_slots: slot_mapping})


def check_indexer_cache_args(op, k, kv_cache, slot_mapping, quant_block_size, scale_fmt,
                             names=("k", "kv_cache", "slot_mapping", "quant_block_size", "scale_fmt")):
    n_k, n_cache, n_slots, n_qbs, n_fmt = names
    checks.check_choice(op, n_fmt, scale_fmt, SCALE_FORMATS)
    checks.check_float(op, n_k, k)
    checks.check_shape(op, n_k, k, (None, None), "[T, D]")
    rows, head_dim = k.shape
    if quant_block_size <= 0 or checks.known_unequal(head_dim % quant_block_size, 0):
        checks.fail(op, n_qbs, f"must be a positive divisor of D={head_dim}, got {quant_block_size}")
    checks.check_slot_mapping(op, n_slots, slot_mapping, rows, n_k)
    check_indexer_cache(op, n_cache, kv_cache, head_dim, quant_block_size)
    checks.check_same_device(op, n_cache, kv_cache, **{n_k: k, n_slots: slot_mapping})


def check_indexer_cache(op, name, cache, head_dim, quant_block_size):
    checks.check_dtype(op, name, cache, (torch.uint8,))
    per_token = indexer_token_bytes(head_dim, quant_block_size)
    what = f"block-split [num_blocks, block_size * {per_token}] or [num_blocks, block_size, {per_token}]"
    if cache.dim() == 3:
        checks.check_shape(op, name, cache, (None, None, per_token), what)
    elif cache.dim() == 2:
        if checks.known_unequal(cache.shape[1] % per_token, 0):
            checks.fail(op, name, f"must be {what}, got shape {list(cache.shape)}")
    else:
        checks.fail(op, name, f"must be {what}, got shape {list(cache.shape)}")


def check_indexer_cache_storage(op, name, cache):
    """Value-level layout check: the block-split writes go through a ``[nb, bs*W]`` view."""
    if cache.dim() == 3 and not (cache.stride(2) == 1 and cache.stride(1) == cache.shape[2]):
        checks.fail(op, name, f"must have contiguous blocks (strides {cache.stride()})")
    if cache.dim() == 2 and cache.stride(1) != 1:
        checks.fail(op, name, f"must have contiguous blocks (strides {cache.stride()})")


def num_paged_slots(cache: torch.Tensor) -> int:
    return int(cache.shape[0]) * int(cache.shape[1])


def num_indexer_slots(cache: torch.Tensor, head_dim: int, quant_block_size: int) -> int:
    return int(indexer_block_view(cache).numel()) // indexer_token_bytes(head_dim, quant_block_size)


# ------------------------------------------------------------------------------------- op 1


@torch.library.custom_op("pcppass::reshape_and_cache_flash", mutates_args=("key_cache", "value_cache"))
def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Store ``key[t]``/``value[t]`` (``[T, H, D]``) at ``slot_mapping[t]`` of caches ``[nb, bs, H, D]``.

    ``"auto"``: values converted to the cache dtype. ``"fp8"``: ``e4m3(clamp(x / scale, +-448))``
    into a float8_e4m3fn cache or a uint8 cache holding e4m3 bits.
    """
    op = "reshape_and_cache_flash"
    check_kv_cache_args(op, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    checks.check_slot_values(op, "slot_mapping", slot_mapping, num_paged_slots(key_cache))
    write_kv_rows(key, key_cache, slot_mapping, kv_cache_dtype, k_scale)
    write_kv_rows(value, value_cache, slot_mapping, kv_cache_dtype, v_scale)


@reshape_and_cache_flash.register_fake
def _(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale) -> None:
    check_kv_cache_args("reshape_and_cache_flash", key, value, key_cache, value_cache, slot_mapping,
                        kv_cache_dtype, k_scale, v_scale)


# ------------------------------------------------------------------------------------- op 2


@torch.library.custom_op("pcppass::concat_and_cache_mla", mutates_args=("kv_cache",))
def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
) -> None:
    """Store ``cat(kv_c[t], k_pe[t])`` at ``slot_mapping[t]`` of ``kv_cache [nb, bs, W]``.

    ``"auto"``: cache dtype, ``W = L + R``. ``"fp8"``: per-tensor ``scale``, e4m3, ``W = L + R``.
    ``"fp8_ds_mla"``: uint8, ``W = L + 4*L/128 + 2*R`` (see :mod:`pcppass.ops.quant`).
    """
    op = "concat_and_cache_mla"
    check_mla_cache_args(op, kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)
    checks.check_slot_values(op, "slot_mapping", slot_mapping, num_paged_slots(kv_cache))
    write_mla_rows(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)


@concat_and_cache_mla.register_fake
def _(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale) -> None:
    check_mla_cache_args("concat_and_cache_mla", kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)


# ------------------------------------------------------------------------------------- op 3


@torch.library.custom_op("pcppass::indexer_k_quant_and_cache", mutates_args=("kv_cache",))
def indexer_k_quant_and_cache(
    k: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant_block_size: int,
    scale_fmt: str,
) -> None:
    """Quantise ``k[t]`` (``[T, D]``) to e4m3 with one fp32 scale per ``quant_block_size`` dims and
    store it block-split at ``slot_mapping[t]``. ``scale_fmt``: ``"ue8m0"`` (power-of-two scales)
    or ``"fp32"``."""
    op = "indexer_k_quant_and_cache"
    check_indexer_cache_args(op, k, kv_cache, slot_mapping, quant_block_size, scale_fmt)
    check_indexer_cache_storage(op, "kv_cache", kv_cache)
    checks.check_slot_values(op, "slot_mapping", slot_mapping,
                             num_indexer_slots(kv_cache, k.shape[1], quant_block_size))
    write_indexer_rows(k, kv_cache, slot_mapping, quant_block_size, scale_fmt)


@indexer_k_quant_and_cache.register_fake
def _(k, kv_cache, slot_mapping, quant_block_size, scale_fmt) -> None:
    check_indexer_cache_args("indexer_k_quant_and_cache", k, kv_cache, slot_mapping, quant_block_size, scale_fmt)
