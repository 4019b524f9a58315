"""DeepSeek-V4-style decoder: sliding-window MQA over a ring cache, plus compressed KV.

Every layer (shared-KV MQA, one 512-wide KV head for DeepSeek, K = V)::

    q_res = RMSNorm(q_a_proj(x));  q = q_b_proj(q_res) [H, D];  kv = RMSNorm(kv_proj(x)) [D]
    q = swa_qnorm_rope_kv_insert(q, kv, layers.<i>.swa_kv, slot_mapping.swa, positions, cos_sin, eps)
        -> writes RoPE(kv) into the ring cache (group ``swa``), returns per-head RMSNorm + RoPE of q
    window keys: the row's last ``sliding_window`` positions, read back through its ring table

Layers with a compress ratio (4: with overlap, C = 2; the heavy ratio: 128 full-width, 8 tiny)::

    compressor_save_state(kv_c, score, ape, positions, layers.<i>.compressor_state, slot_mapping.c<r>_state, r)
        every token, fp32, ring group ``c<r>_state`` (window C*r)
    compressor_compress_store(positions, layers.<i>.compressor_state, block_table.c<r>_state[token_to_req], ...,
                              layers.<i>.compressed_kv, slot_mapping.c<r>, r, overlap, "auto", ...)
        one row per closed group of r positions into group ``c<r>`` (compressed addressing;
        slot -1 except at boundaries)

Ratio-4 layers add a lightning indexer with its own compressor (head dim 128 for DeepSeek) and
state cache (``layers.<i>.indexer_state``, group ``c4_state``) writing the fp8 indexer cache
``layers.<i>.indexer_k`` (``"fp8_indexer"``, block-split, ue8m0; group ``c4``). Its scores
``sum_h w_h * relu(q_h . k)`` over the visible compressed rows pick ``index_topk`` of them.

Attention = window keys + compressed keys (ratio 4: the indexer's picks; heavy ratio: every
visible compressed row) + a learned per-head sink; the RoPE part of the output is rotated back
(K = V carries RoPE), then the grouped low-rank output projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pcppass.contract import CacheGroupSpec, CacheSpec, slot_key
from pcppass.ops.deepseek_v4 import pool_group
from pcppass.ops.math import rms_norm
from pcppass.ops.quant import indexer_token_bytes
from pcppass.models.common import (
    DecoderLayer,
    ModelDims,
    PagedCausalLM,
    RMSNorm,
    attend,
    gather_rows,
    indexer_roundtrip,
    indexer_scores,
    linear,
    read_indexer_keys,
    reference_causal,
    reference_rows,
    request_tables,
    rope,
    rope_cos_sin_cache,
    select_topk,
)

SWA_GROUP = "swa"
INDEXER_RATIO = 4
INDEXER_SCALE_FMT = "ue8m0"


def state_group(ratio: int) -> str:
    return f"c{ratio}_state"


def compressed_group(ratio: int) -> str:
    return f"c{ratio}"


def state_block_size(ratio: int) -> int:
    """vLLM's compressor state blocks: 4 positions for the overlapping ratio-4 compressor, else 8."""
    return 4 if ratio == INDEXER_RATIO else 8


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    compress_ratios: tuple[int, ...]  # per layer: 0 (window only), 4 (overlap + indexer), or the heavy ratio
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    quant_block_size: int
    rope_theta: float
    compress_rope_theta: float
    max_position: int
    rms_eps: float
    swa_block_size: int
    compressed_block_size: int
    dtype: torch.dtype = torch.float32

    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    @classmethod
    def tiny(cls) -> "DeepseekV4Config":
        # heavy ratio 8 instead of 128 and window 8 instead of 128, so short test sequences cross
        # compression boundaries and wrap the rings; index_topk 2 < the compressed rows they reach
        return cls(vocab_size=256, hidden_size=64, intermediate_size=128, compress_ratios=(4, 8, 0), num_heads=4,
                   head_dim=32, rope_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
                   index_n_heads=4, index_head_dim=32, index_topk=2, quant_block_size=32, rope_theta=10000.0,
                   compress_rope_theta=160000.0, max_position=512, rms_eps=1e-6, swa_block_size=4,
                   compressed_block_size=4)

    @classmethod
    def full(cls) -> "DeepseekV4Config":
        # transformers' DeepseekV4Config (DeepSeek-V4-Flash) widths: hidden 4096, 64 heads of 512, rope 64,
        # q_lora 1024, 8 output groups of rank 1024, window 128, indexer 64 x 128 top-512, vocab 129280,
        # ratios 4 / 128. Two layers (one C4, one C128); dense MLP of the shared expert's width (2048);
        # no YaRN, no hyper-connections; RoPE tables cover 256k positions.
        return cls(vocab_size=129280, hidden_size=4096, intermediate_size=2048, compress_ratios=(4, 128),
                   num_heads=64, head_dim=512, rope_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
                   sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512, quant_block_size=128,
                   rope_theta=10000.0, compress_rope_theta=160000.0, max_position=262144, rms_eps=1e-6,
                   swa_block_size=64, compressed_block_size=64, dtype=torch.bfloat16)


