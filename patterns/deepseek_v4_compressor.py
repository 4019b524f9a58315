"""DeepSeek-V4 compressor: per-token state save, and the compressed store at group boundaries.

``compressor_save_state`` stores one fp32 state row per token (COPY_ROWS). ``compressor_compress_store``
reads earlier tokens' states through the row's ring block table and writes one compressed row where
the slot mapping is >= 0; it is a stateful op, so replicas re-run it on the owner's gathered row
inputs (RERUN) after the state rows they read are in place. Its cache is paged rows of the cache
dtype ("auto") or the block-split fp8 indexer layout ("fp8_indexer", D = ``norm_weight`` width).
"""

from pcppass.registry import register_pattern
from pcppass.spec import ByArgValue, BlockSplit, CacheRole, PagedRows, Recipe, WritePattern

COMPRESSOR_SAVE_STATE = register_pattern(WritePattern(
    name="compressor_save_state",
    ops=("pcppass::compressor_save_state",),
    caches=(CacheRole("state_cache", slots="slot_mapping", layout=PagedRows(),
                      values=("kv", "score")),),
    row_args={"kv": 0, "score": 0, "positions": 0, "slot_mapping": 0},
    recipe=Recipe.COPY_ROWS,
    doc="compressor partial state (kv, score + ape) per token, fp32",
))

COMPRESSOR_COMPRESS_STORE = register_pattern(WritePattern(
    name="compressor_compress_store",
    ops=("pcppass::compressor_compress_store",),
    caches=(CacheRole(
        "compressed_cache", slots="slot_mapping",
        layout=ByArgValue(arg="kv_cache_dtype", cases=(
            ("auto", PagedRows()),
            ("fp8_indexer", BlockSplit(value_arg="norm_weight", quant_block_arg="quant_block_size")),
        )),
    ),),
    row_args={"positions": 0, "state_block_table": 0, "slot_mapping": 0},
    recipe=Recipe.RERUN,
    doc="compress a group of states (softmax-weighted sum, norm, RoPE) into one cache row",
))
