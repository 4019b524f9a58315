"""Indexer K cache: ``indexer_k_quant_and_cache`` (pcppass and vLLM spellings), block-split.

A block of ``[num_blocks, block_size * (D + 4 * D // quant_block_size)]`` uint8 holds every token's D
fp8 bytes first, then every token's fp32 scales: one token is two segments, which
:class:`~pcppass.spec.BlockSplit` describes (DeepSeek: 128 + 4 = 132 bytes per token).
The last argument is the scale format: ``scale_fmt`` in pcppass, ``kv_cache_dtype`` in vLLM.
"""

from pcppass.registry import register_pattern
from pcppass.spec import BlockSplit, CacheRole, Recipe, WritePattern

INDEXER_K_QUANT_AND_CACHE = register_pattern(WritePattern(
    name="indexer_k_quant_and_cache",
    ops=("pcppass::indexer_k_quant_and_cache", "_C_cache_ops::indexer_k_quant_and_cache"),
    caches=(CacheRole(
        "kv_cache", slots="slot_mapping",
        layout=BlockSplit(value_arg="k", quant_block_arg="quant_block_size"),
    ),),
    row_args={"k": 0, "slot_mapping": 0},
    recipe=Recipe.COPY_ROWS,
    doc="fp8 indexer key store with per-block scales, block-split layout",
))
