"""GQA K/V: ``reshape_and_cache_flash`` (pcppass and vLLM spellings).

``key_cache``/``value_cache`` are ``[num_blocks, block_size, H, D]`` (any strides); slot ``s`` is row
``cache[s // bs, s % bs]``. fp8 caches store per-tensor-scaled bytes: copying the owner's bytes is
exact, so the recipe is COPY_ROWS.
"""

from pcppass.registry import register_pattern
from pcppass.spec import CacheRole, PagedRows, Recipe, WritePattern

RESHAPE_AND_CACHE_FLASH = register_pattern(WritePattern(
    name="reshape_and_cache_flash",
    ops=("pcppass::reshape_and_cache_flash", "_C_cache_ops::reshape_and_cache_flash"),
    caches=(
        CacheRole("key_cache", slots="slot_mapping", layout=PagedRows(), values=("key",)),
        CacheRole("value_cache", slots="slot_mapping", layout=PagedRows(), values=("value",)),
    ),
    row_args={"key": 0, "value": 0, "slot_mapping": 0},
    recipe=Recipe.COPY_ROWS,
    doc="GQA K/V store into two paged caches",
))
