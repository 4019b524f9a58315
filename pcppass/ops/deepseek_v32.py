"""DeepSeek-V3.2 fused direct write: ``pcppass::fused_norm_rope``.

One op normalises Q (returned), and writes two caches: the MLA latent cache (RMSNorm'd ``kv_c`` and
interleaved-RoPE'd ``k_pe``) and the indexer K cache (LayerNorm'd, NeoX-RoPE'd on its first
``rot_dim`` dims, fp8 with ue8m0 scales, block-split).

Skip rule (as vLLM's ``_fused_norm_rope_kernel``): a token whose ``slot_mapping`` entry is negative
is skipped WHOLE: its Q output row is zeros and neither cache is written. Masking a row's slot to -1
therefore changes the op's Q output; a sharding rewrite must never mask this op's slots.

Byte-identical to ``concat_and_cache_mla`` + ``indexer_k_quant_and_cache`` called on the values
produced by :func:`pcppass.ops.math.rms_norm` / ``layer_norm`` / ``rope`` (the same store code).
"""

import torch

from pcppass.ops import checks
from pcppass.ops.cache_ops import (
    check_indexer_cache_args,
    check_indexer_cache_storage,
    check_mla_cache_args,
    num_indexer_slots,
    num_paged_slots,
    write_indexer_rows,
    write_mla_rows,
)
from pcppass.ops.math import layer_norm, rms_norm, rope

OP = "fused_norm_rope"
POSITION_DTYPES = (torch.int64, torch.int32)
INDEXER_SCALE_FMT = "ue8m0"


def _check_structure(positions, q_c, q_norm_weight, kv_c, kv_norm_weight, k_pe, cos_sin_cache, index_k,
                     index_norm_weight, index_norm_bias, index_cos_sin_cache, slot_mapping,
                     indexer_slot_mapping, mla_kv_cache, indexer_k_cache, mla_kv_cache_dtype, mla_k_scale,
                     quant_block_size) -> None:
    checks.check_dtype(OP, "positions", positions, POSITION_DTYPES)
    checks.check_float(OP, "q_c", q_c)
    checks.check_shape(OP, "q_c", q_c, (None, None), "[T, q_lora_rank]")
    rows = q_c.shape[0]
    checks.check_shape(OP, "positions", positions, (rows,), "[T] like 'q_c'")
    checks.check_shape(OP, "q_norm_weight", q_norm_weight, (q_c.shape[1],), "[q_lora_rank]")
    check_mla_cache_args(
        OP, kv_c, k_pe, mla_kv_cache, slot_mapping, mla_kv_cache_dtype, mla_k_scale,
        names=("kv_c", "k_pe", "mla_kv_cache", "slot_mapping", "mla_kv_cache_dtype", "mla_k_scale"),
    )
    checks.check_shape(OP, "kv_c", kv_c, (rows, None), "[T, L] with T like 'q_c'")
    checks.check_shape(OP, "kv_norm_weight", kv_norm_weight, (kv_c.shape[1],), "[L]")
    checks.check_rope_table(OP, "cos_sin_cache", cos_sin_cache, k_pe.shape[1], "rotates all of k_pe")
    checks.check_shape(OP, "cos_sin_cache", cos_sin_cache, (None, k_pe.shape[1]), "[max_position, R]")
    check_indexer_cache_args(
        OP, index_k, indexer_k_cache, indexer_slot_mapping, quant_block_size, INDEXER_SCALE_FMT,
        names=("index_k", "indexer_k_cache", "indexer_slot_mapping", "quant_block_size", "scale_fmt"),
    )
    checks.check_shape(OP, "index_k", index_k, (rows, None), "[T, D] with T like 'q_c'")
    head_dim = index_k.shape[1]
    checks.check_shape(OP, "index_norm_weight", index_norm_weight, (head_dim,), "[D] like 'index_k'")
    checks.check_shape(OP, "index_norm_bias", index_norm_bias, (head_dim,), "[D] like 'index_k'")
    checks.check_rope_table(OP, "index_cos_sin_cache", index_cos_sin_cache, head_dim, "rotates the first dims of index_k")
    checks.check_same_device(OP, "q_c", q_c, positions=positions, mla_kv_cache=mla_kv_cache,
                             indexer_k_cache=indexer_k_cache)


