"""Classify each state write: covered (pattern, recipe, resolved layout) or uncovered with a reason.

Order of the checks, each an early return with its reason:

0. a handle argument (vLLM's layer name) of an op whose pattern fetches its caches through it at
   run time: the engine's resolver says per handle whether the op writes or only reads there
   (vLLM: from the layer's attention backend); covered when it writes and the resolver describes
   caches the pattern's layout fits, read only when it only reads and a reviewed declaration of
   the pattern says so; a pattern reviewed for other releases of the op's package no longer applies;
   a pattern with alternative recipes gets the one that moves fewer bytes per row where it is
   exact (:mod:`pcppass.analysis.recipes`);
1. already marked by the finder (a cache handle, an opaque call, a side-effect-only op, unknown
   storage); the state (or the written view) is a tensor subclass: the sync copies plain rows;
2. no pattern covers the op: a user Triton kernel, an unknown mutating op, or (for in-place aten
   spellings with no row index: ``add_``, ``fill_``, ``copy_`` into a fixed region) non-row state;
3. the written tensor is a view the rewrite cannot invert;
4. the slot mapping (or row index) is not an integer tensor (any integer width is sent as int64);
5. the layout does not resolve on the written tensor (wrong rank, sizes that depend on a dynamic
   dim, an index form that is not one row index): unknown layout;
6. the bytes per row the op writes (from the written value's shape and dtype: ``source`` of
   ``index_copy_``, ``values`` of ``index_put_`` / setitem, a pattern role's declared ``values``)
   differ from the layout's bytes per row: row bytes mismatch, with both numbers;
7. covered: ``record.pattern`` and ``record.layout`` (bytes per row) are set.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from pcppass.analysis.recipes import choose_recipe
from pcppass.analysis.records import StateWrite, Uncovered
from pcppass.analysis.views import is_base_flattened_paged, is_plain_tensor, node_value
from pcppass.registry import HandleEffect, get_resolver, pattern_for_family, pattern_for_op, refusal_for_op
from pcppass.spec import (
    SYNC_LAYOUT_KINDS, CacheRole, ContextCache, IndexedDim, Recipe, ResolvedLayout, RowLayout, WritePattern,
)

#: In-place aten families that select rows through an index or mask: a row write in principle,
#: but with no pattern describing which argument addresses the rows.
INDEXED_FAMILIES = frozenset({
    "index_copy_", "index_put_", "setitem", "scatter_", "scatter_add_", "scatter_reduce_",
    "index_add_", "index_fill_", "index_reduce_", "masked_scatter_", "masked_fill_", "put_",
    "_index_put_impl_",
})


class _DynamicSize(Exception):
    """A layout needed the concrete value of a symbolic size."""


class _Dynamic:
    """A symbolic dim handed to a layout's ``resolve``: using its value raises, never guards."""

    def __init__(self, sym: object):
        self.sym = sym

    def __int__(self) -> int:
        raise _DynamicSize(str(self.sym))

    __index__ = __int__

    def __repr__(self) -> str:
        return str(self.sym)


def _static_shape(shape) -> tuple:
    return tuple(int(d) if is_concrete_int(d) else _Dynamic(d) for d in shape)


class _ArgValue:
    """What a layout sees of a tensor argument: its (static where known) shape and dtype."""

    def __init__(self, value: torch.Tensor):
        self.shape = _static_shape(value.shape)
        self.dtype = value.dtype
        self.ndim = value.dim()


