"""The attention kernels as custom ops (namespace ``pcppass``), opaque to ``torch.compile``.

They read caches and write nothing but their fresh output (no ``Tensor(a!)`` argument), so the
state-write analysis has nothing to report for them; a graph that calls them traces, compiles
under Inductor and replays from a CUDA graph (no host reads).

==================================  ===============================================================
op                                  returns
==================================  ===============================================================
``paged_gqa_attention``             ``[T, H, Dv]`` causal attention over paged K/V caches
``paged_mla_attention``             ``[T, H, L]`` latent MLA attention over a paged latent cache
``sparse_mla_attention``            ``[T, H, L]`` the same over each row's selected positions only
``lightning_indexer_topk``          ``[T, k]`` int64: the top-k positions by indexer score, -1 unused
==================================  ===============================================================
"""

from __future__ import annotations

import torch

from pcppass.kernels.attention import launch


def _rows(block_table, positions, token_to_req, query_start_loc, is_padding) -> launch.StepRows:
    return launch.StepRows(block_table, positions, token_to_req, query_start_loc, is_padding)


@torch.library.custom_op("pcppass::paged_gqa_attention", mutates_args=())
def paged_gqa_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
    positions: torch.Tensor, token_to_req: torch.Tensor, query_start_loc: torch.Tensor, is_padding: torch.Tensor,
    scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    rows = _rows(block_table, positions, token_to_req, query_start_loc, is_padding)
    return launch.gqa_attention(q, key_cache, value_cache, rows, scale, k_scale, v_scale)


@paged_gqa_attention.register_fake
def _(q, key_cache, value_cache, block_table, positions, token_to_req, query_start_loc, is_padding, scale,
      k_scale=None, v_scale=None):
    return q.new_empty((q.shape[0], q.shape[1], value_cache.shape[-1]))


@torch.library.custom_op("pcppass::paged_mla_attention", mutates_args=())
def paged_mla_attention(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    positions: torch.Tensor, token_to_req: torch.Tensor, query_start_loc: torch.Tensor, is_padding: torch.Tensor,
    scale: float, ds_mla: bool,
) -> torch.Tensor:
    rows = _rows(block_table, positions, token_to_req, query_start_loc, is_padding)
    return launch.mla_attention(q_latent, q_pe, kv_cache, rows, scale, ds_mla)


@paged_mla_attention.register_fake
def _(q_latent, q_pe, kv_cache, block_table, positions, token_to_req, query_start_loc, is_padding, scale,
      ds_mla):
    return torch.empty_like(q_latent)


@torch.library.custom_op("pcppass::sparse_mla_attention", mutates_args=())
def sparse_mla_attention(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    positions: torch.Tensor, token_to_req: torch.Tensor, query_start_loc: torch.Tensor, is_padding: torch.Tensor,
    index: torch.Tensor, scale: float, ds_mla: bool,
) -> torch.Tensor:
    rows = _rows(block_table, positions, token_to_req, query_start_loc, is_padding)
    return launch.mla_attention(q_latent, q_pe, kv_cache, rows, scale, ds_mla, index)


@sparse_mla_attention.register_fake
def _(q_latent, q_pe, kv_cache, block_table, positions, token_to_req, query_start_loc, is_padding, index,
      scale, ds_mla):
    return torch.empty_like(q_latent)


@torch.library.custom_op("pcppass::lightning_indexer_topk", mutates_args=())
def lightning_indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, indexer_cache: torch.Tensor, block_table: torch.Tensor,
    positions: torch.Tensor, token_to_req: torch.Tensor, query_start_loc: torch.Tensor, is_padding: torch.Tensor,
    quant_block_size: int, topk: int,
) -> torch.Tensor:
    rows = _rows(block_table, positions, token_to_req, query_start_loc, is_padding)
    return launch.select_topk(launch.indexer_scores(q, weights, indexer_cache, rows, quant_block_size), topk)


@lightning_indexer_topk.register_fake
def _(q, weights, indexer_cache, block_table, positions, token_to_req, query_start_loc, is_padding,
      quant_block_size, topk):
    return q.new_empty((q.shape[0], topk), dtype=torch.int64)
