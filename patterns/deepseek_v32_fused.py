"""DeepSeek-V3.2 fused direct write: ``fused_norm_rope`` writes the MLA and the indexer cache.

Two caches, two slot mappings, and a fused Q output. The op skips the WHOLE token (Q included) when
its ``slot_mapping`` entry is -1, so replicas are never synchronised by masking this op's slots:
the owner's bytes are copied instead (COPY_ROWS), and the Q output stays the owner's.
"""

from pcppass.registry import register_pattern
from pcppass.spec import BlockSplit, CacheRole, PagedRows, Recipe, WritePattern

FUSED_NORM_ROPE = register_pattern(WritePattern(
    name="fused_norm_rope",
    ops=("pcppass::fused_norm_rope",),
    caches=(
        CacheRole("mla_kv_cache", slots="slot_mapping", layout=PagedRows()),
        CacheRole(
            "indexer_k_cache", slots="indexer_slot_mapping",
            layout=BlockSplit(value_arg="index_k", quant_block_arg="quant_block_size"),
        ),
    ),
    row_args={
        "positions": 0, "q_c": 0, "kv_c": 0, "k_pe": 0, "index_k": 0,
        "slot_mapping": 0, "indexer_slot_mapping": 0,
    },
    recipe=Recipe.COPY_ROWS,
    doc="Q RMSNorm (returned) + MLA KV and indexer K stores in one op",
))
