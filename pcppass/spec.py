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
        caches=(CacheRole("key_cache", slots="slot_mapping", layout=PagedRows(), values=("key",)),
                CacheRole("value_cache", slots="slot_mapping", layout=PagedRows(), values=("value",))),
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
from collections.abc import Mapping
from typing import ClassVar


class Recipe(str, enum.Enum):
    """How a replica that did not own a row reproduces the owner's write."""

    #: Read the bytes the owner wrote (by slot, through the layout) and copy them into every other
    #: replica. Exact for any write, quantised or not; moves only the written bytes.
    COPY_ROWS = "copy_rows"
    #: Gather the owner's per-row inputs and run the same op again on every other replica, with the
    #: replica's own rows masked out (slot -1) and every non-cache output discarded. For stateful ops
    #: whose effect is not a plain row store. For an op whose caches are context-addressed, the
    #: resolver's ``rerun`` hook re-runs it for the other ranks' rows (a pattern's ``alternatives``).
    RERUN = "rerun"
    #: Nothing to reproduce: the op only reads the state its handle addresses (vLLM's attention
    #: ops take the layer name to fetch the KV cache they read), or writes nothing that outlives the
    #: step through it (a collective's group name). Only a :class:`Reviewed` declaration says so.
    READ_ONLY = "read_only"


@dataclass(frozen=True)
class Reviewed:
    """Why a pattern may say what an op does through a handle the graph cannot look behind.

    A read-only (write-free) declaration is never an assumption: it names the code that was read
    (``source``), the test that shows it on the real graph (``evidence``, ``path::test``) and, for an
    op defined by another package, the releases that code was read in (``package`` as imported,
    ``versions`` a PEP 440 specifier). With another release installed the pattern no longer
    applies and the op is reported uncovered until someone reviews it again::

        Reviewed(source="vllm/distributed/communication_op.py: all_reduce returns a new tensor",
                 evidence="tests/test_vllm_zoo.py::test_moe_and_collectives_on_the_gpu_dispatch",
                 package="vllm", versions=">=0.32.0,<0.33")
    """

    source: str
    evidence: str = field(kw_only=True)
    package: str | None = field(default=None, kw_only=True)
    versions: str = field(default="", kw_only=True)

    def __post_init__(self) -> None:
        _require_name("Reviewed", "source", self.source)
        if not isinstance(self.evidence, str) or "::" not in self.evidence:
            raise ValueError(f"Reviewed.evidence must name a test as 'path::test', got {self.evidence!r}")
        if (self.package is None) != (not self.versions):
            raise ValueError("Reviewed: give both `package` and `versions` (the releases reviewed), or neither")
        if self.versions:
            from packaging.specifiers import InvalidSpecifier, SpecifierSet

            try:
                SpecifierSet(self.versions)
            except InvalidSpecifier as exc:
                raise ValueError(f"Reviewed.versions {self.versions!r} is not a PEP 440 specifier") from exc

    def installed_version(self) -> str | None:
        """The installed release of ``package`` (None when it is not installed)."""
        from importlib import metadata

        if self.package is None:
            return None
        for dist in metadata.packages_distributions().get(self.package, [self.package]):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        return None

    def stale(self) -> str | None:
        """Why the declaration does not apply to what is installed; None when it does."""
        if self.package is None:
            return None
        from packaging.specifiers import SpecifierSet

        installed = self.installed_version()
        if installed is not None and SpecifierSet(self.versions).contains(installed, prereleases=True):
            return None
        return (f"reviewed for {self.package}{self.versions} ({self.source}); installed: "
                f"{installed or 'none'}: review the op again for this release")


