"""The attention kernels as custom ops (namespace ``pcppass``), opaque to ``torch.compile``.

They read caches and write nothing but their fresh output (no ``Tensor(a!)`` argument), so the
state-write analysis has nothing to report for them; a graph that calls them traces, compiles
under Inductor and replays from a CUDA graph (no host reads).

==================================  ===============================================================
op                                  returns
==================================  ===============================================================
``paged_gqa_attention``             ``[T, H, Dv]`` causal attention over paged K/V caches
``paged_mla_attention``             ``[T, H, L]`` latent MLA attention over a paged latent cache
``indexer_sparse_mla_attention``    ``[T, H, L]`` the same over each row's top-k positions by the
                                    lightning indexer's score (DeepSeek-V3.2)
==================================  ===============================================================
"""

from __future__ import annotations

import torch

from pcppass.engine.attention import launch
from pcppass.engine.attention.select import select_topk_triton


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
    return q_latent.new_empty(q_latent.shape)  # contiguous, as the kernel writes it


@torch.library.custom_op("pcppass::indexer_sparse_mla_attention", mutates_args=())
def indexer_sparse_mla_attention(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    q_index: torch.Tensor, index_weights: torch.Tensor, indexer_cache: torch.Tensor, indexer_block_table: torch.Tensor,
    positions: torch.Tensor, token_to_req: torch.Tensor, query_start_loc: torch.Tensor, is_padding: torch.Tensor,
    quant_block_size: int, topk: int, scale: float, ds_mla: bool,
) -> torch.Tensor:
    """DeepSeek-V3.2 sparse attention in one op: lightning-indexer scores over the fp8 indexer
    cache, the top-``topk`` positions (a radix select, never a sort), MLA over those rows of the
    latent cache. (One op, so the selection never leaves it: an op whose result only feeds another
    opaque op would look like a dependency token to the state-write analysis, which then suspects a
    hidden write.)"""
    index_rows = _rows(indexer_block_table, positions, token_to_req, query_start_loc, is_padding)
    selected = select_topk_triton(launch.indexer_scores(q_index, index_weights, indexer_cache, index_rows,
                                                        quant_block_size), topk)
    rows = _rows(block_table, positions, token_to_req, query_start_loc, is_padding)
    return launch.mla_attention(q_latent, q_pe, kv_cache, rows, scale, ds_mla, selected)


@indexer_sparse_mla_attention.register_fake
def _(q_latent, q_pe, kv_cache, block_table, q_index, index_weights, indexer_cache, indexer_block_table, positions,
      token_to_req, query_start_loc, is_padding, quant_block_size, topk, scale, ds_mla):
    return q_latent.new_empty(q_latent.shape)  # contiguous, as the kernel writes it
