"""State the step rebinds instead of writing in place, read from Dynamo's side effects.

``self.last_h = h`` (a registered buffer, read back or not), ``caches["extra"] = caches["extra"] +
1``, ``nonlocal last; last = x.sum(0)``, ``history.append(h)``: the graph computes a tensor and
Dynamo stores it into the module, dict, closure cell or list AFTER the graph runs. No replica sync
sees that store, so each rank keeps the tensor its own rows produced. Dynamo records every such
store as a side effect of the frame it is compiling; the graph handed to the backend does not show
them. So while the backend compiles, the side effects of the frame are read (Dynamo's
``SideEffects``: the objects that existed before the step and that the step mutates, and the
values it stores into them): a tensor stored into one, other than the one that was there, is
state rebound by the step, named by where it lives and the line that stored it::

    self.last_h = x.sum(0)        ->  L['self'].__dict__['_buffers']['last_h'] at model.py:12
    nonlocal last; last = ...     ->  closure variable 'last' of step at model.py:20

Dynamo says none of this in a public API; anything missing or unexpected returns None ("cannot
tell"), and the pass refuses to shard unless the caller vouches for the graph (``whole_step``).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Iterator

import torch

log = logging.getLogger(__name__)

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_BARE_LOCAL = re.compile(r"^L\['[^']*'\]$")
#: how deep a stored value (tuples, lists, dicts of tensors) is searched for tensors
_DEPTH = 3


def _source_name(source: Any) -> str | None:
    if source is None:
        return None
    try:
        name = source.name
        return name() if callable(name) else name
    except Exception:  # noqa: BLE001 - sources that cannot name themselves (closure cells)
        local = getattr(source, "local_name", None)
        return f"closure variable {local!r}" if local else None


def _tensors_in(value: Any, depth: int = _DEPTH) -> Iterator[Any]:
    """The tensor variables in a stored value (a tensor, or containers of them)."""
    from torch._dynamo.variables import TensorVariable
    from torch._dynamo.variables.lazy import LazyVariableTracker

    if isinstance(value, LazyVariableTracker):
        if not value.is_realized():
            return  # never touched by the step: still what was there
        value = value.realize()
    if isinstance(value, TensorVariable):
        yield value
        return
    if depth == 0:
        return
    items = getattr(value, "items", None)
    if isinstance(items, dict):
        items = list(items.values())
    if isinstance(items, (list, tuple)):
        for item in items:
            yield from _tensors_in(item, depth - 1)


def _per_step(tensor: Any) -> bool:
    """A tensor the step computed (no source) or received as a bare argument (``L['x']``): this
    rank's own data. A tensor with any other source is state the step found somewhere (the value
    that was there, or another state tensor): no rank's own data."""
    name = _source_name(getattr(tensor, "source", None))
    return name is None or _BARE_LOCAL.match(name) is not None


def _stored(var: Any, side_effects: Any) -> Iterator[tuple[str, Any]]:
    """(where, stored value) of every store into ``var``, an object that existed before the step."""
    for attr, value in side_effects.store_attr_mutations.get(var, {}).items():
        yield (".cell_contents" if attr == "cell_contents" else f".{attr}"), value
    items = getattr(var, "items", None)
    if isinstance(items, dict):
        for key, value in items.items():
            vt = getattr(key, "vt", None)
            try:
                shown = repr(vt.as_python_constant()) if vt is not None else repr(key)
            except Exception:  # noqa: BLE001 - a key that is not a constant
                shown = "?"
            yield f"[{shown}]", value
    elif isinstance(items, list):
        for i, value in enumerate(items):
            yield f"[{i}]", value


def _user_line(side_effects: Any, var: Any) -> str:
    """The first frame outside torch that mutated ``var`` (file:line), or ""."""
    for stack in (getattr(side_effects, "mutation_user_stacks", {}) or {}).get(var, []):
        for frame in stack:
            if not frame.filename.startswith(_TORCH_DIR):
                return f" at {frame.filename}:{frame.lineno}"
    return ""


def rebound_state() -> list[str] | None:
    """Where the step being compiled stores a tensor it computed (or received as an argument)
    into an object that outlives it, one line each; None: cannot tell (no Dynamo compile is
    running, or its internals are not as expected)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        side_effects = InstructionTranslator.current_tx().output.side_effects
        modified = list(side_effects._get_modified_vars())
    except Exception as exc:  # noqa: BLE001 - Dynamo internals moved, or no Dynamo compile running
        log.debug("pcppass: side-effect inspection unavailable: %r", exc)
        return None
    found = []
    try:
        for var in modified:
            if "Existing" not in type(getattr(var, "mutation_type", None)).__name__:
                continue  # an object the step created: it does not outlive the step as state
            base = _source_name(getattr(var, "source", None)) or type(var).__name__
            for where, value in _stored(var, side_effects):
                name = base if where == ".cell_contents" else f"{base}{where}"
                if any(map(_per_step, _tensors_in(value))):
                    found.append(f"{name}{_user_line(side_effects, var)}")
    except Exception as exc:  # noqa: BLE001 - an unexpected variable tracker
        log.debug("pcppass: side-effect inspection failed: %r", exc)
        return None
    return list(dict.fromkeys(found))
