"""The pattern language: how one write family is declared.

A :class:`WritePattern` says, for one mutating op (under any of its spellings), which arguments are
caches, which slot mapping addresses each cache, how a slot maps to bytes in that cache
(:class:`RowLayout`), which arguments are per-row inputs, and how another replica reproduces the
owner's write (:class:`Recipe`). Patterns are data: analysis matches them, the rewrite and the
runtime interpret them. Nothing here touches a graph or a process group.

Example (the whole GQA K/V family)::

    register_pattern(WritePattern(
        name="reshape_and_cache_flash",
        ops=("pcppass::reshape_and_cache_flash", "_C_cache_ops::reshape_and_cache_flash"),
        caches=(CacheRole("key_cache", slots="slot_mapping", layout=PagedRows()),
                CacheRole("value_cache", slots="slot_mapping", layout=PagedRows())),
        row_args={"key": 0, "value": 0, "slot_mapping": 0},
        recipe=Recipe.COPY_ROWS,
    ))
"""

from __future__ import annotations

import enum
import hashlib
import inspect
import json
from dataclasses import dataclass, field
from typing import Mapping


class Recipe(str, enum.Enum):
    """How a replica that did not own a row reproduces the owner's write."""

    #: Read the bytes the owner wrote (by slot, through the layout) and copy them into every other
    #: replica. Exact for any write, quantised or not; moves only the written bytes.
    COPY_ROWS = "copy_rows"
    #: Gather the owner's per-row inputs and run the same op again on every other replica, with the
    #: replica's own rows masked out (slot -1) and every non-cache output discarded. For stateful ops
    #: whose effect is not a plain row store.
    RERUN = "rerun"
    #: Nothing to reproduce: the op only reads the state its handle addresses (vLLM's attention
    #: ops take the layer name to fetch the KV cache they read). Declared so the audit can say so.
    READ_ONLY = "read_only"


@dataclass(frozen=True)
class ResolvedLayout:
    """A layout with every size known, for one concrete cache.

    ``block_size`` rows per block; ``bytes_per_row`` the bytes one slot's row occupies (summed over
    segments); ``segments`` for :class:`BlockSplit` as ``(base, stride, length)`` byte triples within
    one block (token ``o``'s segment lies at ``base + o * stride``).
    """

    kind: str
    block_size: int
    bytes_per_row: int
    segments: tuple[tuple[int, int, int], ...] = ()
    dim: int = 0


@dataclass(frozen=True)
class RowLayout:
    """How slot ``s = block * block_size + offset`` addresses one row's bytes in a cache."""

    kind: str = "abstract"

    def resolve(self, cache_shape, cache_itemsize: int, args: Mapping[str, object]) -> ResolvedLayout:
        raise NotImplementedError


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclass(frozen=True)
class PagedRows(RowLayout):
    """``cache[num_blocks, block_size, *row]``: one row is ``cache[s // bs, s % bs]`` (any strides)."""

    kind: str = "paged_rows"

    def resolve(self, cache_shape, cache_itemsize, args):
        if len(cache_shape) < 2:
            raise ValueError(f"paged cache must be [num_blocks, block_size, ...], got {list(cache_shape)}")
        return ResolvedLayout(
            self.kind, int(cache_shape[1]), _numel(cache_shape[2:]) * cache_itemsize
        )


@dataclass(frozen=True)
class BlockSplit(RowLayout):
    """``cache[num_blocks, block_size * (value_bytes + scale_bytes)]`` of uint8, block-split.

    The first ``block_size * value_bytes`` bytes of a block hold every token's values (token ``o``
    at ``o * value_bytes``), then ``block_size`` scale records of ``scale_bytes`` (token ``o`` at
    ``block_size * value_bytes + o * scale_bytes``): one token's bytes are two segments.
    ``value_bytes = row_arg.shape[-1]`` (one fp8 byte per element) and
    ``scale_bytes = 4 * value_bytes // args[quant_block_arg]`` (one fp32 per quantisation block).
    """

    kind: str = "block_split"
    value_arg: str = "k"
    quant_block_arg: str = "quant_block_size"

    def resolve(self, cache_shape, cache_itemsize, args):
        value = args[self.value_arg]
        value_bytes = int(value.shape[-1])
        scale_bytes = 4 * value_bytes // int(args[self.quant_block_arg])
        block_bytes = _numel(cache_shape[1:]) * cache_itemsize
        per_token = value_bytes + scale_bytes
        if block_bytes % per_token:
            raise ValueError(
                f"block-split cache block of {block_bytes} B is not a multiple of {per_token} B per token"
            )
        bs = block_bytes // per_token
        return ResolvedLayout(
            self.kind, bs, per_token,
            segments=((0, value_bytes, value_bytes), (bs * value_bytes, scale_bytes, scale_bytes)),
        )


