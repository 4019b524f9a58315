"""DeepSeek-V4 cache writers: sliding-window insert and the KV compressor.

* ``pcppass::swa_qnorm_rope_kv_insert``: fused per-head Q RMSNorm + RoPE (returned) and KV RoPE +
  insert into the sliding-window ring cache. A token with a negative slot is skipped WHOLE (zero Q
  row, no write), as vLLM's ``fused_deepseek_v4_qnorm_rope_kv_rope_*insert`` kernels do.
* ``pcppass::compressor_save_state``: every token stores ``cat(kv, score + ape[pos % ratio])`` (fp32)
  into the compressor state cache (ring addressed by the engine).
* ``pcppass::compressor_compress_store``: at a compression boundary, reads the group's states back
  through the row's ring block table, softmax-pools them per channel, RMSNorms, RoPEs and stores one
  compressed row. It READS state written by earlier steps, possibly on another rank: the state
  cache is replicated state like any KV cache.
"""

import torch

from pcppass.ops import checks
from pcppass.ops.cache_ops import (
    take_rows,
    check_indexer_cache,
    check_indexer_cache_storage,
    live_rows,
    num_indexer_slots,
    num_paged_slots,
    put_paged_rows,
    store_paged_rows,
    write_indexer_rows,
)
from pcppass.ops.math import rms_norm, rope

POSITION_DTYPES = (torch.int64, torch.int32)
BLOCK_TABLE_DTYPES = (torch.int64, torch.int32)
COMPRESSED_CACHE_DTYPES = ("auto", "fp8_indexer")
COMPRESSED_SCALE_FMT = "ue8m0"


# ----------------------------------------------------------------------------------- op 5: SWA


def _check_swa(q, kv, swa_cache, slot_mapping, positions, cos_sin_cache) -> None:
    op = "swa_qnorm_rope_kv_insert"
    checks.check_float(op, "q", q)
    checks.check_float(op, "kv", kv)
    checks.check_shape(op, "q", q, (None, None, None), "[T, H, D]")
    rows, head_dim = q.shape[0], q.shape[2]
    checks.check_shape(op, "kv", kv, (rows, head_dim), "[T, D] like 'q'")
    checks.check_slot_mapping(op, "slot_mapping", slot_mapping, rows, "q")
    checks.check_dtype(op, "positions", positions, POSITION_DTYPES)
    checks.check_shape(op, "positions", positions, (rows,), "[T] like 'q'")
    checks.check_rope_table(op, "cos_sin_cache", cos_sin_cache, head_dim, "rotates the last dims of q and kv")
    checks.check_float(op, "swa_cache", swa_cache)
    checks.check_shape(op, "swa_cache", swa_cache, (None, None, head_dim), "[num_blocks, block_size, D]")
    checks.check_same_device(op, "swa_cache", swa_cache, q=q, kv=kv, slot_mapping=slot_mapping, positions=positions)