def _layout_args(bound: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, value in bound.items():
        if isinstance(value, torch.fx.Node):
            v = node_value(value)
            out[name] = _ArgValue(v) if isinstance(v, torch.Tensor) else v
        else:
            out[name] = value
    return out


def cache_role(record: StateWrite) -> CacheRole | None:
    """The role of ``record.pattern`` that describes the written cache; None if none does.

    An in-place aten family pattern has one role whatever the receiver is called; an op pattern
    names the written argument (``caches`` also matches the element ``caches[0]`` of a list).
    """
    pattern = record.pattern
    if pattern is None:
        return None
    if record.family is not None:
        return pattern.caches[0]
    arg = record.arg
    base = arg.split("[", 1)[0] if arg else arg
    return next((c for c in pattern.caches if c.arg in (arg, base)), None)


def _uncovered(record: StateWrite, reason: Uncovered, detail: str) -> None:
    record.reason = reason
    record.detail = detail
    record.layout = None


def _resolve(record: StateWrite, layout: RowLayout, written_value: torch.Tensor) -> None:
    try:
        resolved = layout.resolve(
            _static_shape(written_value.shape),
            written_value.element_size(),
            _layout_args(record.bound_args),
        )
    except _DynamicSize as exc:
        _uncovered(record, Uncovered.UNKNOWN_LAYOUT,
                   f"{layout.kind} layout of {record.arg} needs the size {exc}, which is dynamic")
        return
    except (ValueError, KeyError, IndexError, TypeError, ZeroDivisionError) as exc:
        _uncovered(record, Uncovered.UNKNOWN_LAYOUT,
                   f"{layout.kind} layout does not fit {record.arg} "
                   f"{list(written_value.shape)}: {exc}")
        return
    if resolved.kind not in SYNC_LAYOUT_KINDS:
        _uncovered(record, Uncovered.UNKNOWN_LAYOUT,
                   f"{type(layout).__name__} resolved to a {resolved.kind!r} layout; the replica sync "
                   f"copies only {', '.join(sorted(SYNC_LAYOUT_KINDS))} rows")
        return
    record.layout = resolved


def _slots_are_integers(record: StateWrite, slots: torch.fx.Node, name: str) -> bool:
    """Slots are integers of any width (the sync sends them as int64, the same values); a bool
    or floating "slot mapping" addresses no rows: refuse it here."""
    value = node_value(slots)
    if not isinstance(value, torch.Tensor) or is_integer_dtype(value.dtype):
        return True
    _uncovered(record, Uncovered.SLOT_DTYPE,
               f"{record.op} at {record.source} writes {record.state} through slot mapping {name} "
               f"of dtype {value.dtype}; slots must be integers (int64, int32, ...)")
    return False


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """An integer dtype a slot mapping may have (bool is not one)."""
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def _missing_arguments(record: StateWrite, pattern: WritePattern) -> list[str]:
    """Arguments the pattern names that the op's schema does not have (a typo in the pattern)."""
    return [a for a in pattern.arguments() if a not in record.bound_args]


def _row_elements(shape, row_dim: int) -> object:
    """Elements of one row of ``shape`` (every dim but ``row_dim``); symbolic where a dim is."""
    n = 1
    for i, d in enumerate(shape):
        if i != row_dim % len(shape):
            n = n * d
    return n


def _broadcast_row_elements(value_shape, target_shape, row_dim: int) -> object:
    """Elements per row of ``value`` broadcast against the indexed result ``target_shape``."""
    padded = [1] * (len(target_shape) - len(value_shape)) + list(value_shape)
    full = [t if statically_known_true(v == 1) else v for v, t in zip(padded, target_shape)]
    return _row_elements(full, row_dim)


def _written_row_elements(record: StateWrite, role: CacheRole) -> tuple[object, str] | None:
    """Elements of one cache row the op writes and where that comes from; None if unknown."""
    written = node_value(record.written_node)
    layout = record.layout
    if record.family == "index_copy_":
        source = node_value(record.bound_args.get("source"))
        if not isinstance(source, torch.Tensor) or source.dim() != written.dim():
            return None
        return _row_elements(source.shape, layout.dim), f"source {list(source.shape)}"
    if record.family in ("setitem", "index_put_"):
        values = node_value(record.bound_args.get("values"))
        if not isinstance(values, torch.Tensor):
            return None  # a Python scalar fills whole rows
        dim = 0 if layout.kind == "paged_rows" else layout.dim  # paged: a flattened view, row = slot
        return _broadcast_row_elements(values.shape, list(written.shape), dim), f"values {list(values.shape)}"
    if not role.values:
        return None
    total, parts = 0, []
    for name in role.values:
        value = node_value(record.bound_args.get(name))
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return None
        total = total + _row_elements(value.shape, record.pattern.row_args.get(name, 0))
        parts.append(f"{name} {list(value.shape)}")
    return total, " + ".join(parts)


def _check_row_bytes(record: StateWrite, role: CacheRole) -> None:
    """Uncover a write whose layout addresses other bytes per row than the op writes."""
    found = _written_row_elements(record, role)
    if found is None:
        return
    elements, what = found
    itemsize = node_value(record.written_node).element_size()
    written = elements * itemsize
    record.written_bytes_per_row = int(written) if is_concrete_int(written) else written
    if statically_known_true(written == record.layout.bytes_per_row):
        return
    layout = record.layout
    _uncovered(record, Uncovered.ROW_BYTES_MISMATCH,
               f"{record.op} at {record.source} writes {record.written_bytes_per_row} B per row of "
               f"{record.state} ({what}, {itemsize} B per cache element), but pattern "
               f"{record.pattern.name}'s {layout.kind} layout addresses {layout.bytes_per_row} B per "
               f"row: the sync would copy the wrong bytes (check the layout's dim or shape)")


def _classify_family(record: StateWrite, pattern: WritePattern | None) -> None:
    family = record.family or ""
    if pattern is None:
        if family in INDEXED_FAMILIES:
            _uncovered(record, Uncovered.UNKNOWN_MUTATING_OP,
                       f"{record.op} writes {record.state} through an index, "
                       f"and no pattern covers {family}")
        else:
            _uncovered(record, Uncovered.NON_ROW_STATE,
                       f"{record.op} updates {record.state} as a whole, not rows addressed by a "
                       f"slot mapping (e.g. a counter every rank bumps)")
        return
    written = node_value(record.written_node)
    if family == "index_copy_":
        dim = record.bound_args.get("dim")
        if not isinstance(dim, int):
            _uncovered(record, Uncovered.UNKNOWN_LAYOUT, f"index_copy_ along a non-constant dim {dim}")
            return
        index = record.bound_args.get("index")
        if isinstance(index, torch.fx.Node) and not _slots_are_integers(record, index, "index"):
            return
        _resolve(record, IndexedDim(dim=dim), written)
        return
    # setitem / index_put_: exactly one integer index tensor, after full slices only
    index = record.bound_args.get("indices")
    items = list(index) if isinstance(index, (tuple, list)) else [index]
    tensors = [i for i, it in enumerate(items) if isinstance(it, torch.fx.Node)]
    if not tensors and all(isinstance(it, (int, slice, type(None), type(Ellipsis))) for it in items):
        _uncovered(record, Uncovered.NON_ROW_STATE,
                   f"{record.op} writes a fixed region of {record.state} selected by constants, "
                   f"not rows addressed by a slot mapping")
        return
    if len(tensors) != 1 or any(
        it != slice(None) for it in items[: tensors[0]]
    ) or len(items) > tensors[0] + 1 and any(it != slice(None) for it in items[tensors[0] + 1:]):
        _uncovered(record, Uncovered.UNKNOWN_LAYOUT,
                   f"{record.op} on {record.state}: index {items!r} is not one row-index tensor")
        return
    dim = tensors[0]
    index_value = node_value(items[dim])
    if not isinstance(index_value, torch.Tensor) or index_value.dtype in (torch.bool, torch.uint8) \
            or index_value.dim() != 1:
        _uncovered(record, Uncovered.UNKNOWN_LAYOUT,
                   f"{record.op} on {record.state}: the index is not a 1-D integer tensor")
        return
    if not _slots_are_integers(record, items[dim], "the row index"):
        return
    base = node_value(record.state_node)
    if dim == 0 and record.view is not None and is_base_flattened_paged(base, record.view):
        # view = base[nb, bs, *row] flattened: index i is slot i of the paged base
        row_bytes = base.element_size()
        for d in _static_shape(base.shape[2:]):
            if isinstance(d, _Dynamic):
                _uncovered(record, Uncovered.UNKNOWN_LAYOUT, f"row size depends on dynamic {d}")
                return
            row_bytes *= d
        block_size = base.shape[1]
        if not is_concrete_int(block_size):
            _uncovered(record, Uncovered.UNKNOWN_LAYOUT, f"block size {block_size} is dynamic")
            return
        record.layout = ResolvedLayout("paged_rows", int(block_size), row_bytes)
        return
    _resolve(record, IndexedDim(dim=dim), written)


def _subclass_state(record: StateWrite) -> bool:
    """Uncover a write into a tensor subclass (fp8 wrapper, DTensor): its bytes are not its own."""
    for value in (node_value(record.state_node), node_value(record.written_node)):
        if not isinstance(value, torch.Tensor) or is_plain_tensor(value):
            continue
        flatten = getattr(value, "__tensor_flatten__", None)
        inner = f" wrapping {', '.join(flatten()[0])}" if flatten is not None else ""
        _uncovered(record, Uncovered.TENSOR_SUBCLASS_STATE,
                   f"{record.op} at {record.source} writes {record.state}, a {type(value).__qualname__}"
                   f"{inner}; the replica sync copies rows of plain tensors: keep the cache a plain "
                   f"tensor, or write its inner tensors with ops a pattern covers")
        return True
    return False


class ContextUnresolved(ValueError):
    """A context-addressed cache whose layout cannot be resolved at compile time."""


def context_layouts(pattern: WritePattern, roles: tuple[ContextCache, ...], handle: str,
                    args: dict[str, object]) -> list[ResolvedLayout]:
    """The layout of every role, resolved on what the pattern's resolver describes for
    ``handle`` (raises :class:`ContextUnresolved` saying why not)."""
    resolver = get_resolver(pattern.resolver)
    if resolver is None:
        raise ContextUnresolved(
            f"pattern {pattern.name} fetches its caches through resolver {pattern.resolver!r}, "
            f"which is not registered (import the integration that registers it, e.g. "
            f"pcppass.integrations.{pattern.resolver})")
    try:
        tensors = resolver.described(handle)
        views = [tensors[role.cache] for role in roles]
    except Exception as exc:  # noqa: BLE001 - the resolver's own refusal, reported as uncovered
        raise ContextUnresolved(f"resolver {pattern.resolver!r} cannot describe {handle!r}: "
                                f"{type(exc).__name__}: {exc}") from exc
    try:
        return [role.layout.resolve(_static_shape(view.shape), view.element_size(), args)
                for role, view in zip(roles, views)]
    except (_DynamicSize, ValueError, KeyError, IndexError, TypeError, ZeroDivisionError) as exc:
        raise ContextUnresolved(f"layout of {handle!r} does not resolve: {exc}") from exc


def _stale_review(record: StateWrite, pattern: WritePattern) -> bool:
    """Uncover a write whose pattern was reviewed for other releases of the op's package."""
    why = pattern.reviewed.stale() if pattern.reviewed is not None else None
    if why is None:
        return False
    record.pattern = pattern
    _uncovered(record, Uncovered.STALE_REVIEW, f"{record.op} at {record.source}: pattern {pattern.name} was {why}")
    return True


def handle_effect(pattern: WritePattern, record: StateWrite) -> HandleEffect:
    """What ``record.op`` does through its handle ``record.arg`` (raises when nobody can say).

    The pattern's resolver decides when it registered an ``effect``; otherwise the pattern alone:
    its ``context`` roles for the argument mean the op writes, its ``reads`` that it only reads."""
    resolver = get_resolver(pattern.resolver)
    if resolver is not None and resolver.effect is not None:
        return resolver.effect(record.op, record.state)
    if pattern.decided_per_handle(record.arg):
        raise ContextUnresolved(
            f"pattern {pattern.name} leaves it to resolver {pattern.resolver!r} to say per handle "
            f"whether {record.op} writes or only reads, and no resolver registered under that name "
            f"says so (import the integration that registers it, e.g. pcppass.integrations.{pattern.resolver})")
    if record.arg in pattern.reads:
        return HandleEffect(False, f"{pattern.name} only reads through {record.arg} ({pattern.reviewed.source})")
    return HandleEffect(True, f"{pattern.name} writes through {record.arg}")


def _classify_context(record: StateWrite) -> bool:
    """A handle argument (``state_node`` None) of an op whose pattern reads or writes state
    through it: covered (its caches resolved through the pattern's resolver), read only, or
    uncovered with the reason. False when no pattern addresses state through this argument."""
    pattern = pattern_for_op(record.op)
    if pattern is None or record.arg is None:
        return False
    roles = pattern.context_roles(record.arg)
    if record.arg not in pattern.reads and not roles:
        return False
    if _stale_review(record, pattern):
        return True
    record.pattern = pattern
    try:
        effect = handle_effect(pattern, record)
    except Exception as exc:  # noqa: BLE001 - the engine's refusal, reported as uncovered
        _uncovered(record, Uncovered.UNDECIDED_HANDLE, f"{record.op} at {record.source} through "
                   f"{record.arg}={record.state!r}: {type(exc).__name__}: {exc}")
        return True
    if not effect.writes:
        if record.arg not in pattern.reads:
            _uncovered(record, Uncovered.UNDECIDED_HANDLE, f"{record.op} at {record.source}: the engine "
                       f"says it only reads through {record.state!r} ({effect.why}), but pattern "
                       f"{pattern.name} declares no read (no reviewed read declaration)")
            return True
        record.reason, record.layout, record.recipe = None, None, Recipe.READ_ONLY
        record.detail = f"{record.op} only reads the state {record.state} addresses: {effect.why}"
        return True
    if not roles:
        _uncovered(record, Uncovered.UNDECIDED_HANDLE, f"{record.op} at {record.source} writes the state "
                   f"{record.state!r} addresses ({effect.why}), and pattern {pattern.name} names no "
                   f"cache it could sync there")
        return True
    try:
        layouts = context_layouts(pattern, roles, record.state, _layout_args(record.bound_args))
    except ContextUnresolved as exc:
        reason = Uncovered.UNDECLARED_CACHE_HANDLE if get_resolver(pattern.resolver) is None \
            else Uncovered.UNKNOWN_LAYOUT
        _uncovered(record, reason, f"{record.op} writes the caches of {record.state}: {exc}")
        return True
    record.reason, record.detail = None, effect.why
    # for the audit: one row of the op is the rows of every role ("context" is never encoded)
    record.layout = ResolvedLayout("context", layouts[0].block_size,
                                   sum(layout.bytes_per_row for layout in layouts))
    choose_recipe(record, pattern, effect, record.layout.bytes_per_row)
    return True


def classify_write(record: StateWrite) -> StateWrite:
    """Attach pattern + layout (and the recipe), or reason + detail, to one record (in place)."""
    if record.state_node is None and record.family is None and _classify_context(record):
        return record  # a handle argument: context-addressed caches, or read only
    _classify_tensor_write(record)
    if record.covered and record.recipe is None:
        record.recipe = record.pattern.recipe
    return record


def _classify_tensor_write(record: StateWrite) -> StateWrite:
    """:func:`classify_write` for a write into a tensor the graph holds."""
    if record.reason is not None:
        return record  # marked by the finder (undeclared handle, unknown storage)
    if _subclass_state(record):
        return record
    if record.family is not None:
        pattern = pattern_for_family(record.family)
    else:
        pattern = pattern_for_op(record.op)
    if pattern is not None and _stale_review(record, pattern):
        return record
    record.pattern = pattern
    if pattern is None and record.family is None:
        if record.op.startswith("triton::"):
            _uncovered(record, Uncovered.USER_TRITON_KERNEL,
                       f"user Triton kernel {record.op[8:]} writes {record.state} through "
                       f"{record.arg}; register a pattern for {record.op!r} to cover it")
        else:
            _uncovered(record, Uncovered.UNKNOWN_MUTATING_OP,
                       f"{record.op} writes {record.state} through {record.arg} and no pattern "
                       f"covers it; register one with pcppass.register_pattern")
        return record
    if record.view is not None and not record.view.invertible:
        _uncovered(record, Uncovered.NON_INVERTIBLE_VIEW,
                   f"{record.arg} of {record.op} is a view of {record.state} through "
                   f"{' -> '.join(record.view.ops)}: {record.view.why_not}")
        return record
    if record.family is not None:
        _classify_family(record, pattern)
        if record.layout is not None:
            _check_row_bytes(record, cache_role(record))
        return record
    role = cache_role(record)
    if role is None:
        _uncovered(record, Uncovered.UNKNOWN_LAYOUT,
                   f"pattern {pattern.name} declares no cache role for argument {record.arg} "
                   f"of {record.op}")
        return record
    missing = _missing_arguments(record, pattern)
    if missing:
        known = ", ".join(record.bound_args) or "none that bind"
        _uncovered(record, Uncovered.UNKNOWN_LAYOUT,
                   f"pattern {pattern.name} names argument(s) {', '.join(map(repr, missing))} that "
                   f"{record.op} does not have (its arguments: {known})")
        return record
    if not isinstance(record.bound_args.get(role.slots), torch.fx.Node):
        _uncovered(record, Uncovered.UNKNOWN_LAYOUT,
                   f"pattern {pattern.name}: slot argument {role.slots!r} of {record.op} "
                   f"is not a tensor in the graph")
        return record
    if not _slots_are_integers(record, record.bound_args[role.slots], role.slots):
        return record
    _resolve(record, role.layout, node_value(record.written_node))
    if record.layout is not None:
        _check_row_bytes(record, role)
    return record


def _refused_op_records(records: list[StateWrite]) -> list[StateWrite]:
    """One uncovered record per call of an op refused by name (its first handle record, else its
    first record), saying why; the call's other records (a scratch buffer it declares written, a
    second handle) are dropped: they would blame the wrong state."""
    kept: list[StateWrite] = []
    seen: dict[torch.fx.Node, StateWrite] = {}
    for record in records:
        refusal = refusal_for_op(record.op) if record.family is None else None
        if refusal is None:
            kept.append(record)
            continue
        first = seen.get(record.node)
        if first is not None and not (first.state_node is not None and record.state_node is None):
            continue
        if first is not None:
            kept.remove(first)
        seen[record.node] = record
        record.pattern, record.layout = None, None
        _uncovered(record, Uncovered.REFUSED_OP, f"{record.op} at {record.source}: {refusal.why} "
                   f"(pcppass refuses it by name: {refusal.reviewed.source})")
        kept.append(record)
    return kept


def classify_writes(records: list[StateWrite]) -> list[StateWrite]:
    """Classify every record (in place; a call of an op refused by name keeps one record)."""
    records[:] = _refused_op_records(records)
    for record in records:
        if record.reason is not Uncovered.REFUSED_OP:
            classify_write(record)
    return records
