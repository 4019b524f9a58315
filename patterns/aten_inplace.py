"""In-place aten writes as written in the Dynamo graph.

* ``cache.index_copy_(dim, index, source)``: rows along ``dim`` selected by ``index`` (HF
  StaticCache: ``keys.index_copy_(2, cache_position, k)``) -> :class:`~pcppass.spec.IndexedDim`.
* ``view[index] = src`` / ``view.index_put_((index,), src)`` with one integer index tensor: on a view
  that merges the first two dims of a paged cache the index is the slot (paged rows); otherwise the
  rows along the indexed dim (full slices before it, e.g. HF's ``keys[:, :, cache_position] = k``).

The classifier fills in the dim from the call; anything else (masks, several index tensors,
constant indices) is not covered.
"""

from pcppass.registry import register_pattern
from pcppass.spec import CacheRole, IndexedDim, Recipe, WritePattern

INDEX_COPY = register_pattern(WritePattern(
    name="aten.index_copy_",
    ops=("aten::index_copy_",),
    caches=(CacheRole("self", slots="index", layout=IndexedDim()),),
    row_args={"index": 0},
    recipe=Recipe.COPY_ROWS,
    aten_family="index_copy_",
    doc="cache.index_copy_(dim, index, source)",
))

INDEX_PUT = register_pattern(WritePattern(
    name="aten.index_put_",
    ops=("aten::index_put_",),
    caches=(CacheRole("self", slots="indices", layout=IndexedDim()),),
    row_args={"indices": 0},
    recipe=Recipe.COPY_ROWS,
    aten_family="index_put_",
    doc="cache.index_put_((index,), values)",
))

SETITEM = register_pattern(WritePattern(
    name="aten.setitem",
    ops=("operator.setitem",),
    caches=(CacheRole("self", slots="indices", layout=IndexedDim()),),
    row_args={"indices": 0},
    recipe=Recipe.COPY_ROWS,
    aten_family="setitem",
    doc="cache[index] = values",
))