class GroupedLinear(nn.Module):
    """``[T, G, in]`` -> ``[T, G, out]`` with one weight per group (grouped output projection)."""

    def __init__(self, groups: int, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups, in_features, out_features, dtype=dtype))

    def init_parameter(self, name: str, p: torch.Tensor, gen: torch.Generator) -> None:
        p.normal_(0.0, p.shape[1] ** -0.5, generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("tgi,gio->tgo", x, self.weight)


class Compressor(nn.Module):
    """Gated softmax pooling of every ``ratio`` positions into one row (ratio 4: overlapping
    windows, each row pools its own group and the previous one, with separate halves)."""

    def __init__(self, cfg: DeepseekV4Config, head_dim: int, ratio: int, state_name: str, out_name: str,
                 out_kind: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.head_dim = head_dim
        self.ratio = ratio
        self.overlap = ratio == INDEXER_RATIO
        self.coff = 2 if self.overlap else 1
        self.state_name = state_name
        self.out_name = out_name
        self.out_kind = out_kind  # "auto" | "fp8_indexer"
        self.kv_proj = linear(cfg.hidden_size, self.coff * head_dim, cfg.dtype)
        self.gate_proj = linear(cfg.hidden_size, self.coff * head_dim, cfg.dtype)
        self.ape = nn.Parameter(torch.empty(ratio, self.coff * head_dim, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, cfg.rms_eps, cfg.dtype)

    def init_parameter(self, name: str, p: torch.Tensor, gen: torch.Generator) -> None:
        p.normal_(0.0, 0.5, generator=gen)  # ape: learned positional term of the pooling scores

    def cache_specs(self) -> list[CacheSpec]:
        cfg, r = self.cfg, self.ratio
        state = CacheSpec(self.state_name, state_group(r), (state_block_size(r), 2 * self.coff * self.head_dim),
                          torch.float32)
        if self.out_kind == "auto":
            out = CacheSpec(self.out_name, compressed_group(r), (cfg.compressed_block_size, self.head_dim), cfg.dtype)
        else:
            per_token = indexer_token_bytes(self.head_dim, cfg.quant_block_size)
            out = CacheSpec(self.out_name, compressed_group(r), (cfg.compressed_block_size * per_token,), torch.uint8)
        return [state, out]

    def forward(self, x, positions, meta, caches, cos_sin_cache) -> None:
        group = state_group(self.ratio)
        state = caches[self.state_name]
        torch.ops.pcppass.compressor_save_state(
            self.kv_proj(x), self.gate_proj(x), self.ape, positions, state, meta[slot_key(group)], self.ratio
        )
        torch.ops.pcppass.compressor_compress_store(
            positions, state, request_tables(meta, group), self.norm.weight, self.cfg.rms_eps, cos_sin_cache,
            caches[self.out_name], meta[slot_key(compressed_group(self.ratio))], self.ratio, self.overlap,
            self.out_kind, self.cfg.quant_block_size,
        )

    def reference(self, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        """Compressed rows ``[L // ratio + 1, hd]`` of a whole sequence as attention reads them back
        (the last row is a zero row no position can see, so ``L < ratio`` still yields a table)."""
        length = x.shape[0]
        positions = torch.arange(length, device=x.device)
        states = torch.cat(
            (self.kv_proj(x).float(), self.gate_proj(x).float() + self.ape[positions % self.ratio].float()), dim=-1
        )
        closing = torch.arange(self.ratio - 1, length, self.ratio, device=x.device)
        entries = closing.unsqueeze(1) + torch.arange(1 - self.coff * self.ratio, 1, device=x.device).unsqueeze(0)
        pooled = pool_group(states[entries.clamp_min(0)], entries >= 0, self.head_dim, self.ratio, self.overlap)
        rows = rope(rms_norm(pooled, self.norm.weight, self.cfg.rms_eps), closing // self.ratio, cos_sin_cache,
                    "interleaved", "last")
        if self.out_kind == "auto":
            rows = rows.to(self.cfg.dtype)
        else:
            rows = indexer_roundtrip(rows, self.cfg.quant_block_size, INDEXER_SCALE_FMT)
        return torch.cat((rows, rows.new_zeros(1, self.head_dim)))


class V4Indexer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.keys_name = f"layers.{layer}.indexer_k"
        self.compressor = Compressor(cfg, cfg.index_head_dim, INDEXER_RATIO, f"layers.{layer}.indexer_state",
                                     self.keys_name, "fp8_indexer")
        self.q_b_proj = linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, cfg.dtype)
        self.weights_proj = linear(cfg.hidden_size, cfg.index_n_heads, cfg.dtype)
        self.weight_scale = cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5

    def queries(self, x, q_res, positions, cos_sin_cache):
        q = self.q_b_proj(q_res).view(x.shape[0], self.cfg.index_n_heads, self.cfg.index_head_dim)
        q = rope(q, positions, cos_sin_cache, "interleaved", "last")
        return q, self.weights_proj(x).float() * self.weight_scale


class DeepseekV4Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.ratio = cfg.compress_ratios[layer]
        self.swa_name = f"layers.{layer}.swa_kv"
        h, d = cfg.num_heads, cfg.head_dim
        self.q_a_proj = linear(cfg.hidden_size, cfg.q_lora_rank, cfg.dtype)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_eps, cfg.dtype)
        self.q_b_proj = linear(cfg.q_lora_rank, h * d, cfg.dtype)
        self.kv_proj = linear(cfg.hidden_size, d, cfg.dtype)
        self.kv_norm = RMSNorm(d, cfg.rms_eps, cfg.dtype)
        self.o_a_proj = GroupedLinear(cfg.o_groups, h * d // cfg.o_groups, cfg.o_lora_rank, cfg.dtype)
        self.o_b_proj = linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, cfg.dtype)
        self.sinks = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.compressor = (
            Compressor(cfg, d, self.ratio, f"layers.{layer}.compressor_state", f"layers.{layer}.compressed_kv", "auto")
            if self.ratio else None
        )
        self.indexer = V4Indexer(cfg, layer) if self.ratio == INDEXER_RATIO else None
        self.register_buffer("cos_sin_cache", torch.empty(cfg.max_position, cfg.rope_dim), persistent=False)
        self.register_buffer("inverse_cos_sin_cache", torch.empty(cfg.max_position, cfg.rope_dim), persistent=False)
        self.scale = d**-0.5

    def init_parameter(self, name: str, p: torch.Tensor, gen: torch.Generator) -> None:
        p.normal_(0.0, 1.0, generator=gen)  # sinks

    def reset_buffers(self) -> None:
        cfg = self.cfg
        # window-only layers use the main RoPE base; compressed layers share the compressor's
        theta = cfg.compress_rope_theta if self.ratio else cfg.rope_theta
        table = rope_cos_sin_cache(cfg.rope_dim, cfg.max_position, theta).to(self.cos_sin_cache.device)
        half = cfg.rope_dim // 2
        self.cos_sin_cache = table
        self.inverse_cos_sin_cache = torch.cat((table[:, :half], -table[:, half:]), dim=-1)

    def cache_specs(self) -> list[CacheSpec]:
        cfg = self.cfg
        specs = [CacheSpec(self.swa_name, SWA_GROUP, (cfg.swa_block_size, cfg.head_dim), cfg.dtype)]
        if self.compressor is not None:
            specs += self.compressor.cache_specs()
        if self.indexer is not None:
            specs += self.indexer.compressor.cache_specs()
        return specs

    def _project(self, x: torch.Tensor):
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_res).view(x.shape[0], self.cfg.num_heads, self.cfg.head_dim)
        return q_res, q, self.kv_norm(self.kv_proj(x))

    def _output(self, q, keys, valid, positions) -> torch.Tensor:
        """MQA over ``keys [T, S, D]`` (K = V) with sinks; undo the RoPE the values carried."""
        t = q.shape[0]
        kv = keys.unsqueeze(2)
        out = attend(q, kv, kv, valid, self.scale, self.sinks)
        out = rope(out, positions, self.inverse_cos_sin_cache, "interleaved", "last")
        grouped = out.reshape(t, self.cfg.o_groups, -1)
        return self.o_b_proj(self.o_a_proj(grouped).flatten(1))

    # -- cached path
    def forward(self, x, positions, meta, caches):
        cfg = self.cfg
        q_res, q, kv = self._project(x)
        swa_cache = caches[self.swa_name]
        q = torch.ops.pcppass.swa_qnorm_rope_kv_insert(
            q, kv, swa_cache, meta[slot_key(SWA_GROUP)], positions, self.cos_sin_cache, cfg.rms_eps
        )
        # the window: positions p - W + 1 .. p through the ring (ring_len = table width * block size)
        tables = request_tables(meta, SWA_GROUP)
        ring_len = tables.shape[1] * cfg.swa_block_size
        window = positions.unsqueeze(1) + torch.arange(1 - cfg.sliding_window, 1, device=x.device).unsqueeze(0)
        keys = gather_rows(swa_cache, tables, window.clamp_min(0) % ring_len, cfg.swa_block_size)
        valid = window >= 0
        if self.compressor is not None:
            self.compressor(x, positions, meta, caches, self.cos_sin_cache)
            ctables = request_tables(meta, compressed_group(self.ratio))
            span = ctables.shape[1] * cfg.compressed_block_size
            cindex = torch.arange(span, device=x.device).unsqueeze(0).expand(x.shape[0], span)
            visible = cindex < torch.div(positions + 1, self.ratio, rounding_mode="floor").unsqueeze(1)
            if self.indexer is not None:
                self.indexer.compressor(x, positions, meta, caches, self.cos_sin_cache)
                ikeys = read_indexer_keys(caches[self.indexer.keys_name], ctables, cindex, cfg.compressed_block_size,
                                          cfg.index_head_dim, cfg.quant_block_size)
                q_idx, weights = self.indexer.queries(x, q_res, positions, self.cos_sin_cache)
                cindex, visible = select_topk(indexer_scores(q_idx, weights, ikeys, visible), cfg.index_topk)
            compressed = gather_rows(caches[self.compressor.out_name], ctables, cindex, cfg.compressed_block_size)
            keys = torch.cat((keys, compressed), dim=1)
            valid = torch.cat((valid, visible), dim=1)
        return self._output(q, keys, valid, positions)

    # -- no-cache reference: the fused ops' math unfused, rows cast / quantised as the caches store them
    def reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        q_res, q, kv = self._project(x)
        q = rope(rms_norm(q, None, cfg.rms_eps), positions, self.cos_sin_cache, "interleaved", "last")
        kv = rope(kv, positions, self.cos_sin_cache, "interleaved", "last").to(cfg.dtype)
        causal = reference_causal(x.shape[0], x.device)
        in_window = positions.unsqueeze(0) > positions.unsqueeze(1) - cfg.sliding_window
        keys, valid = reference_rows(kv), causal & in_window
        if self.compressor is not None:
            rows = self.compressor.reference(x, self.cos_sin_cache)
            cindex = torch.arange(rows.shape[0], device=x.device)
            visible = cindex.unsqueeze(0) < torch.div(positions + 1, self.ratio, rounding_mode="floor").unsqueeze(1)
            if self.indexer is not None:
                ikeys = self.indexer.compressor.reference(x, self.cos_sin_cache)
                q_idx, weights = self.indexer.queries(x, q_res, positions, self.cos_sin_cache)
                picked, visible = select_topk(indexer_scores(q_idx, weights, reference_rows(ikeys, x.shape[0]), visible),
                                              cfg.index_topk)
                compressed = rows[picked]
            else:
                compressed = reference_rows(rows, x.shape[0])
            keys = torch.cat((keys, compressed), dim=1)
            valid = torch.cat((valid, visible), dim=1)
        return self._output(q, keys, valid, positions)


class DeepseekV4Model(PagedCausalLM):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__(ModelDims(cfg.vocab_size, cfg.hidden_size, cfg.rms_eps, cfg.dtype))
        if any(r < 0 for r in cfg.compress_ratios):
            raise ValueError(f"deepseek_v4: compress ratios must be >= 0, got {cfg.compress_ratios}")
        if (cfg.num_heads * cfg.head_dim) % cfg.o_groups:
            raise ValueError(f"deepseek_v4: o_groups {cfg.o_groups} must divide num_heads * head_dim")
        self.config = cfg
        for i in range(cfg.num_layers):
            self.layers.append(
                DecoderLayer(DeepseekV4Attention(cfg, i), cfg.hidden_size, cfg.intermediate_size, cfg.rms_eps,
                             cfg.dtype)
            )

    def cache_groups(self) -> list[CacheGroupSpec]:
        cfg = self.config
        groups = [CacheGroupSpec(SWA_GROUP, cfg.swa_block_size, "ring", window=cfg.sliding_window)]
        for r in sorted({r for r in cfg.compress_ratios if r}):
            span = (2 if r == INDEXER_RATIO else 1) * r  # states one compressed row reads back
            groups.append(CacheGroupSpec(state_group(r), state_block_size(r), "ring", window=span))
            groups.append(CacheGroupSpec(compressed_group(r), cfg.compressed_block_size, "compressed", ratio=r))
        return groups
