"""Pieces shared by the reference models: norms, RoPE tables, paged cache readers, attention.

Every model here follows :mod:`pcppass.contract`: attention reads K/V only through the paged
caches (for prefill and decode alike), so a rank's output depends on nothing but its cache replica.
A row ``t`` of a step belongs to request ``token_to_req[t]``; its block table row in group ``g`` is
``meta["block_table.<g>"][meta["token_to_req"]][t]``, and it sees the positions ``<= positions[t]``.

Normalisation, RoPE and the fp8 encoders / decoders come from :mod:`pcppass.ops.math` and
:mod:`pcppass.ops.quant`, the same functions the fused cache-write ops use, so the models'
no-cache reference paths (``reference_forward``) replay exactly the rounding of the cached paths.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

import pcppass.ops  # noqa: F401  (registers torch.ops.pcppass.*)
import pcppass.engine.attention  # noqa: F401  (registers the paged attention ops of the CUDA paths)
from pcppass.contract import (
    IS_PADDING,
    QUERY_START_LOC,
    TOKEN_TO_REQ,
    CacheGroupSpec,
    CacheSpec,
    table_key,
)
from pcppass.ops.math import layer_norm, rms_norm, rope
from pcppass.ops.quant import bytes_float32, dequant_fp8, encode_indexer_rows, split_indexer_cache

__all__ = [
    "DecoderLayer",
    "LayerNorm",
    "MLP",
    "ModelDims",
    "PagedCausalLM",
    "RMSNorm",
    "attend",
    "causal_full_rows",
    "gather_rows",
    "indexer_roundtrip",
    "indexer_scores",
    "linear",
    "materialize",
    "mla_attend",
    "mla_attend_paged",
    "mla_up_weights",
    "paged_kernels",
    "force_paged_kernels",
    "paged_rows",
    "read_indexer_keys",
    "reference_causal",
    "reference_rows",
    "request_tables",
    "rope",
    "rope_cos_sin_cache",
    "select_topk",
    "stable_topk",
    "with_overrides",
]


# ------------------------------------------------------------------------------------- configs


def with_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """``dataclasses.replace`` that names the model config when an override key is unknown."""
    known = {f.name for f in fields(config)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"{type(config).__name__} has no option(s) {unknown}; options: {sorted(known)}")
    return replace(config, **overrides)


# ------------------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


def linear(in_features: int, out_features: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False, dtype=dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` (dense; no experts)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = linear(hidden, intermediate, dtype)
        self.up_proj = linear(hidden, intermediate, dtype)
        self.down_proj = linear(intermediate, hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin_cache(rot_dim: int, max_position: int, theta: float) -> torch.Tensor:
    """vLLM layout ``[max_position, rot_dim]`` = ``cat(cos, sin)``, float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch.float32)


# --------------------------------------------------------------------------------- paged reads


def request_tables(meta: dict[str, torch.Tensor], group: str) -> torch.Tensor:
    """``[T, max_blocks]``: each row's block table row in ``group``."""
    return meta[table_key(group)][meta["token_to_req"]]


def gather_rows(cache: torch.Tensor, tables: torch.Tensor, index: torch.Tensor, block_size: int) -> torch.Tensor:
    """Rows at logical indices ``index [T, S]`` (clamped into the table by the caller) of a paged
    cache ``[nb, bs, ...]`` through per-row tables ``[T, nblk]`` -> ``[T, S, ...]``.

    Two-index gather (block, offset) instead of a flat view, so caches whose block stride is not
    ``bs * row`` (e.g. a slice of a block-split cache) are read without a copy.
    """
    blocks = tables.gather(1, torch.div(index, block_size, rounding_mode="floor"))
    return cache[blocks, index % block_size]


