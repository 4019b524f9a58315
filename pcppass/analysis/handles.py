"""Cache handles: op arguments that address state the graph does not hold.

vLLM's KV-update and attention ops take no cache tensor: they take the layer's name and fetch the
cache (and its slot mapping) from a per-step context at run time. Such an argument is a *handle*:

* an opaque script object: a schema argument of type ``PyObject`` (or a TorchBind class), or a
  placeholder whose example value is a fake script object (vLLM's ``LayerName``, registered with
  ``register_opaque_type(..., typ="value", hoist=True)``, which Dynamo lifts to a graph input).
  Its name is its real value: ``LayerName.value`` (``"model.layers.0.self_attn.attn"``), read from
  ``meta["example_value"].real_obj`` or ``meta["grapharg"].example``;
* every string argument of a custom op, unless it is configuration by a clear rule: the last
  word of its argument name says it selects a behaviour (``kv_cache_dtype="auto"``,
  ``scale_fmt="ue8m0"``, ``mode``, ``isa``, ``layer_norm_type``: :data:`CONFIG_WORDS`), or the
  pattern covering the op selects its layout by that argument (``ByArgValue(arg=...)``). A string
  is never assumed harmless for its value or an unusual name: ``where="rows/0"`` may name the
  cache the op writes (fail closed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Collection

import torch
import torch.fx
from torch._library.fake_class_registry import FakeScriptObject

from pcppass.analysis.views import node_value
from pcppass.spec import ByArgValue, WritePattern

#: Last words of argument names (``kv_cache_dtype``, ``scale_fmt``, ``quant_method``) of strings
#: that select a behaviour, never a piece of state.
CONFIG_WORDS = frozenset({
    "dtype", "dtypes", "mode", "fmt", "format", "isa", "kind", "type", "layout", "impl", "backend",
    "activation", "act", "reduction", "reduce", "padding", "method", "policy", "scale",
    "approximate", "rounding", "quant", "device", "precision", "order", "algorithm", "algo",
    "variant", "strategy", "direction", "side", "indexing", "equation",
})
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def _last_word(arg: str) -> str:
    """``kv_cache_dtype`` -> ``dtype``; ``scaleFmt`` -> ``fmt``."""
    words = _WORD.findall(arg)
    return words[-1].lower() if words else ""


def is_configuration(arg: str, options: Collection[str] = ()) -> bool:
    """Whether a string argument named ``arg`` selects a behaviour: its name ends in one of
    :data:`CONFIG_WORDS`, or the op's pattern lists it among ``options``."""
    return arg in options or _last_word(arg) in CONFIG_WORDS


def string_addresses_state(arg: str, value: str, options: Collection[str] = ()) -> bool:
    """A string argument is a handle unless it is configuration (its value does not matter: a
    layer name, a cache key or a path can be spelled any way)."""
    return not is_configuration(arg, options)


def pattern_options(pattern: WritePattern | None) -> frozenset[str]:
    """String arguments ``pattern`` reads as configuration: those its layouts select on."""
    if pattern is None:
        return frozenset()
    return frozenset(c.layout.arg for c in pattern.caches if isinstance(c.layout, ByArgValue))


@dataclass(frozen=True)
class Handle:
    """One handle argument of a call: its schema name and the state it addresses."""

    arg: str  # schema argument name
    name: str  # what it addresses: the opaque object's value, or the string
    value: Any  # the argument as the call holds it (a placeholder node, or a constant)


def _real_object(value: Any) -> Any:
    """The real object behind a graph argument that is an opaque script object; None otherwise."""
    if isinstance(value, torch.fx.Node):
        example = node_value(value)
        if isinstance(example, FakeScriptObject):
            return example.real_obj
        grapharg = value.meta.get("grapharg")
        if example is None and grapharg is not None:
            return _real_object(getattr(grapharg, "example", None))
        return _real_object(example) if example is not None else None
    if isinstance(value, FakeScriptObject):
        return value.real_obj
    if isinstance(value, torch.ScriptObject):
        return value
    if value is None or isinstance(value, (torch.Tensor, str, int, float, bool)):
        return None
    return value if _is_opaque_type(type(value)) else None


def _is_opaque_type(cls: type) -> bool:
    try:
        from torch._library.opaque_object import is_opaque_type
    except ImportError:  # a torch without opaque objects
        return False
    return is_opaque_type(cls)


def _object_name(real: Any, value: Any) -> str:
    """``LayerName("x").value`` -> ``"x"``; else the object's own text, or where the graph got it."""
    inner = getattr(real, "value", None)
    if isinstance(inner, str):
        return inner
    if isinstance(real, str):
        return real
    if isinstance(value, torch.fx.Node):
        source = value.meta.get("pcppass_source")
        where = source[0] if source else str(value.target)
        return f"{type(real).__qualname__} {where}"
    return repr(real)


def _is_object_type(arg: torch.Argument) -> bool:
    """Schema types that carry an opaque Python or TorchBind object."""
    return isinstance(arg.type, (getattr(torch, "PyObjectType", ()), torch.ClassType)) or (
        str(arg.type) == "PyObject")


def _elements(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def call_handles(schema: torch.FunctionSchema, bound: dict[str, Any],
                 options: Collection[str] = ()) -> list[Handle]:
    """Every handle among a call's arguments (bound by schema name), in schema order.

    ``options``: string arguments the op's pattern reads as configuration (:func:`pattern_options`).
    """
    found: list[Handle] = []
    for formal in schema.arguments:
        value = bound.get(formal.name)
        for item in _elements(value):
            real = _real_object(item)
            if real is not None or (_is_object_type(formal) and item is not None):
                found.append(Handle(formal.name, _object_name(real if real is not None else item, item), item))
            elif isinstance(item, str) and string_addresses_state(formal.name, item, options):
                found.append(Handle(formal.name, item, item))
    return found


def value_handles(values: list[tuple[str, Any]]) -> list[Handle]:
    """Handles among the arguments of a call without a schema (an opaque Python function)."""
    found = []
    for label, value in values:
        real = _real_object(value)
        if real is not None and not callable(real):  # a function object is the callee, not a handle
            found.append(Handle(label, _object_name(real, value), value))
    return found
