"""Llama-style decoder with grouped-query attention over a paged K/V cache.

Per layer: ``q/k/v`` projections, NeoX RoPE on ``q`` and ``k``, then ONE cache write
``torch.ops.pcppass.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, ...)``
into ``layers.<i>.key`` / ``layers.<i>.value`` (``[nb, bs, Hkv, D]`` each, group ``kv``), then
attention that gathers each row's visible positions back out of those caches.

``kv_cache_dtype``: ``"auto"`` stores the model dtype; ``"fp8"`` stores float8_e4m3fn with a
per-tensor scale per cache (``k_scale`` / ``v_scale`` buffers) and dequantises on read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pcppass.contract import CacheGroupSpec, CacheSpec, slot_key
from pcppass.ops.quant import dequant_fp8, quantize_e4m3
from pcppass.models.common import (
    DecoderLayer,
    ModelDims,
    PagedCausalLM,
    attend,
    causal_full_rows,
    gather_rows,
    linear,
    paged_kernels,
    paged_rows,
    reference_causal,
    reference_rows,
    request_tables,
    rope,
    rope_cos_sin_cache,
)

KV_GROUP = "kv"


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    max_position: int
    rms_eps: float
    block_size: int
    kv_cache_dtype: str = "auto"  # "auto" | "fp8"
    # fp8: per-tensor scales; a value x is stored as e4m3(x / scale)
    k_scale: float = 0.0625
    v_scale: float = 0.0625
    dtype: torch.dtype = torch.float32

    @classmethod
    def tiny(cls) -> "LlamaConfig":
        return cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position=512, rms_eps=1e-5,
                   block_size=4)

    @classmethod
    def full(cls) -> "LlamaConfig":
        # Llama-3.1-8B widths (hidden 4096, 32 q heads, 8 kv heads, head_dim 128, vocab 128256);
        # 2 layers. fp8 scale 1.0 as for a checkpoint without calibrated scales.
        return cls(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=2,
                   num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                   max_position=131072, rms_eps=1e-5, block_size=64, k_scale=1.0, v_scale=1.0,
                   dtype=torch.bfloat16)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        if cfg.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"llama: kv_cache_dtype must be 'auto' or 'fp8', got {cfg.kv_cache_dtype!r}")
        self.cfg = cfg
        self.key_name = f"layers.{layer}.key"
        self.value_name = f"layers.{layer}.value"
        h, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = linear(cfg.hidden_size, h * d, cfg.dtype)
        self.k_proj = linear(cfg.hidden_size, hk * d, cfg.dtype)
        self.v_proj = linear(cfg.hidden_size, hk * d, cfg.dtype)
        self.o_proj = linear(h * d, cfg.hidden_size, cfg.dtype)
        self.register_buffer("cos_sin_cache", torch.empty(cfg.max_position, d), persistent=False)
        self.register_buffer("k_scale", torch.empty(1), persistent=False)
        self.register_buffer("v_scale", torch.empty(1), persistent=False)
        self.scale = d**-0.5

    def reset_buffers(self) -> None:
        dev = self.cos_sin_cache.device
        self.cos_sin_cache = rope_cos_sin_cache(self.cfg.head_dim, self.cfg.max_position, self.cfg.rope_theta).to(dev)
        self.k_scale = torch.tensor([self.cfg.k_scale], dtype=torch.float32, device=dev)
        self.v_scale = torch.tensor([self.cfg.v_scale], dtype=torch.float32, device=dev)

    def cache_specs(self) -> list[CacheSpec]:
        dtype = torch.float8_e4m3fn if self.cfg.kv_cache_dtype == "fp8" else self.cfg.dtype
        shape = (self.cfg.block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        return [CacheSpec(self.key_name, KV_GROUP, shape, dtype), CacheSpec(self.value_name, KV_GROUP, shape, dtype)]

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        t = x.shape[0]
        h, hk, d = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        q = rope(self.q_proj(x).view(t, h, d), positions, self.cos_sin_cache, "neox")
        k = rope(self.k_proj(x).view(t, hk, d), positions, self.cos_sin_cache, "neox")
        return q, k, self.v_proj(x).view(t, hk, d)

    def _stored(self, rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Cache rows as attention sees them (dequantised for fp8)."""
        if self.cfg.kv_cache_dtype == "fp8":
            return dequant_fp8(rows, scale).to(self.cfg.dtype)
        return rows

    def forward(self, x, positions, meta, caches):
        q, k, v = self._qkv(x, positions)
        key_cache, value_cache = caches[self.key_name], caches[self.value_name]
        torch.ops.pcppass.reshape_and_cache_flash(
            k, v, key_cache, value_cache, meta[slot_key(KV_GROUP)], self.cfg.kv_cache_dtype, self.k_scale, self.v_scale
        )
        if paged_kernels(q):  # a kernel reading the paged caches through the block table
            fp8 = self.cfg.kv_cache_dtype == "fp8"
            out = torch.ops.pcppass.paged_gqa_attention(
                q, key_cache, value_cache, *paged_rows(meta, KV_GROUP, positions), self.scale,
                self.k_scale if fp8 else None, self.v_scale if fp8 else None,
            )
            return self.o_proj(out.flatten(1))
        tables = request_tables(meta, KV_GROUP)
        index, valid = causal_full_rows(tables, positions, self.cfg.block_size)
        k_rows = self._stored(gather_rows(key_cache, tables, index, self.cfg.block_size), self.k_scale)
        v_rows = self._stored(gather_rows(value_cache, tables, index, self.cfg.block_size), self.v_scale)
        out = attend(q, k_rows, v_rows, valid, self.scale)
        return self.o_proj(out.flatten(1))

    def reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, positions)
        if self.cfg.kv_cache_dtype == "fp8":  # the cache round-trip: e4m3(x / scale) * scale
            k = self._stored(quantize_e4m3(k, self.k_scale), self.k_scale)
            v = self._stored(quantize_e4m3(v, self.v_scale), self.v_scale)
        out = attend(q, reference_rows(k), reference_rows(v), reference_causal(x.shape[0], x.device), self.scale)
        return self.o_proj(out.flatten(1))


class LlamaModel(PagedCausalLM):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(ModelDims(cfg.vocab_size, cfg.hidden_size, cfg.rms_eps, cfg.dtype))
        self.config = cfg
        for i in range(cfg.num_layers):
            self.layers.append(
                DecoderLayer(LlamaAttention(cfg, i), cfg.hidden_size, cfg.intermediate_size, cfg.rms_eps, cfg.dtype)
            )

    def cache_groups(self) -> list[CacheGroupSpec]:
        return [CacheGroupSpec(KV_GROUP, self.config.block_size)]