def causal_full_rows(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a ``full``-addressed group: every logical position a row's table covers, ``index [T, S]``
    with ``S = nblk * bs``, and ``valid [T, S]`` = position ``<= positions[t]`` (causal)."""
    span = tables.shape[1] * block_size
    index = torch.arange(span, device=tables.device).unsqueeze(0).expand(tables.shape[0], span)
    return index, index <= positions.unsqueeze(1)


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores per row, lowest index first among exact ties.

    ``torch.topk`` leaves the order of ties unspecified; exact ties are common here (a key whose
    ReLU scores are all zero scores exactly 0), and the cached and reference paths must pick the
    same keys. A stable descending sort makes the choice a function of the scores alone.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row attention over gathered keys.

    ``q [T, H, D]``, ``k [T, S, Hk, D]``, ``v [T, S, Hk, Dv]`` (``H`` a multiple of ``Hk``: GQA/MQA),
    ``valid [T, S]``; ``sinks [H]`` adds a per-head logit that takes probability mass and no value
    (attention sink). Scores and softmax in float32; returns ``[T, H, Dv]`` in ``v``'s dtype.
    """
    t, h, d = q.shape
    hk = k.shape[2]
    qg = q.reshape(t, hk, h // hk, d)
    scores = torch.einsum("tkgd,tskd->tkgs", qg, k.to(q.dtype)).float() * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, hk, h // hk, 1).expand(t, hk, h // hk, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("tkgs,tskd->tkgd", probs.to(v.dtype), v)
    return out.reshape(t, h, v.shape[-1])


def mla_attend(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    valid: torch.Tensor,
    kv_b_weight: torch.Tensor,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """MLA attention in the latent space (weight absorption), reading only the latent cache.

    ``q_nope [T, H, N]``, ``q_pe [T, H, R]``; gathered ``kv_c [T, S, L]``, ``k_pe [T, S, R]``,
    ``valid [T, S]``; ``kv_b_weight [H*(N+V), L]`` is the up-projection ``kv_b_proj`` splits into
    ``W_UK [H, N, L]`` (absorbed into the query) and ``W_UV [H, V, L]`` (applied to the latent
    output). Returns ``[T, H, V]``.
    """
    w_uk, w_uv = mla_up_weights(kv_b_weight, q_nope.shape[1], q_nope.shape[2], v_head_dim, kv_c.shape[-1])
    q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
    scores = torch.einsum("thl,tsl->ths", q_latent, kv_c) + torch.einsum("thr,tsr->ths", q_pe, k_pe)
    scores = scores.float().mul(scale).masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(kv_c.dtype)
    out_latent = torch.einsum("ths,tsl->thl", probs, kv_c)
    return torch.einsum("thl,hvl->thv", out_latent, w_uv)


def mla_up_weights(kv_b_weight: torch.Tensor, heads: int, nope: int, v_head_dim: int, latent: int):
    """``kv_b_proj``'s weight split into ``W_UK [H, N, L]`` and ``W_UV [H, V, L]``."""
    w = kv_b_weight.view(heads, nope + v_head_dim, latent)
    return w[:, :nope], w[:, nope:]


# ------------------------------------------------------------------- paged kernels (CUDA paths)


_FORCED_PATH: bool | None = None


def paged_kernels(x: torch.Tensor) -> bool:
    """Whether attention runs through the paged kernels: on CUDA tensors, unless
    :func:`force_paged_kernels` says otherwise (tests: the kernels on CPU under
    ``TRITON_INTERPRET=1``, the reference paths on CUDA). Otherwise the models keep their reference
    paths (gather every visible row, attend in plain torch)."""
    return x.is_cuda if _FORCED_PATH is None else _FORCED_PATH


@contextlib.contextmanager
def force_paged_kernels(enabled: bool) -> Iterator[None]:
    """Inside the block, every model attends through the kernels (``True``) or the reference
    paths (``False``) whatever the device."""
    global _FORCED_PATH
    previous, _FORCED_PATH = _FORCED_PATH, enabled
    try:
        yield
    finally:
        _FORCED_PATH = previous


def paged_rows(meta: dict[str, torch.Tensor], group: str, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the paged attention kernels read of a step, in their argument order: ``group``'s block
    table (one row per local request), ``positions``, ``token_to_req``, ``query_start_loc``,
    ``is_padding`` (see :mod:`pcppass.engine.attention.ops`)."""
    return meta[table_key(group)], positions, meta[TOKEN_TO_REQ], meta[QUERY_START_LOC], meta[IS_PADDING]


def mla_attend_paged(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    rows: tuple[torch.Tensor, ...],
    kv_b_weight: torch.Tensor,
    v_head_dim: int,
    scale: float,
    ds_mla: bool,
    indexer: tuple | None = None,
) -> torch.Tensor:
    """:func:`mla_attend` on CUDA: the same weight absorption around a kernel that reads the latent
    cache through the block table; ``rows`` is :func:`paged_rows` of the cache's group. ``indexer``
    = (q_idx, weights, indexer cache, indexer block table, quant_block_size, topk): attend only to
    each row's top-k positions by the lightning indexer's score. Returns ``[T, H, V]``."""
    w_uk, w_uv = mla_up_weights(kv_b_weight, q_nope.shape[1], q_nope.shape[2], v_head_dim, kv_b_weight.shape[-1])
    q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
    if indexer is None:
        out_latent = torch.ops.pcppass.paged_mla_attention(q_latent, q_pe, cache, *rows, scale, ds_mla)
    else:
        q_idx, weights, indexer_cache, indexer_table, quant_block_size, topk = indexer
        out_latent = torch.ops.pcppass.indexer_sparse_mla_attention(
            q_latent, q_pe, cache, rows[0], q_idx, weights, indexer_cache, indexer_table, *rows[1:],
            quant_block_size, topk, scale, ds_mla)
    return torch.einsum("thl,hvl->thv", out_latent, w_uv)


def read_indexer_keys(
    cache: torch.Tensor, tables: torch.Tensor, index: torch.Tensor, block_size: int, head_dim: int, quant_block_size: int
) -> torch.Tensor:
    """Dequantised keys ``[T, S, D]`` (float32) at logical ``index [T, S]`` of a block-split fp8
    indexer cache ``[nb, bs*(D + 4*D/qbs)]``: codes and scales of a token live in different
    parts of its block, so both are gathered by (block, offset)."""
    codes, scales = split_indexer_cache(cache, head_dim, quant_block_size)
    blocks = tables.gather(1, torch.div(index, block_size, rounding_mode="floor"))
    offsets = index % block_size
    code_rows = codes[blocks, offsets].unflatten(-1, (-1, quant_block_size))
    return dequant_fp8(code_rows, scales[blocks, offsets].unsqueeze(-1)).flatten(-2)


def indexer_roundtrip(k: torch.Tensor, quant_block_size: int, scale_fmt: str) -> torch.Tensor:
    """``k [L, D]`` as the fp8 indexer cache returns it (float32): the no-cache reference."""
    codes, scale_bytes = encode_indexer_rows(k, quant_block_size, scale_fmt)
    scales = bytes_float32(scale_bytes)
    return dequant_fp8(codes.unflatten(-1, (-1, quant_block_size)), scales.unsqueeze(-1)).flatten(-2)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores ``[T, S]`` = ``sum_h weights[t, h] * relu(q[t, h] . keys[t, s])``,
    ``-inf`` where not ``valid``. ``q [T, Hi, D]``, ``weights [T, Hi]``, ``keys [T, S, D]`` (fp32)."""
    per_head = torch.einsum("thd,tsd->ths", q.float(), keys.float()).relu()
    scores = (per_head * weights.float().unsqueeze(-1)).sum(dim=1)
    return scores.masked_fill(~valid, float("-inf"))


def select_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` candidate indices ``[T, k]`` of ``scores [T, S]`` and whether each is a real,
    visible candidate. ``S`` may be smaller than ``k`` (short requests): the scores are padded
    with ``k`` columns of ``-inf``, and padding or masked picks come back invalid, index 0."""
    padded = torch.cat((scores, scores.new_full((scores.shape[0], k), float("-inf"))), dim=1)
    picked = stable_topk(padded, k)
    valid = padded.gather(1, picked) > float("-inf")
    return torch.where(valid, picked, torch.zeros_like(picked)), valid


def reference_rows(x: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
    """``[S, ...]`` keys -> ``[num_rows, S, ...]`` (default ``num_rows = S``): every query row sees
    every key (masks are applied separately), the no-cache counterpart of a paged gather."""
    return x.unsqueeze(0).expand(x.shape[0] if num_rows is None else num_rows, *x.shape)


def reference_causal(length: int, device: torch.device) -> torch.Tensor:
    idx = torch.arange(length, device=device)
    return idx.unsqueeze(0) <= idx.unsqueeze(1)


# ------------------------------------------------------------------------------------- model


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, attn: nn.Module, hidden: int, intermediate: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_norm = RMSNorm(hidden, eps, dtype)
        self.attn = attn
        self.post_attn_norm = RMSNorm(hidden, eps, dtype)
        self.mlp = MLP(hidden, intermediate, dtype)

    def forward(self, x, positions, meta, caches):
        x = x + self.attn(self.input_norm(x), positions, meta, caches)
        return x + self.mlp(self.post_attn_norm(x))

    def reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.reference(self.input_norm(x), positions)
        return x + self.mlp(self.post_attn_norm(x))


@dataclass(frozen=True)
class ModelDims:
    vocab_size: int
    hidden_size: int
    rms_eps: float
    dtype: torch.dtype


class PagedCausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm; ``compute_logits`` applies the LM head.

    Subclasses build ``self.layers`` (each a :class:`DecoderLayer` whose attention implements
    ``forward(x, positions, meta, caches)``, ``reference(x, positions)``, ``cache_specs()``) and
    implement ``cache_groups()``.
    """

    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size, dtype=dims.dtype)
        self.layers = nn.ModuleList()
        self.norm = RMSNorm(dims.hidden_size, dims.rms_eps, dims.dtype)
        self.lm_head = linear(dims.hidden_size, dims.vocab_size, dims.dtype)

    # -- model contract
    def cache_groups(self) -> list[CacheGroupSpec]:
        raise NotImplementedError

    def cache_specs(self) -> list[CacheSpec]:
        return [spec for layer in self.layers for spec in layer.attn.cache_specs()]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: dict[str, torch.Tensor],
        caches: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, positions, meta, caches)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # -- testing
    @torch.no_grad()
    def reference_forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[L, vocab]`` of one sequence recomputed without any cache, with the same
        quantisation round-trips as the cached path."""
        positions = torch.arange(token_ids.shape[0], device=token_ids.device)
        h = self.embed_tokens(token_ids)
        for layer in self.layers:
            h = layer.reference(h, positions)
        return self.compute_logits(self.norm(h))


# --------------------------------------------------------------------------------- construction


def _fill_parameter(name: str, p: torch.Tensor, module: nn.Module, gen: torch.Generator) -> None:
    """Seeded random weights, scaled so activations stay O(1) through the layers."""
    if isinstance(module, nn.Linear):
        p.normal_(0.0, module.in_features**-0.5, generator=gen)
    elif isinstance(module, nn.Embedding):
        p.normal_(0.0, 1.0, generator=gen)
    elif isinstance(module, (RMSNorm, LayerNorm)) and name == "weight":
        p.normal_(1.0, 0.1, generator=gen)
    elif isinstance(module, LayerNorm) and name == "bias":
        p.normal_(0.0, 0.1, generator=gen)
    else:
        init = getattr(module, "init_parameter", None)
        if init is None:
            raise TypeError(f"no initialiser for parameter {name!r} of {type(module).__name__}")
        init(name, p, gen)


def materialize(model: PagedCausalLM, device: torch.device | str, seed: int) -> PagedCausalLM:
    """Move a model built on the ``meta`` device to ``device`` with seeded weights; modules with
    buffers (RoPE tables, fp8 scales) rebuild them in ``reset_buffers()``."""
    device = torch.device(device)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                _fill_parameter(name, p, module, gen)
            reset = getattr(module, "reset_buffers", None)
            if reset is not None:
                reset()
    return model.eval().requires_grad_(False)