@torch.library.custom_op("pcppass::swa_qnorm_rope_kv_insert", mutates_args=("swa_cache",))
def swa_qnorm_rope_kv_insert(
    q: torch.Tensor,
    kv: torch.Tensor,
    swa_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Returns ``rope_last(RMSNorm(q) per head)`` ``[T, H, D]``; stores ``rope_last(kv)`` (cache
    dtype) at ``slot_mapping[t]`` of ``swa_cache [nb, bs, D]``. Interleaved RoPE on the last
    ``rot_dim = cos_sin_cache.shape[1]`` dims."""
    op = "swa_qnorm_rope_kv_insert"
    _check_swa(q, kv, swa_cache, slot_mapping, positions, cos_sin_cache)
    live = slot_mapping >= 0
    checks.check_slot_values(op, "slot_mapping", slot_mapping, num_paged_slots(swa_cache))
    if checks.value_checks_active(positions):  # boolean indexing reads the row count back
        checks.check_index_values(op, "positions", positions[live], 0, cos_sin_cache.shape[0],
                                  "rows of cos_sin_cache")

    safe_positions = torch.where(live, positions, 0)
    q_out = rope(rms_norm(q, None, eps), safe_positions, cos_sin_cache, "interleaved", "last")
    q_out = q_out.masked_fill(~live.view(-1, 1, 1), 0)
    kv_roped = rope(kv, safe_positions, cos_sin_cache, "interleaved", "last")
    store_paged_rows(swa_cache, slot_mapping, lambda idx: take_rows(kv_roped, idx).to(swa_cache.dtype))
    return q_out


@swa_qnorm_rope_kv_insert.register_fake
def _(q, kv, swa_cache, slot_mapping, positions, cos_sin_cache, eps) -> torch.Tensor:
    _check_swa(q, kv, swa_cache, slot_mapping, positions, cos_sin_cache)
    return torch.empty_like(q)


# ----------------------------------------------------------------------- op 6: save state


def _check_save_state(kv, score, ape, positions, state_cache, slot_mapping, compress_ratio) -> None:
    op = "compressor_save_state"
    checks.check_float(op, "kv", kv)
    checks.check_float(op, "score", score)
    checks.check_float(op, "ape", ape)
    checks.check_shape(op, "kv", kv, (None, None), "[T, C*hd]")
    rows, width = kv.shape
    checks.check_shape(op, "score", score, (rows, width), "[T, C*hd] like 'kv'")
    if compress_ratio < 1:
        checks.fail(op, "compress_ratio", f"must be >= 1, got {compress_ratio}")
    checks.check_shape(op, "ape", ape, (compress_ratio, width), "[compress_ratio, C*hd]")
    checks.check_dtype(op, "positions", positions, POSITION_DTYPES)
    checks.check_shape(op, "positions", positions, (rows,), "[T] like 'kv'")
    checks.check_slot_mapping(op, "slot_mapping", slot_mapping, rows, "kv")
    checks.check_dtype(op, "state_cache", state_cache, (torch.float32,))
    checks.check_shape(op, "state_cache", state_cache, (None, None, 2 * width), "[num_blocks, block_size, 2*C*hd]")
    checks.check_same_device(op, "state_cache", state_cache, kv=kv, score=score, ape=ape, positions=positions,
                             slot_mapping=slot_mapping)


@torch.library.custom_op("pcppass::compressor_save_state", mutates_args=("state_cache",))
def compressor_save_state(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    compress_ratio: int,
) -> None:
    """Stores ``cat(kv[t], score[t] + ape[positions[t] % compress_ratio])`` in float32 at
    ``slot_mapping[t]`` of ``state_cache [nb, bs, 2*C*hd]``."""
    op = "compressor_save_state"
    _check_save_state(kv, score, ape, positions, state_cache, slot_mapping, compress_ratio)
    checks.check_slot_values(op, "slot_mapping", slot_mapping, num_paged_slots(state_cache))
    if checks.value_checks_active(positions):
        checks.check_index_values(op, "positions", positions[live_rows(slot_mapping)], 0, 2**62, "token positions")

    def encode(idx):
        pos = take_rows(positions, idx)
        return torch.cat((take_rows(kv, idx).float(), take_rows(score, idx).float() + ape[pos % compress_ratio].float()),
                         dim=-1)

    store_paged_rows(state_cache, slot_mapping, encode)


@compressor_save_state.register_fake
def _(kv, score, ape, positions, state_cache, slot_mapping, compress_ratio) -> None:
    _check_save_state(kv, score, ape, positions, state_cache, slot_mapping, compress_ratio)


# -------------------------------------------------------------------- op 7: compress + store


def _check_compress_store(positions, state_cache, state_block_table, norm_weight, cos_sin_cache, compressed_cache,
                          slot_mapping, compress_ratio, overlap, kv_cache_dtype, quant_block_size) -> None:
    op = "compressor_compress_store"
    checks.check_choice(op, "kv_cache_dtype", kv_cache_dtype, COMPRESSED_CACHE_DTYPES)
    if compress_ratio < 1:
        checks.fail(op, "compress_ratio", f"must be >= 1, got {compress_ratio}")
    checks.check_dtype(op, "slot_mapping", slot_mapping, (torch.int64,))
    checks.check_shape(op, "slot_mapping", slot_mapping, (None,), "[T]")
    rows = slot_mapping.shape[0]
    checks.check_dtype(op, "positions", positions, POSITION_DTYPES)
    checks.check_shape(op, "positions", positions, (rows,), "[T] like 'slot_mapping'")
    checks.check_float(op, "norm_weight", norm_weight)
    checks.check_shape(op, "norm_weight", norm_weight, (None,), "[hd]")
    head_dim = norm_weight.shape[0]
    coff = 2 if overlap else 1
    checks.check_dtype(op, "state_cache", state_cache, (torch.float32,))
    checks.check_shape(op, "state_cache", state_cache, (None, None, 2 * coff * head_dim),
                       f"[num_blocks, block_size, 2*C*hd] with C={coff}, hd={head_dim}")
    checks.check_dtype(op, "state_block_table", state_block_table, BLOCK_TABLE_DTYPES)
    checks.check_shape(op, "state_block_table", state_block_table, (rows, None), "[T, ring_blocks]")
    ring_len = state_block_table.shape[1] * state_cache.shape[1]
    if checks.known_greater(coff * compress_ratio, ring_len):
        checks.fail(op, "state_block_table", f"ring of {ring_len} positions cannot hold the "
                    f"{coff * compress_ratio} states one compressed row reads")
    checks.check_rope_table(op, "cos_sin_cache", cos_sin_cache, head_dim, "rotates the last dims of a row")
    if kv_cache_dtype == "auto":
        checks.check_float(op, "compressed_cache", compressed_cache)
        checks.check_shape(op, "compressed_cache", compressed_cache, (None, None, head_dim),
                           "[num_blocks, block_size, hd]")
    else:
        if quant_block_size <= 0 or checks.known_unequal(head_dim % quant_block_size, 0):
            checks.fail(op, "quant_block_size", f"must be a positive divisor of hd={head_dim}, got {quant_block_size}")
        check_indexer_cache(op, "compressed_cache", compressed_cache, head_dim, quant_block_size)
    checks.check_same_device(op, "compressed_cache", compressed_cache, positions=positions, state_cache=state_cache,
                             state_block_table=state_block_table, slot_mapping=slot_mapping)


def gather_group_states(
    state_cache: torch.Tensor, table: torch.Tensor, entry_positions: torch.Tensor
) -> torch.Tensor:
    """States of ``entry_positions [n, k]`` through ring block tables ``table [n, ncols]``:
    ``q = p % (ncols * bs)`` -> ``state_cache[table[q // bs], q % bs]``. Returns ``[n, k, width]``."""
    block_size = state_cache.shape[1]
    ring_index = entry_positions % (table.shape[1] * block_size)
    blocks = table.gather(1, ring_index // block_size)
    return state_cache[blocks, ring_index % block_size]


def pool_group(
    states: torch.Tensor, present: torch.Tensor, head_dim: int, compress_ratio: int, overlap: bool
) -> torch.Tensor:
    """Per-channel softmax pooling of one compression window.

    ``states [n, C*ratio, 2*C*hd]`` (entries oldest first; with overlap the first ``ratio`` entries
    are the previous group), ``present [n, C*ratio]`` marks entries at positions ``>= 0``.
    Overlap: previous group uses half 0 (``[0, hd)``) of kv/score, current group half 1.
    Returns float32 ``[n, hd]``.
    """
    coff = 2 if overlap else 1
    kv, score = states[..., : coff * head_dim], states[..., coff * head_dim :]
    if overlap:
        previous = (torch.arange(coff * compress_ratio, device=states.device) < compress_ratio).view(1, -1, 1)
        kv = torch.where(previous, kv[..., :head_dim], kv[..., head_dim:])
        score = torch.where(previous, score[..., :head_dim], score[..., head_dim:])
    absent = ~present.unsqueeze(-1)
    weights = torch.softmax(score.masked_fill(absent, float("-inf")), dim=1)
    return (weights * kv.masked_fill(absent, 0.0)).sum(dim=1)


@torch.library.custom_op("pcppass::compressor_compress_store", mutates_args=("compressed_cache",))
def compressor_compress_store(
    positions: torch.Tensor,
    state_cache: torch.Tensor,
    state_block_table: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    compressed_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    compress_ratio: int,
    overlap: bool,
    kv_cache_dtype: str,
    quant_block_size: int,
) -> None:
    """For each row ``t`` with ``slot_mapping[t] >= 0`` (``p = positions[t]`` closes a group:
    ``(p + 1) % compress_ratio == 0``): pool the states of ``[p - C*ratio + 1, p]`` (positions
    ``>= 0``), RMSNorm * ``norm_weight``, interleaved RoPE on the last ``rot_dim`` dims at
    ``p // compress_ratio``, store at ``slot_mapping[t]``: ``"auto"`` -> ``[nb, bs, hd]`` (cache
    dtype), ``"fp8_indexer"`` -> block-split ue8m0 layout of ``indexer_k_quant_and_cache``."""
    op = "compressor_compress_store"
    _check_compress_store(positions, state_cache, state_block_table, norm_weight, cos_sin_cache, compressed_cache,
                          slot_mapping, compress_ratio, overlap, kv_cache_dtype, quant_block_size)
    head_dim = norm_weight.shape[0]
    if kv_cache_dtype == "auto":
        num_slots = num_paged_slots(compressed_cache)
    else:
        check_indexer_cache_storage(op, "compressed_cache", compressed_cache)
        num_slots = num_indexer_slots(compressed_cache, head_dim, quant_block_size)
    checks.check_slot_values(op, "slot_mapping", slot_mapping, num_slots)
    idx = live_rows(slot_mapping)
    p = positions[idx].long()
    checks.check_index_values(op, "positions", p, compress_ratio - 1, 2**62, "a compressed row needs a whole group")
    not_closing = (p + 1) % compress_ratio != 0
    if bool(not_closing.any()):
        bad = int(p[not_closing][0])
        checks.fail(op, "positions", f"holds {bad} at a row with a slot, but only positions closing a "
                    f"group of {compress_ratio} ((p + 1) % ratio == 0) get a compressed row")
    checks.check_index_values(op, "positions", p // compress_ratio, 0, cos_sin_cache.shape[0],
                              "p // compress_ratio indexes cos_sin_cache")
    table = state_block_table[idx].long()
    checks.check_index_values(op, "state_block_table", table, 0, state_cache.shape[0], "blocks of state_cache")

    coff = 2 if overlap else 1
    span = coff * compress_ratio
    entry_positions = p.unsqueeze(1) + torch.arange(1 - span, 1, device=p.device).unsqueeze(0)  # oldest first
    present = entry_positions >= 0
    states = gather_group_states(state_cache, table, entry_positions.clamp_min(0))
    pooled = pool_group(states, present, head_dim, compress_ratio, overlap)
    row = rope(rms_norm(pooled, norm_weight, eps), p // compress_ratio, cos_sin_cache, "interleaved", "last")
    live_slots = slot_mapping[idx]
    if kv_cache_dtype == "auto":
        put_paged_rows(compressed_cache, live_slots, row.to(compressed_cache.dtype))
    else:
        write_indexer_rows(row, compressed_cache, live_slots, quant_block_size, COMPRESSED_SCALE_FMT)


@compressor_compress_store.register_fake
def _(positions, state_cache, state_block_table, norm_weight, eps, cos_sin_cache, compressed_cache, slot_mapping,
      compress_ratio, overlap, kv_cache_dtype, quant_block_size) -> None:
    _check_compress_store(positions, state_cache, state_block_table, norm_weight, cos_sin_cache, compressed_cache,
                          slot_mapping, compress_ratio, overlap, kv_cache_dtype, quant_block_size)
