"""DeepSeek-V3.2-style decoder: MLA with q LoRA, a lightning indexer and top-k sparse attention.

Per layer::

    q_c   = q_a_proj(x)            kv_c, k_pe = kv_a_proj_with_mqa(x)          index_k = indexer.wk(x)
    q_c_n = fused_norm_rope(positions, q_c, ..., kv_c, ..., k_pe, ..., index_k, ...,
                            slot_mapping.mla, slot_mapping.indexer,
                            layers.<i>.kv (fp8_ds_mla, 656 B rows for DeepSeek),
                            layers.<i>.indexer_k (fp8, block-split, ue8m0 scales), ...)
        -> ONE op writes BOTH caches (RMSNorm(kv_c) + interleaved RoPE(k_pe) into the MLA cache;
           LayerNorm(index_k) + NeoX RoPE + fp8 into the indexer cache) and returns RMSNorm(q_c).
    q      = q_b_proj(q_c_n)                                  -> q_nope, q_pe (interleaved RoPE)
    q_idx  = indexer.wq_b(q_c_n) (NeoX RoPE on the first dims), w = indexer.weights_proj(x)
    scores = sum_h w_h * relu(q_idx_h . k) over the request's positions <= p, keys dequantised
             from the indexer cache; top-k (fixed k, lowest position first among ties)
    sparse MLA attention over the selected positions, latent rows dequantised from the MLA cache.

Cache groups: ``mla`` and ``indexer`` are separate groups with their own block size, block table
and slot mapping, as vLLM keeps the indexer cache under its own layer prefix; the fused op
receives both slot mappings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pcppass.contract import CacheGroupSpec, CacheSpec, slot_key
from pcppass.ops.math import layer_norm, rms_norm
from pcppass.ops.quant import encode_ds_mla_rows, indexer_token_bytes, quantize_indexer_query
from pcppass.models.common import (
    DecoderLayer,
    LayerNorm,
    ModelDims,
    PagedCausalLM,
    RMSNorm,
    causal_full_rows,
    gather_rows,
    indexer_roundtrip,
    indexer_scores,
    linear,
    paged_kernels,
    paged_rows,
    read_indexer_keys,
    reference_causal,
    reference_rows,
    request_tables,
    rope,
    select_topk,
)
from pcppass.models.deepseek_v2 import MLALatentReader

MLA_GROUP = "mla"
INDEXER_GROUP = "indexer"
INDEXER_SCALE_FMT = "ue8m0"


@dataclass(frozen=True)
class DeepseekV32Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    quant_block_size: int
    rope_theta: float
    max_position: int
    rms_eps: float
    index_eps: float
    block_size: int
    indexer_block_size: int
    kv_cache_dtype: str = "fp8_ds_mla"  # "fp8_ds_mla" | "auto"
    dtype: torch.dtype = torch.float32

    @classmethod
    def tiny(cls) -> "DeepseekV32Config":
        # index_topk 6 < the test sequences' lengths, so the indexer really selects; the indexer
        # group uses another block size than the MLA group, so each table is read with its own.
        return cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   q_lora_rank=32, kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   index_n_heads=4, index_head_dim=32, index_topk=6, quant_block_size=32,
                   rope_theta=10000.0, max_position=512, rms_eps=1e-6, index_eps=1e-6,
                   block_size=4, indexer_block_size=8)

    @classmethod
    def full(cls) -> "DeepseekV32Config":
        # DeepSeek-V3.2 widths; dense MLP (18432, the dense layers' width); no YaRN.
        return cls(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=2, num_heads=128,
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                   v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048, quant_block_size=128,
                   rope_theta=10000.0, max_position=163840, rms_eps=1e-6, index_eps=1e-6,
                   block_size=64, indexer_block_size=64, dtype=torch.bfloat16)


class LightningIndexer(nn.Module):
    def __init__(self, cfg: DeepseekV32Config) -> None:
        super().__init__()
        self.wq_b = linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, cfg.dtype)
        self.wk = linear(cfg.hidden_size, cfg.index_head_dim, cfg.dtype)
        self.k_norm = LayerNorm(cfg.index_head_dim, cfg.index_eps, cfg.dtype)
        self.weights_proj = linear(cfg.hidden_size, cfg.index_n_heads, cfg.dtype)
        self.weight_scale = cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5


class DeepseekV32Attention(MLALatentReader, nn.Module):
    def __init__(self, cfg: DeepseekV32Config, layer: int) -> None:
        super().__init__()
        if cfg.kv_cache_dtype not in ("auto", "fp8_ds_mla"):
            raise ValueError(f"deepseek_v32: kv_cache_dtype must be 'fp8_ds_mla' or 'auto', got {cfg.kv_cache_dtype!r}")
        self.cfg = cfg
        self.kv_name = f"layers.{layer}.kv"
        self.indexer_name = f"layers.{layer}.indexer_k"
        h, n, r, v, l = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.q_a_proj = linear(cfg.hidden_size, cfg.q_lora_rank, cfg.dtype)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_eps, cfg.dtype)
        self.q_b_proj = linear(cfg.q_lora_rank, h * (n + r), cfg.dtype)
        self.kv_a_proj_with_mqa = linear(cfg.hidden_size, l + r, cfg.dtype)
        self.kv_a_layernorm = RMSNorm(l, cfg.rms_eps, cfg.dtype)
        self.kv_b_proj = linear(l, h * (n + v), cfg.dtype)
        self.o_proj = linear(h * v, cfg.hidden_size, cfg.dtype)
        self.indexer = LightningIndexer(cfg)
        self.register_buffer("cos_sin_cache", torch.empty(cfg.max_position, r), persistent=False)
        self.register_buffer("k_scale", torch.empty(1), persistent=False)
        self.scale = (n + r) ** -0.5

    # reset_buffers (MLALatentReader): the indexer rotates its first qk_rope_head_dim dims with the
    # same RoPE table (NeoX style)

    def cache_specs(self) -> list[CacheSpec]:
        cfg = self.cfg
        kv_spec = CacheSpec(self.kv_name, MLA_GROUP, *self._latent_block_shape())
        per_token = indexer_token_bytes(cfg.index_head_dim, cfg.quant_block_size)
        indexer_spec = CacheSpec(self.indexer_name, INDEXER_GROUP, (cfg.indexer_block_size * per_token,), torch.uint8)
        return [kv_spec, indexer_spec]

    # -- shared by the cached and the reference paths
    def _raw(self, x: torch.Tensor):
        cfg = self.cfg
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        return self.q_a_proj(x), kv_c, k_pe, self.indexer.wk(x)

    def _queries(self, x: torch.Tensor, q_c_normed: torch.Tensor, positions: torch.Tensor):
        cfg = self.cfg
        t = x.shape[0]
        q = self.q_b_proj(q_c_normed).view(t, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_pe = rope(q_pe, positions, self.cos_sin_cache, "interleaved")
        q_idx = self.indexer.wq_b(q_c_normed).view(t, cfg.index_n_heads, cfg.index_head_dim)
        q_idx = rope(q_idx, positions, self.cos_sin_cache, "neox", "first")
        weights = self.indexer.weights_proj(x).float() * self.indexer.weight_scale
        # e4m3 with one scale per head, as DeepSeek-V3.2 feeds its fp8 indexer kernel
        q_idx, weights = quantize_indexer_query(q_idx, weights, INDEXER_SCALE_FMT)
        return q_nope, q_pe, q_idx, weights


    # -- cached path
    def forward(self, x, positions, meta, caches):
        cfg = self.cfg
        q_c, kv_c, k_pe, index_k = self._raw(x)
        kv_cache, indexer_cache = caches[self.kv_name], caches[self.indexer_name]
        q_c_normed = torch.ops.pcppass.fused_norm_rope(
            positions, q_c, self.q_a_layernorm.weight, cfg.rms_eps,
            kv_c, self.kv_a_layernorm.weight, cfg.rms_eps, k_pe, self.cos_sin_cache,
            index_k, self.indexer.k_norm.weight, self.indexer.k_norm.bias, cfg.index_eps, self.cos_sin_cache,
            meta[slot_key(MLA_GROUP)], meta[slot_key(INDEXER_GROUP)], kv_cache, indexer_cache,
            cfg.kv_cache_dtype, self.k_scale, cfg.quant_block_size,
        )
        q_nope, q_pe, q_idx, weights = self._queries(x, q_c_normed, positions)
        if paged_kernels(x):  # fp8 indexer kernel + top-k selection + sparse MLA, through the block tables
            indexer = (q_idx, weights, indexer_cache, paged_rows(meta, INDEXER_GROUP, positions)[0],
                       cfg.quant_block_size, cfg.index_topk)
            return self._out_paged(q_nope, q_pe, kv_cache, paged_rows(meta, MLA_GROUP, positions), indexer)

        idx_tables = request_tables(meta, INDEXER_GROUP)
        index, visible = causal_full_rows(idx_tables, positions, cfg.indexer_block_size)
        keys = read_indexer_keys(indexer_cache, idx_tables, index, cfg.indexer_block_size, cfg.index_head_dim,
                                 cfg.quant_block_size)
        selected, selected_valid = select_topk(indexer_scores(q_idx, weights, keys, visible), cfg.index_topk)

        # selected logical positions, read through the MLA group's own tables
        rows = gather_rows(kv_cache, request_tables(meta, MLA_GROUP), selected, cfg.block_size)
        kv_rows, pe_rows = self._latent(rows)
        return self._out(q_nope, q_pe, kv_rows, pe_rows, selected_valid)

    # -- no-cache reference: the fused op's math unfused, with the same cache round-trips
    def reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        q_c, kv_c, k_pe, index_k = self._raw(x)
        q_c_normed = rms_norm(q_c, self.q_a_layernorm.weight, cfg.rms_eps)
        kv_c = rms_norm(kv_c, self.kv_a_layernorm.weight, cfg.rms_eps)
        k_pe = rope(k_pe, positions, self.cos_sin_cache, "interleaved")
        if cfg.kv_cache_dtype == "fp8_ds_mla":
            kv_c, k_pe = self._latent(encode_ds_mla_rows(kv_c, k_pe))
        index_k = layer_norm(index_k, self.indexer.k_norm.weight, self.indexer.k_norm.bias, cfg.index_eps)
        index_k = rope(index_k, positions, self.cos_sin_cache, "neox", "first")
        keys = indexer_roundtrip(index_k, cfg.quant_block_size, INDEXER_SCALE_FMT)
        q_nope, q_pe, q_idx, weights = self._queries(x, q_c_normed, positions)

        visible = reference_causal(x.shape[0], x.device)
        selected, selected_valid = select_topk(indexer_scores(q_idx, weights, reference_rows(keys), visible),
                                               cfg.index_topk)
        return self._out(q_nope, q_pe, kv_c[selected], k_pe[selected], selected_valid)


class DeepseekV32Model(PagedCausalLM):
    def __init__(self, cfg: DeepseekV32Config) -> None:
        super().__init__(ModelDims(cfg.vocab_size, cfg.hidden_size, cfg.rms_eps, cfg.dtype))
        self.config = cfg
        for i in range(cfg.num_layers):
            self.layers.append(
                DecoderLayer(DeepseekV32Attention(cfg, i), cfg.hidden_size, cfg.intermediate_size, cfg.rms_eps,
                             cfg.dtype)
            )

    def cache_groups(self) -> list[CacheGroupSpec]:
        return [
            CacheGroupSpec(MLA_GROUP, self.config.block_size),
            CacheGroupSpec(INDEXER_GROUP, self.config.indexer_block_size),
        ]
