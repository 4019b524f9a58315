"""Cache handles: op arguments that address state the graph does not hold.

vLLM's KV-update and attention ops take no cache tensor: they take the layer's name and fetch the
cache (and its slot mapping) from a per-step context at run time. Such an argument is a *handle*:

* an opaque script object: a schema argument of type ``PyObject`` (or a TorchBind class), or a
  placeholder whose example value is a fake script object (vLLM's ``LayerName``, registered with
  ``register_opaque_type(..., typ="value", hoist=True)``, which Dynamo lifts to a graph input).
  Its name is its real value: ``LayerName.value`` (``"model.layers.0.self_attn.attn"``), read from
  ``meta["example_value"].real_obj`` or ``meta["grapharg"].example``;
* a string that addresses state: its argument is named like a layer (``layer_name``, ``prefix``,
  ``layer``), or its value is a dotted module path. A string that selects a behaviour (a dtype,
  mode or format: ``kv_cache_dtype="auto"``, ``scale_fmt="ue8m0"``) is never a handle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._library.fake_class_registry import FakeScriptObject

from pcppass.analysis.views import node_value

#: Argument names of strings that select a behaviour, never a piece of state.
_OPTION_NAME = re.compile(
    r"dtype|mode|fmt|format|isa|kind|type|layout|impl|backend|activation|reduction|padding|"
    r"method|policy|scale|approximate|rounding|quant|device|precision|order|reduce",
    re.IGNORECASE,
)
#: Argument names of strings that address state (a layer, a module prefix, a cache handle).
_STATE_NAME = re.compile(r"layer|(^|_)(name|names|prefix|handle|cache_id)$", re.IGNORECASE)
#: A dotted module path: ``model.layers.0.self_attn.attn``.
_MODULE_PATH = re.compile(r"^[A-Za-z_]\w*(\.\w+)+$")


@dataclass(frozen=True)
class Handle:
    """One handle argument of a call: its schema name and the state it addresses."""

    arg: str  # schema argument name
    name: str  # what it addresses: the opaque object's value, or the string
    value: Any  # the argument as the call holds it (a placeholder node, or a constant)


def string_addresses_state(arg: str, value: str) -> bool:
    """A string argument is a handle when it names state, never when it selects an option."""
    if _OPTION_NAME.search(arg):
        return False
    return bool(_STATE_NAME.search(arg) or _MODULE_PATH.match(value))


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


def call_handles(schema: torch.FunctionSchema, bound: dict[str, Any]) -> list[Handle]:
    """Every handle among a call's arguments (bound by schema name), in schema order."""
    found: list[Handle] = []
    for formal in schema.arguments:
        value = bound.get(formal.name)
        for item in _elements(value):
            real = _real_object(item)
            if real is not None or (_is_object_type(formal) and item is not None):
                found.append(Handle(formal.name, _object_name(real if real is not None else item, item), item))
            elif isinstance(item, str) and string_addresses_state(formal.name, item):
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
