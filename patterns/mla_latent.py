"""MLA latent cache: ``concat_and_cache_mla`` (pcppass and vLLM spellings).

``kv_cache`` is ``[num_blocks, block_size, L + R]`` ("auto"/"fp8") or uint8
``[num_blocks, block_size, 656]`` ("fp8_ds_mla": per-tile scales computed from the data). Either way
one slot is one contiguous row, and copying the owner's bytes reproduces the write exactly.
"""

from pcppass.registry import register_pattern
from pcppass.spec import CacheRole, PagedRows, Recipe, WritePattern

CONCAT_AND_CACHE_MLA = register_pattern(WritePattern(
    name="concat_and_cache_mla",
    ops=("pcppass::concat_and_cache_mla", "_C_cache_ops::concat_and_cache_mla"),
    caches=(CacheRole("kv_cache", slots="slot_mapping", layout=PagedRows()),),
    row_args={"kv_c": 0, "k_pe": 0, "slot_mapping": 0},
    recipe=Recipe.COPY_ROWS,
    doc="MLA latent + RoPE key store (auto, fp8, fp8_ds_mla)",
))
