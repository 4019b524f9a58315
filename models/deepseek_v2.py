"""DeepSeek-V2-Lite-style decoder: multi-head latent attention (MLA) over a paged latent cache.

Per layer (no q LoRA in Lite)::

    q        = q_proj(x)                      -> q_nope [H, N], q_pe [H, R] (interleaved RoPE)
    kv_a     = kv_a_proj_with_mqa(x)          -> kv_c [L] (kv_a_layernorm), k_pe [R] (interleaved RoPE)
    concat_and_cache_mla(kv_c, k_pe, layers.<i>.kv, slot_mapping.mla, kv_cache_dtype, scale)
    attention reads (kv_c, k_pe) of every visible position back from layers.<i>.kv and absorbs
    kv_b_proj: W_UK into the query, W_UV onto the latent output.

``kv_cache_dtype``: ``"auto"`` (``[bs, L+R]`` in the model dtype) or ``"fp8_ds_mla"`` (uint8
``[bs, L + 4*L/128 + 2*R]``: 656 bytes for DeepSeek; per-128-tile scales, bf16 RoPE part).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pcppass.contract import CacheGroupSpec, CacheSpec, slot_key
from pcppass.ops.quant import decode_ds_mla_rows, ds_mla_row_bytes, encode_ds_mla_rows
from pcppass.models.common import (
    DecoderLayer,
    ModelDims,
    PagedCausalLM,
    RMSNorm,
    causal_full_rows,
    gather_rows,
    linear,
    mla_attend,
    mla_attend_paged,
    paged_kernels,
    paged_rows,
    reference_causal,
    reference_rows,
    request_tables,
    rope,
    rope_cos_sin_cache,
)

MLA_GROUP = "mla"


@dataclass(frozen=True)
class DeepseekV2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    max_position: int
    rms_eps: float
    block_size: int
    kv_cache_dtype: str = "auto"  # "auto" | "fp8_ds_mla"
    dtype: torch.dtype = torch.float32

    @classmethod
    def tiny(cls) -> "DeepseekV2Config":
        # kv_lora_rank 128: fp8_ds_mla quantises the latent in tiles of 128
        return cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   rope_theta=10000.0, max_position=512, rms_eps=1e-6, block_size=4)

    @classmethod
    def full(cls) -> "DeepseekV2Config":
        # DeepSeek-V2-Lite widths; dense MLP of the Lite first layer's width (10944); no YaRN.
        return cls(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=2, num_heads=16,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   rope_theta=10000.0, max_position=163840, rms_eps=1e-6, block_size=64,
                   dtype=torch.bfloat16)


class MLALatentReader:
    """Reading the latent MLA cache back and attending over it (shared by the MLA models).

    Needs ``self.cfg`` (kv_cache_dtype, kv_lora_rank, qk_rope_head_dim, dtype, v_head_dim,
    block_size, max_position, rope_theta), ``self.kv_b_proj``, ``self.o_proj``, ``self.scale`` and
    the ``cos_sin_cache`` / ``k_scale`` buffers.
    """

    def reset_buffers(self) -> None:
        dev = self.cos_sin_cache.device
        cfg = self.cfg
        self.cos_sin_cache = rope_cos_sin_cache(cfg.qk_rope_head_dim, cfg.max_position, cfg.rope_theta).to(dev)
        self.k_scale = torch.ones(1, dtype=torch.float32, device=dev)

    def _latent_block_shape(self) -> tuple[tuple[int, ...], torch.dtype]:
        """Per-block shape and dtype of the latent cache: ``[bs, 656]`` uint8 for fp8_ds_mla
        (DeepSeek widths), ``[bs, kv_lora_rank + rope]`` in the model dtype otherwise."""
        cfg = self.cfg
        if cfg.kv_cache_dtype == "fp8_ds_mla":
            return (cfg.block_size, ds_mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim)), torch.uint8
        return (cfg.block_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim), cfg.dtype

    def _latent(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows ``[..., width]`` -> (kv_c, k_pe) in the model dtype."""
        cfg = self.cfg
        if cfg.kv_cache_dtype == "fp8_ds_mla":
            kv_c, k_pe = decode_ds_mla_rows(rows, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
            return kv_c.to(cfg.dtype), k_pe.to(cfg.dtype)
        return rows[..., : cfg.kv_lora_rank], rows[..., cfg.kv_lora_rank :]

    def _out(self, q_nope, q_pe, kv_c, k_pe, valid) -> torch.Tensor:
        out = mla_attend(q_nope, q_pe, kv_c, k_pe, valid, self.kv_b_proj.weight, self.cfg.v_head_dim, self.scale)
        return self.o_proj(out.flatten(1))

    def _out_paged(self, q_nope, q_pe, cache, rows, indexer=None) -> torch.Tensor:
        """CUDA: :meth:`_out` with a kernel reading ``cache`` through the block table (``rows``:
        :func:`paged_rows` of the MLA group; ``indexer``: see :func:`mla_attend_paged`)."""
        out = mla_attend_paged(q_nope, q_pe, cache, rows, self.kv_b_proj.weight, self.cfg.v_head_dim, self.scale,
                               self.cfg.kv_cache_dtype == "fp8_ds_mla", indexer)
        return self.o_proj(out.flatten(1))


class DeepseekV2MLA(MLALatentReader, nn.Module):
    def __init__(self, cfg: DeepseekV2Config, layer: int) -> None:
        super().__init__()
        if cfg.kv_cache_dtype not in ("auto", "fp8_ds_mla"):
            raise ValueError(f"deepseek_v2: kv_cache_dtype must be 'auto' or 'fp8_ds_mla', got {cfg.kv_cache_dtype!r}")
        self.cfg = cfg
        self.cache_name = f"layers.{layer}.kv"
        h, n, r, v, l = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.q_proj = linear(cfg.hidden_size, h * (n + r), cfg.dtype)
        self.kv_a_proj_with_mqa = linear(cfg.hidden_size, l + r, cfg.dtype)
        self.kv_a_layernorm = RMSNorm(l, cfg.rms_eps, cfg.dtype)
        self.kv_b_proj = linear(l, h * (n + v), cfg.dtype)
        self.o_proj = linear(h * v, cfg.hidden_size, cfg.dtype)
        self.register_buffer("cos_sin_cache", torch.empty(cfg.max_position, r), persistent=False)
        self.register_buffer("k_scale", torch.empty(1), persistent=False)
        self.scale = (n + r) ** -0.5

    def cache_specs(self) -> list[CacheSpec]:
        return [CacheSpec(self.cache_name, MLA_GROUP, *self._latent_block_shape())]

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        cfg = self.cfg
        q = self.q_proj(x).view(x.shape[0], cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_pe = rope(q_pe, positions, self.cos_sin_cache, "interleaved")
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        k_pe = rope(k_pe, positions, self.cos_sin_cache, "interleaved")
        return q_nope, q_pe, kv_c, k_pe


    def forward(self, x, positions, meta, caches):
        q_nope, q_pe, kv_c, k_pe = self._project(x, positions)
        cache = caches[self.cache_name]
        torch.ops.pcppass.concat_and_cache_mla(
            kv_c, k_pe, cache, meta[slot_key(MLA_GROUP)], self.cfg.kv_cache_dtype, self.k_scale
        )
        if paged_kernels(x):
            return self._out_paged(q_nope, q_pe, cache, paged_rows(meta, MLA_GROUP, positions))
        tables = request_tables(meta, MLA_GROUP)
        index, valid = causal_full_rows(tables, positions, self.cfg.block_size)
        kv_rows, pe_rows = self._latent(gather_rows(cache, tables, index, self.cfg.block_size))
        return self._out(q_nope, q_pe, kv_rows, pe_rows, valid)

    def reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe, kv_c, k_pe = self._project(x, positions)
        if self.cfg.kv_cache_dtype == "fp8_ds_mla":  # the cache round-trip
            kv_c, k_pe = self._latent(encode_ds_mla_rows(kv_c, k_pe))
        valid = reference_causal(x.shape[0], x.device)
        return self._out(q_nope, q_pe, reference_rows(kv_c), reference_rows(k_pe), valid)


class DeepseekV2Model(PagedCausalLM):
    def __init__(self, cfg: DeepseekV2Config) -> None:
        super().__init__(ModelDims(cfg.vocab_size, cfg.hidden_size, cfg.rms_eps, cfg.dtype))
        self.config = cfg
        for i in range(cfg.num_layers):
            self.layers.append(
                DecoderLayer(DeepseekV2MLA(cfg, i), cfg.hidden_size, cfg.intermediate_size, cfg.rms_eps, cfg.dtype)
            )

    def cache_groups(self) -> list[CacheGroupSpec]:
        return [CacheGroupSpec(MLA_GROUP, self.config.block_size)]
