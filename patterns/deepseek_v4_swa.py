"""DeepSeek-V4 sliding window: ``swa_qnorm_rope_kv_insert`` stores K/V rows into a ring cache.

The ring is addressed by the slot mapping like any paged cache (``[num_blocks, block_size, D]``);
the op also returns the normalised, roped Q (an output, not a cache write; slot -1 zeroes its row, so the
op's slots are never masked).
"""

from pcppass.registry import register_pattern
from pcppass.spec import CacheRole, PagedRows, Recipe, WritePattern

SWA_QNORM_ROPE_KV_INSERT = register_pattern(WritePattern(
    name="swa_qnorm_rope_kv_insert",
    ops=("pcppass::swa_qnorm_rope_kv_insert",),
    caches=(CacheRole("swa_cache", slots="slot_mapping", layout=PagedRows(), values=("kv",)),),
    row_args={"q": 0, "kv": 0, "slot_mapping": 0, "positions": 0},
    recipe=Recipe.COPY_ROWS,
    doc="sliding-window KV insert fused with Q norm + RoPE",
))
