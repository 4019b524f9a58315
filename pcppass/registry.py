"""The pattern registry: op qualified name -> :class:`~pcppass.spec.WritePattern`.

Built-in patterns live in ``patterns/`` (installed as ``pcppass.patterns``) and register themselves
when :func:`load_builtin_patterns` imports them. Users add their own with :func:`register_pattern`.

Context-addressed patterns (an op that fetches its cache through a handle, e.g. vLLM's layer name)
name a resolver; an engine integration registers it with :func:`register_resolver`.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

from pcppass.spec import Refusal, WritePattern

if TYPE_CHECKING:
    import torch

_lock = threading.Lock()
_by_op: dict[str, WritePattern] = {}
_by_family: dict[str, WritePattern] = {}
_refusals: dict[str, Refusal] = {}
_builtins_loaded = False


def register_pattern(pattern: WritePattern, *, replace: bool = False) -> WritePattern:
    """Register ``pattern`` for every op name it lists (``"ns::op"``) or its aten family.

    Raises ``ValueError`` if another pattern already claims one of its ops, unless ``replace``.
    Returns the pattern, so it can be used as a module-level statement.
    """
    keys = list(pattern.ops)
    with _lock:
        if not replace:
            for op in keys:
                old = _by_op.get(op)
                if old is not None and old is not pattern and old.name != pattern.name:
                    raise ValueError(f"op {op} is already covered by pattern {old.name!r}")
        for op in keys:
            _by_op[op] = pattern
        if pattern.aten_family:
            _by_family[pattern.aten_family] = pattern
    return pattern


def unregister_pattern(name: str) -> None:
    """Remove every registration of the pattern called ``name`` (used by negative controls)."""
    with _lock:
        for table in (_by_op, _by_family):
            for key in [k for k, p in table.items() if p.name == name]:
                del table[key]


def pattern_for_op(qualified_name: str) -> WritePattern | None:
    load_builtin_patterns()
    return _by_op.get(qualified_name)


def register_refusal(refusal: Refusal) -> Refusal:
    """Refuse every write of ``refusal.ops`` by name (see :class:`~pcppass.spec.Refusal`)."""
    with _lock:
        for op in refusal.ops:
            if op in _by_op:
                raise ValueError(f"op {op} is covered by pattern {_by_op[op].name!r}: it cannot also be refused")
            _refusals[op] = refusal
    return refusal


def refusal_for_op(qualified_name: str) -> Refusal | None:
    load_builtin_patterns()
    return _refusals.get(qualified_name)


def pattern_for_family(family: str) -> WritePattern | None:
    load_builtin_patterns()
    return _by_family.get(family)


def all_patterns() -> list[WritePattern]:
    load_builtin_patterns()
    seen: dict[str, WritePattern] = {}
    for p in list(_by_op.values()) + list(_by_family.values()):
        seen.setdefault(p.name, p)
    return list(seen.values())


def load_builtin_patterns() -> None:
    """Import every module of ``pcppass.patterns`` once (each registers its patterns)."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    import pcppass.patterns as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{mod.name}")


# ----------------------------------------------------------------------------- resolvers

#: A resolver maps a handle's value (e.g. a layer name) to named tensors: cache views in their
#: layouts' canonical shapes and slot mappings (see :class:`pcppass.spec.ContextCache`).
ResolveFn = Callable[[str], Mapping[str, "torch.Tensor"]]


@dataclass(frozen=True)
class HandleEffect:
    """What one op does through one handle, as the engine that owns the handle says.

    ``writes``: the op writes the caches its pattern's ``context`` roles name (then synced), or
    only reads through the handle. ``why``: the engine's reason, shown by the audit (the layer's
    attention backend and what it was reviewed to do)."""

    writes: bool
    why: str
    #: why re-running the op's state update for other ranks' rows reproduces the owner's bytes
    #: exactly here (the kernel this handle runs was verified batch-invariant); None when nobody
    #: verified it: a pattern's RERUN alternative is then never chosen for this handle
    rerun_exact: str | None = None


