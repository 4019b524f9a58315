"""Small, seeded input sets for every pcppass cache-write op (shared by the test_kernels_* files).

Every builder returns a dict of keyword arguments named exactly as the op schema. Caches are
filled with random bytes so a row that was not written is distinguishable from a fresh write.
"""

from __future__ import annotations

import torch

import pcppass.ops  # noqa: F401  (registers the ops)

OPS = {
    "reshape_and_cache_flash": torch.ops.pcppass.reshape_and_cache_flash,
    "concat_and_cache_mla": torch.ops.pcppass.concat_and_cache_mla,
    "indexer_k_quant_and_cache": torch.ops.pcppass.indexer_k_quant_and_cache,
    "fused_norm_rope": torch.ops.pcppass.fused_norm_rope,
    "swa_qnorm_rope_kv_insert": torch.ops.pcppass.swa_qnorm_rope_kv_insert,
    "compressor_save_state": torch.ops.pcppass.compressor_save_state,
    "compressor_compress_store": torch.ops.pcppass.compressor_compress_store,
}
CACHE_ARGS = {
    "reshape_and_cache_flash": ("key_cache", "value_cache"),
    "concat_and_cache_mla": ("kv_cache",),
    "indexer_k_quant_and_cache": ("kv_cache",),
    "fused_norm_rope": ("mla_kv_cache", "indexer_k_cache"),
    "swa_qnorm_rope_kv_insert": ("swa_cache",),
    "compressor_save_state": ("state_cache",),
    "compressor_compress_store": ("compressed_cache",),
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.bfloat16, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def random_bytes(g, *shape) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


def random_cache(g, *shape, dtype) -> torch.Tensor:
    """Random contents that are finite in every dtype (fp8 caches: random finite e4m3 values)."""
    if dtype == torch.uint8:
        return random_bytes(g, *shape)
    return torch.randn(*shape, generator=g).clamp(-4, 4).to(dtype)


def distinct_slots(g, rows: int, num_slots: int, skip_rows=()) -> torch.Tensor:
    slots = torch.randperm(num_slots, generator=g)[:rows].to(torch.int64)
    for r in skip_rows:
        slots[r] = -1
    return slots


def cos_sin_table(max_position: int, rot_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch.float32)


def case_reshape_and_cache_flash(kv_cache_dtype="auto", cache_dtype=torch.bfloat16, seed=0):
    g = gen(seed)
    T, H, D, nb, bs = 6, 2, 16, 4, 4
    return dict(
        key=randn(g, T, H, D), value=randn(g, T, H, D),
        key_cache=random_cache(g, nb, bs, H, D, dtype=cache_dtype),
        value_cache=random_cache(g, nb, bs, H, D, dtype=cache_dtype),
        slot_mapping=distinct_slots(g, T, nb * bs, skip_rows=(1, 4)),
        kv_cache_dtype=kv_cache_dtype,
        k_scale=torch.tensor([0.02]), v_scale=torch.tensor([0.03]),
    )


def mla_cache_width(kv_cache_dtype: str, L: int, R: int) -> int:
    return L + 4 * (L // 128) + 2 * R if kv_cache_dtype == "fp8_ds_mla" else L + R


def mla_cache_dtype(kv_cache_dtype: str) -> torch.dtype:
    return {"auto": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_ds_mla": torch.uint8}[kv_cache_dtype]


def case_concat_and_cache_mla(kv_cache_dtype="fp8_ds_mla", seed=1):
    g = gen(seed)
    T, L, R, nb, bs = 5, 512, 64, 3, 4
    kv_c = randn(g, T, L)
    kv_c[2, 128:256] *= 100.0  # tiles of very different magnitude
    kv_c[3, 256:384] = 0.0  # an all-zero tile: scale floored at FLT_MIN
    return dict(
        kv_c=kv_c, k_pe=randn(g, T, R),
        kv_cache=random_cache(g, nb, bs, mla_cache_width(kv_cache_dtype, L, R), dtype=mla_cache_dtype(kv_cache_dtype)),
        slot_mapping=distinct_slots(g, T, nb * bs, skip_rows=(1,)),
        kv_cache_dtype=kv_cache_dtype, scale=torch.tensor([0.05]),
    )


def case_indexer_k_quant_and_cache(quant_block_size=64, scale_fmt="ue8m0", seed=2, D=128):
    g = gen(seed)
    T, nb, bs = 6, 3, 4
    k = randn(g, T, D)
    k[0, :quant_block_size] *= 1e-6  # amax below the 1e-4 floor
    nq = D // quant_block_size
    return dict(
        k=k, kv_cache=random_bytes(g, nb, bs * (D + 4 * nq)),
        slot_mapping=distinct_slots(g, T, nb * bs, skip_rows=(2,)),
        quant_block_size=quant_block_size, scale_fmt=scale_fmt,
    )


def case_fused_norm_rope(mla_kv_cache_dtype="fp8_ds_mla", seed=3):
    g = gen(seed)
    T, Q, L, R, D, rot_i, nb, bs, max_pos = 6, 48, 256, 64, 128, 64, 3, 4, 64
    slot_mapping = distinct_slots(g, T, nb * bs, skip_rows=(1, 4))
    indexer_slot_mapping = distinct_slots(g, T, nb * bs, skip_rows=(3,))  # row 1: live indexer slot, skipped token
    q_c = randn(g, T, Q)
    q_c[4] = float("nan")  # a skipped padding row with garbage must still give a zero Q row
    return dict(
        positions=torch.randint(0, max_pos, (T,), generator=g),
        q_c=q_c, q_norm_weight=randn(g, Q), q_eps=1e-6,
        kv_c=randn(g, T, L), kv_norm_weight=randn(g, L), kv_eps=1e-6,
        k_pe=randn(g, T, R), cos_sin_cache=cos_sin_table(max_pos, R),
        index_k=randn(g, T, D), index_norm_weight=randn(g, D), index_norm_bias=randn(g, D), index_eps=1e-6,
        index_cos_sin_cache=cos_sin_table(max_pos, rot_i),
        slot_mapping=slot_mapping, indexer_slot_mapping=indexer_slot_mapping,
        mla_kv_cache=random_cache(g, nb, bs, mla_cache_width(mla_kv_cache_dtype, L, R),
                                  dtype=mla_cache_dtype(mla_kv_cache_dtype)),
        indexer_k_cache=random_bytes(g, nb, bs * (D + 4)),
        mla_kv_cache_dtype=mla_kv_cache_dtype, mla_k_scale=torch.tensor([0.05]), quant_block_size=128,
    )


def case_swa_qnorm_rope_kv_insert(seed=4):
    g = gen(seed)
    T, H, D, rot, nb, bs, max_pos = 6, 3, 64, 16, 3, 4, 64
    return dict(
        q=randn(g, T, H, D), kv=randn(g, T, D),
        swa_cache=random_cache(g, nb, bs, D, dtype=torch.bfloat16),
        slot_mapping=distinct_slots(g, T, nb * bs, skip_rows=(0, 5)),
        positions=torch.randint(0, max_pos, (T,), generator=g),
        cos_sin_cache=cos_sin_table(max_pos, rot), eps=1e-6,
    )


def case_compressor_save_state(overlap=True, seed=5):
    g = gen(seed)
    T, hd, ratio, nb, bs = 6, 16, 4, 3, 4
    width = (2 if overlap else 1) * hd
    return dict(
        kv=randn(g, T, width), score=randn(g, T, width), ape=randn(g, ratio, width, dtype=torch.float32),
        positions=torch.randint(0, 100, (T,), generator=g),
        state_cache=random_cache(g, nb, bs, 2 * width, dtype=torch.float32),
        slot_mapping=distinct_slots(g, T, nb * bs, skip_rows=(3,)),
        compress_ratio=ratio,
    )


def case_compressor_compress_store(kv_cache_dtype="auto", overlap=True, seed=6):
    """One step of 4 rows: two requests, each with a row closing a group (slot) and a row that does not."""
    g = gen(seed)
    hd, ratio, bs_state, ncols, nbs = 16, 4, 4, 3, 8
    coff = 2 if overlap else 1
    qbs = 8
    positions = torch.tensor([10, 11, 22, 23])  # 11 and 23 close groups of 4
    table_a, table_b = [5, 1, 6], [2, 7, 0]
    state_block_table = torch.tensor([table_a, table_a, table_b, table_b])
    nb, bs = 4, 4
    if kv_cache_dtype == "auto":
        compressed_cache = random_cache(g, nb, bs, hd, dtype=torch.float32)
    else:
        compressed_cache = random_bytes(g, nb, bs * (hd + 4 * (hd // qbs)))
    return dict(
        positions=positions,
        state_cache=random_cache(g, nbs, bs_state, 2 * coff * hd, dtype=torch.float32),
        state_block_table=state_block_table,
        norm_weight=randn(g, hd, dtype=torch.float32), eps=1e-6,
        cos_sin_cache=cos_sin_table(16, 8),
        compressed_cache=compressed_cache,
        slot_mapping=torch.tensor([-1, 6, -1, 9]),
        compress_ratio=ratio, overlap=overlap, kv_cache_dtype=kv_cache_dtype, quant_block_size=qbs,
    )


CASES = {
    "reshape_and_cache_flash": case_reshape_and_cache_flash,
    "concat_and_cache_mla": case_concat_and_cache_mla,
    "indexer_k_quant_and_cache": case_indexer_k_quant_and_cache,
    "fused_norm_rope": case_fused_norm_rope,
    "swa_qnorm_rope_kv_insert": case_swa_qnorm_rope_kv_insert,
    "compressor_save_state": case_compressor_save_state,
    "compressor_compress_store": case_compressor_compress_store,
}


def clone_args(kwargs: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