@torch.library.custom_op("pcppass::fused_norm_rope", mutates_args=("mla_kv_cache", "indexer_k_cache"))
def fused_norm_rope(
    positions: torch.Tensor,
    q_c: torch.Tensor,
    q_norm_weight: torch.Tensor,
    q_eps: float,
    kv_c: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    kv_eps: float,
    k_pe: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    index_k: torch.Tensor,
    index_norm_weight: torch.Tensor,
    index_norm_bias: torch.Tensor,
    index_eps: float,
    index_cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    indexer_slot_mapping: torch.Tensor,
    mla_kv_cache: torch.Tensor,
    indexer_k_cache: torch.Tensor,
    mla_kv_cache_dtype: str,
    mla_k_scale: torch.Tensor,
    quant_block_size: int,
) -> torch.Tensor:
    """Returns ``RMSNorm(q_c) * q_norm_weight`` (zero rows where ``slot_mapping < 0``) and writes
    both caches; see the module docstring."""
    _check_structure(positions, q_c, q_norm_weight, kv_c, kv_norm_weight, k_pe, cos_sin_cache, index_k,
                     index_norm_weight, index_norm_bias, index_cos_sin_cache, slot_mapping,
                     indexer_slot_mapping, mla_kv_cache, indexer_k_cache, mla_kv_cache_dtype, mla_k_scale,
                     quant_block_size)
    check_indexer_cache_storage(OP, "indexer_k_cache", indexer_k_cache)
    live = slot_mapping >= 0
    # the indexer row of a skipped token is skipped too: the whole token is skipped
    indexer_slots = torch.where(live, indexer_slot_mapping, -1)
    checks.check_slot_values(OP, "slot_mapping", slot_mapping, num_paged_slots(mla_kv_cache))
    checks.check_slot_values(OP, "indexer_slot_mapping", indexer_slots,
                             num_indexer_slots(indexer_k_cache, index_k.shape[1], quant_block_size))
    if checks.value_checks_active(positions):  # boolean indexing reads the row count back
        live_positions = positions[live]
        checks.check_index_values(OP, "positions", live_positions, 0, cos_sin_cache.shape[0],
                                  "rows of cos_sin_cache")
        checks.check_index_values(OP, "positions", live_positions, 0, index_cos_sin_cache.shape[0],
                                  "rows of index_cos_sin_cache")

    # padding rows may carry any position: rotate them at position 0, they are never stored
    safe_positions = torch.where(live, positions, 0)
    q_out = rms_norm(q_c, q_norm_weight, q_eps).masked_fill(~live.unsqueeze(1), 0)
    kv_c_normed = rms_norm(kv_c, kv_norm_weight, kv_eps)
    k_pe_roped = rope(k_pe, safe_positions, cos_sin_cache, "interleaved")
    write_mla_rows(kv_c_normed, k_pe_roped, mla_kv_cache, slot_mapping, mla_kv_cache_dtype, mla_k_scale)
    index_k_normed = layer_norm(index_k, index_norm_weight, index_norm_bias, index_eps)
    index_k_roped = rope(index_k_normed, safe_positions, index_cos_sin_cache, "neox", "first")
    write_indexer_rows(index_k_roped, indexer_k_cache, indexer_slots, quant_block_size, INDEXER_SCALE_FMT)
    return q_out


@fused_norm_rope.register_fake
def _(positions, q_c, q_norm_weight, q_eps, kv_c, kv_norm_weight, kv_eps, k_pe, cos_sin_cache, index_k,
      index_norm_weight, index_norm_bias, index_eps, index_cos_sin_cache, slot_mapping, indexer_slot_mapping,
      mla_kv_cache, indexer_k_cache, mla_kv_cache_dtype, mla_k_scale, quant_block_size) -> torch.Tensor:
    _check_structure(positions, q_c, q_norm_weight, kv_c, kv_norm_weight, k_pe, cos_sin_cache, index_k,
                     index_norm_weight, index_norm_bias, index_cos_sin_cache, slot_mapping,
                     indexer_slot_mapping, mla_kv_cache, indexer_k_cache, mla_kv_cache_dtype, mla_k_scale,
                     quant_block_size)
    return torch.empty_like(q_c)