#: ``effect(op, handle) -> HandleEffect``: raises (any exception, its text the reason) when the
#: engine cannot say, e.g. an attention backend nobody reviewed; the write is then uncovered.
EffectFn = Callable[[str, str], HandleEffect]

#: ``rerun(op, handle, rows, lines)``: at run time, re-run ``op``'s state update through ``handle``
#: for the rows whose state line (``lines``, int64 ``[n]``) is >= 0, from their per-row inputs
#: (``rows``: argument name -> ``[n, ...]``, every rank's rows), discarding every output; rows with
#: line -1 (this rank's own, padding) are left alone. Raises before writing when it cannot.
RerunFn = Callable[[str, str, Mapping[str, "torch.Tensor"], "torch.Tensor"], None]


@dataclass(frozen=True)
class Resolver:
    """A registered resolver: ``resolve`` at run time, ``describe`` at compile time.

    ``describe(handle)`` returns tensors (meta tensors allowed) with the shapes, strides and
    dtypes ``resolve`` will return, for an engine whose caches do not exist yet when the graph is
    compiled (vLLM compiles before it allocates its KV cache); the number of blocks may differ.
    Without it, ``resolve`` is called at compile time too.

    ``effect(op, handle)`` says, per handle, whether an op writes or only reads the state behind
    it (:class:`HandleEffect`): asked at compile time for every handle of an op whose pattern names
    this resolver. Without it, a pattern's ``context`` roles mean "writes" and its ``reads`` "only
    reads", and a handle listed in both cannot be decided (uncovered).

    ``rerun(op, handle, rows, lines)`` re-runs a state update for other ranks' rows (the RERUN
    alternative of a context-addressed pattern, :class:`RerunFn`); without it only COPY_ROWS runs.
    """

    name: str
    resolve: ResolveFn
    describe: ResolveFn | None = None
    effect: EffectFn | None = None
    rerun: RerunFn | None = None

    def described(self, handle: str) -> Mapping[str, "torch.Tensor"]:
        return (self.describe or self.resolve)(handle)


_resolvers: dict[str, Resolver] = {}


def register_resolver(name: str, fn: ResolveFn, *, describe: ResolveFn | None = None,
                      effect: EffectFn | None = None, rerun: RerunFn | None = None,
                      replace: bool = False) -> Resolver:
    """Register ``fn(handle_value) -> {role: tensor}`` under ``name`` (``WritePattern.resolver``),
    with the optional compile-time ``describe``, per-handle ``effect`` and run-time ``rerun`` (see
    :class:`Resolver`).

    Raises ``ValueError`` if another resolver already has the name, unless ``replace``.
    """
    resolver = Resolver(name, fn, describe, effect, rerun)
    with _lock:
        old = _resolvers.get(name)
        if old is not None and not replace and (old.resolve, old.describe, old.effect, old.rerun) != (
                fn, describe, effect, rerun):
            raise ValueError(f"resolver {name!r} is already registered ({old.resolve!r})")
        _resolvers[name] = resolver
    return resolver


def unregister_resolver(name: str) -> None:
    with _lock:
        _resolvers.pop(name, None)


def get_resolver(name: str | None) -> Resolver | None:
    """The resolver registered under ``name``; None if there is none."""
    return _resolvers.get(name) if name else None


@contextmanager
def declarations_restored() -> Iterator[None]:
    """Every pattern, refusal and resolver registered, replaced or removed inside the block is
    undone when it ends: the built-in declarations are loaded first, so what the block changed
    is all that goes. For an engine (or a test) running several models in one process, each with
    its own declarations, without one model's leaking into the next."""
    load_builtin_patterns()
    tables = (_by_op, _by_family, _refusals, _resolvers)
    with _lock:
        saved = [dict(table) for table in tables]
    try:
        yield
    finally:
        with _lock:
            for table, before in zip(tables, saved):
                table.clear()
                table.update(before)