@dataclass(frozen=True)
class IndexedDim(RowLayout):
    """Rows selected along one dim by an index tensor: ``cache.index_copy_(dim, idx, src)``.

    The "slot" of a row is its index along ``dim`` (HF StaticCache: the cache position).
    """

    kind: str = "indexed_dim"
    dim: int = 0

    def resolve(self, cache_shape, cache_itemsize, args):
        dim = self.dim % len(cache_shape)
        rest = [d for i, d in enumerate(cache_shape) if i != dim]
        return ResolvedLayout(self.kind, int(cache_shape[dim]), _numel(rest) * cache_itemsize, dim=dim)


@dataclass(frozen=True)
class ByArgValue(RowLayout):
    """The layout depends on a string/int argument of the op (e.g. ``kv_cache_dtype``).

    ``cases`` maps argument values to layouts, as a tuple of pairs so the pattern stays hashable::

        ByArgValue("kv_cache_dtype", (("auto", PagedRows()),
                                      ("fp8_indexer", BlockSplit(value_arg="norm_weight"))))
    """

    kind: str = "by_arg_value"
    arg: str = ""
    cases: tuple[tuple[object, RowLayout], ...] = ()

    def resolve(self, cache_shape, cache_itemsize, args):
        value = args[self.arg]
        for key, layout in self.cases:
            if key == value:
                return layout.resolve(cache_shape, cache_itemsize, args)
        known = ", ".join(repr(k) for k, _ in self.cases)
        raise ValueError(f"{self.arg}={value!r} has no layout (known: {known})")


@dataclass(frozen=True)
class CacheRole:
    """One cache an op writes: the argument holding it, its slot mapping and its layout."""

    arg: str
    slots: str
    layout: RowLayout = field(default_factory=PagedRows)


@dataclass(frozen=True)
class ContextCache:
    """A cache an op fetches at run time through a handle argument instead of receiving it.

    ``handle`` is the schema argument holding the handle (an opaque object such as vLLM's
    ``LayerName``, or a string naming the state). The pattern's resolver maps the handle's value
    to named tensors; ``cache`` and ``slots`` name the cache view and its slot mapping among them,
    and ``layout`` says how a slot addresses that view (resolved at compile time on what the
    resolver describes, checked at run time on what it returns).
    """

    handle: str
    cache: str
    slots: str
    layout: RowLayout = field(default_factory=PagedRows)


@dataclass(frozen=True)
class WritePattern:
    """A declarative spec of one write family. See the module docstring for an example."""

    name: str
    ops: tuple[str, ...]
    caches: tuple[CacheRole, ...]
    #: per-row input arguments and their row dim (all inputs a re-run needs, slots included);
    #: a re-run discards every output of the op, the owner keeps them all
    row_args: Mapping[str, int] = field(default_factory=dict)
    recipe: Recipe = Recipe.COPY_ROWS
    #: for in-place aten families: method/function spellings matched on the Dynamo graph
    aten_family: str | None = None
    doc: str = ""
    #: caches fetched at run time through a handle argument (see :class:`ContextCache`)
    context: tuple[ContextCache, ...] = ()
    #: name of the registered resolver (:func:`pcppass.registry.register_resolver`) that maps a
    #: handle's value to the tensors of ``context``; a handle with no registered resolver is uncovered
    resolver: str | None = None
    #: handle arguments the op only reads (with ``recipe=Recipe.READ_ONLY`` and no caches)
    reads: tuple[str, ...] = ()

    def context_roles(self, handle_arg: str) -> tuple[ContextCache, ...]:
        """The context caches addressed through the handle argument ``handle_arg``."""
        return tuple(c for c in self.context if c.handle == handle_arg)

    def uuid(self) -> str:
        """Stable identity of this pattern (fields + the layout classes' source)."""
        payload = {
            "name": self.name,
            "ops": list(self.ops),
            "caches": [
                [c.arg, c.slots, type(c.layout).__name__, repr(c.layout)]
                for c in self.caches
            ],
            "row_args": dict(self.row_args),
            "recipe": self.recipe.value,
            "aten_family": self.aten_family,
            "layout_src": [inspect.getsource(type(c.layout)) for c in self.caches],
        }
        if self.context or self.resolver or self.reads:
            payload["context"] = [
                [c.handle, c.cache, c.slots, repr(c.layout), inspect.getsource(type(c.layout))]
                for c in self.context
            ]
            payload["resolver"] = self.resolver
            payload["reads"] = list(self.reads)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def qualified_op_name(target: object) -> str | None:
    """``torch.ops.ns.op`` / ``torch.ops.ns.op.default`` -> ``"ns::op"``; None for other targets."""
    import torch

    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name  # "ns::op"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None