#: The resolved layout kinds the replica sync can copy (:mod:`pcppass.sync.rows`).
SYNC_LAYOUT_KINDS = frozenset({"paged_rows", "block_split", "indexed_dim"})


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
    """How slot ``s = block * block_size + offset`` addresses one row's bytes in a cache.

    ``kind`` names the addressing the sync implements for the resolved layout; it is a class
    constant, never a constructor argument.
    """

    kind: ClassVar[str] = "abstract"

    def resolve(self, cache_shape, cache_itemsize: int, args: Mapping[str, object]) -> ResolvedLayout:
        raise NotImplementedError

    def arguments(self) -> tuple[str, ...]:
        """The op arguments this layout reads when it resolves (checked against the op's schema)."""
        return ()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _require_name(owner: str, field_name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{owner}.{field_name} must be a non-empty argument name, got {value!r}")


def _require_names(owner: str, field_name: str, value: object) -> tuple[str, ...]:
    """A tuple of non-empty names; a bare string is refused (it would iterate as characters)."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise TypeError(f"{owner}.{field_name} must be a tuple of names, e.g. ({value!r},), got {value!r}")
    for item in value:
        _require_name(owner, field_name, item)
    return tuple(value)


@dataclass(frozen=True)
class PagedRows(RowLayout):
    """``cache[num_blocks, block_size, *row]``: one row is ``cache[s // bs, s % bs]`` (any strides)."""

    kind: ClassVar[str] = "paged_rows"

    def resolve(self, cache_shape, cache_itemsize, args):
        if len(cache_shape) < 2:
            raise ValueError(f"paged cache must be [num_blocks, block_size, ...], got {list(cache_shape)}")
        return ResolvedLayout(
            self.kind, int(cache_shape[1]), _numel(cache_shape[2:]) * cache_itemsize
        )


@dataclass(frozen=True, kw_only=True)
class BlockSplit(RowLayout):
    """``cache[num_blocks, block_size * (value_bytes + scale_bytes)]`` of uint8, block-split.

    The first ``block_size * value_bytes`` bytes of a block hold every token's values (token ``o``
    at ``o * value_bytes``), then ``block_size`` scale records of ``scale_bytes`` (token ``o`` at
    ``block_size * value_bytes + o * scale_bytes``): one token's bytes are two segments.
    ``value_bytes = args[value_arg].shape[-1]`` (one fp8 byte per element) and
    ``scale_bytes = 4 * value_bytes // args[quant_block_arg]`` (one fp32 per quantisation block).
    Keyword-only: both fields are argument names, so a positional call could swap them.
    """

    kind: ClassVar[str] = "block_split"
    value_arg: str = "k"
    quant_block_arg: str = "quant_block_size"

    def __post_init__(self) -> None:
        _require_name("BlockSplit", "value_arg", self.value_arg)
        _require_name("BlockSplit", "quant_block_arg", self.quant_block_arg)

    def arguments(self) -> tuple[str, ...]:
        return (self.value_arg, self.quant_block_arg)

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
    ``IndexedDim(2)`` and ``IndexedDim(dim=2)`` are the same layout.
    """

    kind: ClassVar[str] = "indexed_dim"
    dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"IndexedDim.dim must be an int, got {self.dim!r}")

    def resolve(self, cache_shape, cache_itemsize, args):
        dim = self.dim % len(cache_shape)
        rest = [d for i, d in enumerate(cache_shape) if i != dim]
        return ResolvedLayout(self.kind, int(cache_shape[dim]), _numel(rest) * cache_itemsize, dim=dim)


@dataclass(frozen=True)
class ByArgValue(RowLayout):
    """The layout depends on a string/int argument of the op (e.g. ``kv_cache_dtype``).

    ``cases`` maps argument values to layouts, as a tuple of pairs so the pattern stays hashable
    (a dict is accepted and kept as pairs)::

        ByArgValue(arg="kv_cache_dtype", cases=(("auto", PagedRows()),
                                                ("fp8_indexer", BlockSplit(value_arg="norm_weight"))))
    """

    kind: ClassVar[str] = "by_arg_value"
    arg: str
    cases: tuple[tuple[object, RowLayout], ...]

    def __post_init__(self) -> None:
        _require_name("ByArgValue", "arg", self.arg)
        cases = tuple(self.cases.items()) if isinstance(self.cases, Mapping) else self.cases
        if not isinstance(cases, (tuple, list)) or not cases:
            raise TypeError(f"ByArgValue.cases must be non-empty (value, layout) pairs, got {self.cases!r}")
        for case in cases:
            if not (isinstance(case, (tuple, list)) and len(case) == 2 and isinstance(case[1], RowLayout)):
                raise TypeError(f"ByArgValue case {case!r} is not a (value, layout instance) pair")
        keys = [k for k, _ in cases]
        if len(set(map(repr, keys))) != len(keys):
            raise ValueError(f"ByArgValue.cases repeats a value: {keys!r}")
        object.__setattr__(self, "cases", tuple((k, layout) for k, layout in cases))

    def arguments(self) -> tuple[str, ...]:
        inner = [a for _, layout in self.cases for a in layout.arguments()]
        return tuple(dict.fromkeys((self.arg, *inner)))

    def resolve(self, cache_shape, cache_itemsize, args):
        value = args[self.arg]
        for key, layout in self.cases:
            if key == value:
                return layout.resolve(cache_shape, cache_itemsize, args)
        known = ", ".join(repr(k) for k, _ in self.cases)
        raise ValueError(f"{self.arg}={value!r} has no layout (known: {known})")


@dataclass(frozen=True)
class CacheRole:
    """One cache an op writes: the argument holding it, its slot mapping and its layout.

    ``CacheRole("key_cache", slots="slot_mapping", layout=PagedRows(), values=("key",))``:
    ``slots``, ``layout`` and ``values`` are keyword-only (``arg`` and ``slots`` are both names).
    ``values`` names the arguments whose rows the op stores into one cache row, element for element
    in the cache's dtype (their row dim from ``WritePattern.row_args``, else 0); the audit then
    checks the layout's bytes per row against them. Leave it empty when a row is not a plain copy of
    its inputs (a quantised row with scales computed from the data).
    """

    arg: str
    slots: str = field(kw_only=True)
    layout: RowLayout = field(default_factory=PagedRows, kw_only=True)
    values: tuple[str, ...] = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        _require_name("CacheRole", "arg", self.arg)
        _require_name("CacheRole", "slots", self.slots)
        if isinstance(self.layout, type) and issubclass(self.layout, RowLayout):
            raise TypeError(f"CacheRole.layout must be a layout instance: {self.layout.__name__}(), "
                            f"not the class")
        if not isinstance(self.layout, RowLayout):
            raise TypeError(f"CacheRole.layout must be a RowLayout, got {self.layout!r}")
        object.__setattr__(self, "values", _require_names("CacheRole", "values", self.values))

    def arguments(self) -> tuple[str, ...]:
        """Every op argument this role names (checked against the op's schema)."""
        return tuple(dict.fromkeys((self.arg, self.slots, *self.values, *self.layout.arguments())))


@dataclass(frozen=True)
class ContextCache:
    """A cache an op fetches at run time through a handle argument instead of receiving it.

    ``handle`` is the schema argument holding the handle (an opaque object such as vLLM's
    ``LayerName``, or a string naming the state). The pattern's resolver maps the handle's value
    to named tensors; ``cache`` and ``slots`` name the cache view and its slot mapping among them,
    and ``layout`` says how a slot addresses that view (resolved at compile time on what the
    resolver describes, checked at run time on what it returns).
    ``ContextCache("layer_name", cache="kv_cache", slots="slot_mapping")``: every field but
    ``handle`` is keyword-only.
    """

    handle: str
    cache: str = field(kw_only=True)
    slots: str = field(kw_only=True)
    layout: RowLayout = field(default_factory=PagedRows, kw_only=True)

    def __post_init__(self) -> None:
        for name in ("handle", "cache", "slots"):
            _require_name("ContextCache", name, getattr(self, name))
        if not isinstance(self.layout, RowLayout):
            raise TypeError(f"ContextCache.layout must be a RowLayout instance, got {self.layout!r}")

    def arguments(self) -> tuple[str, ...]:
        """The op arguments this role names: the handle, and what the layout reads."""
        return tuple(dict.fromkeys((self.handle, *self.layout.arguments())))


def _context_roles(pattern: "WritePattern") -> tuple[ContextCache, ...]:
    context = pattern.context
    if isinstance(context, ContextCache) or not isinstance(context, (tuple, list)) or not all(
            isinstance(c, ContextCache) for c in context):
        raise TypeError(f"WritePattern {pattern.name!r}: context must be a tuple of ContextCache, "
                        f"got {context!r}")
    return tuple(context)


def _check_context(name: str, recipe: "Recipe", caches, context, resolver, reads, row_args,
                   reviewed) -> None:
    """A context-addressed pattern names its resolver and copies rows; a read-only one reads.

    A handle both in ``reads`` and among the ``context`` roles is decided per handle by the
    resolver (:func:`pcppass.registry.register_resolver`'s ``effect``): vLLM's attention op writes
    the KV cache on some backends and only reads it on others. Every read declaration is
    :class:`Reviewed`."""
    where = f"WritePattern {name!r}"
    if reads and not isinstance(reviewed, Reviewed):
        raise ValueError(f"{where}: declaring that an op only reads through {', '.join(reads)} needs "
                         f"reviewed=Reviewed(source=..., evidence=...): what was read, and the test "
                         f"that shows it on the real graph")
    if reviewed is not None and not isinstance(reviewed, Reviewed):
        raise TypeError(f"{where}: reviewed must be a Reviewed, got {reviewed!r}")
    if context:
        _require_name(where, "resolver", resolver)
        if recipe is not Recipe.COPY_ROWS:
            raise ValueError(f"{where}: context-addressed caches are synced by copying rows "
                             f"(recipe COPY_ROWS), got {recipe.value}")
        if not row_args:
            raise ValueError(f"{where}: list a per-row input in row_args (it sizes the rows of "
                             f"each context cache)")
    elif resolver is not None and recipe is not Recipe.READ_ONLY:
        raise ValueError(f"{where}: resolver {resolver!r} given but no context cache (a read-only "
                         f"pattern may name one: its `effect` then confirms the read per handle)")
    if recipe is Recipe.READ_ONLY and (not reads or caches or context):
        raise ValueError(f"{where}: a read-only pattern (recipe READ_ONLY) names the handles it "
                         f"reads in `reads` and writes no cache")
    decided = {c.handle for c in context} & set(reads)
    if reads and recipe is not Recipe.READ_ONLY and (caches or set(reads) - decided):
        raise ValueError(f"{where}: a pattern that writes caches declares reads only for handles its "
                         f"resolver decides per handle (listed in both `reads` and `context`)")


def _check_alternatives(name: str, alternatives, context: tuple[ContextCache, ...]) -> tuple["Recipe", ...]:
    """A pattern's alternative recipes: only RERUN, only for context-addressed caches whose roles
    share one slots role (the state line of each row, which the re-run addresses)."""
    where = f"WritePattern {name!r}"
    if isinstance(alternatives, (str, Recipe)) or not isinstance(alternatives, (tuple, list)):
        raise TypeError(f"{where}: alternatives must be a tuple of recipes, e.g. (Recipe.RERUN,), "
                        f"got {alternatives!r}")
    found = tuple(Recipe(a) for a in alternatives)
    if not found:
        return found
    if found != (Recipe.RERUN,):
        raise ValueError(f"{where}: the one alternative recipe is RERUN (through the resolver's "
                         f"`rerun` hook), got {[r.value for r in found]}")
    if not context:
        raise ValueError(f"{where}: a RERUN alternative re-runs an op whose caches are context-addressed "
                         f"(list them in `context`)")
    if len({(c.handle, c.slots) for c in context}) != 1:
        raise ValueError(f"{where}: a RERUN alternative needs every context role behind one handle and "
                         f"one slots role (the rows' state lines), got "
                         f"{sorted({(c.handle, c.slots) for c in context})}")
    return found


@dataclass(frozen=True)
class WritePattern:
    """A declarative spec of one write family. See the module docstring for an example.

    Every field but ``name`` is keyword-only; the constructor checks types and names.
    """

    name: str
    ops: tuple[str, ...] = field(kw_only=True)
    caches: tuple[CacheRole, ...] = field(kw_only=True)
    #: per-row input arguments and their row dim (all inputs a re-run needs, slots included);
    #: a re-run discards every output of the op, the owner keeps them all
    row_args: Mapping[str, int] = field(default_factory=dict, kw_only=True)
    recipe: Recipe = field(default=Recipe.COPY_ROWS, kw_only=True)
    #: for in-place aten families: method/function spellings matched on the Dynamo graph
    aten_family: str | None = field(default=None, kw_only=True)
    doc: str = field(default="", kw_only=True)
    #: caches fetched at run time through a handle argument (see :class:`ContextCache`)
    context: tuple[ContextCache, ...] = field(default=(), kw_only=True)
    #: name of the registered resolver (:func:`pcppass.registry.register_resolver`) that maps a
    #: handle's value to the tensors of ``context``; a handle with no registered resolver is uncovered
    resolver: str | None = field(default=None, kw_only=True)
    #: handle arguments the op only reads (with ``recipe=Recipe.READ_ONLY``, no caches), or that
    #: its resolver decides per handle (also listed in ``context``)
    reads: tuple[str, ...] = field(default=(), kw_only=True)
    #: the review behind what the pattern says of an op it does not own (required with ``reads``);
    #: with a package and versions, the pattern applies only to those releases
    reviewed: Reviewed | None = field(default=None, kw_only=True)
    #: recipes classification may choose instead of ``recipe``, per handle: ``(Recipe.RERUN,)`` on a
    #: context-addressed pattern re-runs the op's state update from its gathered ``row_args``
    #: through the resolver's ``rerun`` hook, chosen where the resolver vouches that this is exact
    #: (``HandleEffect.rerun_exact``) and it moves fewer bytes per row than copying the rows
    alternatives: tuple[Recipe, ...] = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        _require_name("WritePattern", "name", self.name)
        ops = _require_names(f"WritePattern {self.name!r}", "ops", self.ops)
        if not ops:
            raise ValueError(f"WritePattern {self.name!r} lists no ops")
        if self.aten_family is None:
            bad = [op for op in ops if "::" not in op]
            if bad:
                raise ValueError(f"WritePattern {self.name!r}: ops must be qualified 'namespace::op' "
                                 f"names, got {bad}")
        else:
            _require_name(f"WritePattern {self.name!r}", "aten_family", self.aten_family)
        caches = self.caches
        context = _context_roles(self)
        reads = _require_names(f"WritePattern {self.name!r}", "reads", self.reads) if self.reads else ()
        if isinstance(caches, CacheRole) or not isinstance(caches, (tuple, list)) or not (
                caches or context or reads):
            raise TypeError(f"WritePattern {self.name!r}: caches must be a non-empty tuple of "
                            f"CacheRole (or the pattern context-addressed or read-only), got {caches!r}")
        if not all(isinstance(c, CacheRole) for c in caches):
            raise TypeError(f"WritePattern {self.name!r}: every cache must be a CacheRole, got {caches!r}")
        args = [c.arg for c in caches]
        if len(set(args)) != len(args):
            raise ValueError(f"WritePattern {self.name!r}: two cache roles for one argument: {args}")
        if not isinstance(self.row_args, Mapping) or not all(
            isinstance(k, str) and k and isinstance(v, int) and not isinstance(v, bool)
            for k, v in self.row_args.items()
        ):
            raise TypeError(f"WritePattern {self.name!r}: row_args must map argument names to row "
                            f"dims, got {self.row_args!r}")
        recipe = Recipe(self.recipe)  # accepts "copy_rows" / "rerun"; raises ValueError otherwise
        if recipe is Recipe.RERUN:
            missing = sorted({c.slots for c in caches} - set(self.row_args))
            if missing:
                raise ValueError(f"WritePattern {self.name!r}: a re-run gathers its slot mappings: "
                                 f"list {missing} in row_args")
        _check_context(self.name, recipe, caches, context, self.resolver, reads, self.row_args,
                       self.reviewed)
        object.__setattr__(self, "alternatives", _check_alternatives(self.name, self.alternatives, context))
        object.__setattr__(self, "ops", ops)
        object.__setattr__(self, "caches", tuple(caches))
        object.__setattr__(self, "recipe", recipe)
        object.__setattr__(self, "context", context)
        object.__setattr__(self, "reads", reads)

    def arguments(self) -> tuple[str, ...]:
        """Every op argument the pattern names (roles, their layouts, handles, row inputs)."""
        names = [a for c in self.caches for a in c.arguments()] + list(self.row_args)
        names += [a for c in self.context for a in c.arguments()] + list(self.reads)
        return tuple(dict.fromkeys(names))

    def decided_per_handle(self, handle_arg: str) -> bool:
        """Whether the resolver decides, per handle, if the op writes or only reads through it."""
        return handle_arg in self.reads and bool(self.context_roles(handle_arg))

    def context_roles(self, handle_arg: str) -> tuple[ContextCache, ...]:
        """The context caches addressed through the handle argument ``handle_arg``."""
        return tuple(c for c in self.context if c.handle == handle_arg)

    def uuid(self) -> str:
        """Stable identity of this pattern (fields + the layout classes' source)."""
        payload = {
            "name": self.name,
            "ops": list(self.ops),
            "caches": [
                [c.arg, c.slots, type(c.layout).__name__, repr(c.layout), list(c.values)]
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
        if self.reviewed is not None:
            payload["reviewed"] = repr(self.reviewed)
        if self.alternatives:
            payload["alternatives"] = [r.value for r in self.alternatives]
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Refusal:
    """An op pcppass knows and refuses by name: it writes state no pattern can cover (yet).

    Every write the analysis finds at a call of one of ``ops`` (a declared mutation, a handle) is
    reported as one uncovered record naming ``why``: the op's real write, not a buffer it happens to
    declare. ``reviewed`` says what was read to know it::

        Refusal("vllm.sparse_attn_indexer", ops=("vllm::sparse_attn_indexer",),
                why="stores the indexer K cache it takes as `kv_cache` without declaring it ...",
                reviewed=Reviewed(...))
    """

    name: str
    ops: tuple[str, ...] = field(kw_only=True)
    why: str = field(kw_only=True)
    reviewed: Reviewed = field(kw_only=True)

    def __post_init__(self) -> None:
        _require_name("Refusal", "name", self.name)
        object.__setattr__(self, "ops", _require_names(f"Refusal {self.name!r}", "ops", self.ops))
        _require_name(f"Refusal {self.name!r}", "why", self.why)
        if not isinstance(self.reviewed, Reviewed):
            raise TypeError(f"Refusal {self.name!r}: reviewed must be a Reviewed, got {self.reviewed!r}")


def qualified_op_name(target: object) -> str | None:
    """``torch.ops.ns.op`` / ``torch.ops.ns.op.default`` -> ``"ns::op"``; None for other targets."""
    import torch

    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name  # "ns::op"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None
