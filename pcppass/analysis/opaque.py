"""Calls the analysis cannot look into: whatever state they receive, they may write.

A Dynamo graph can hold calls whose body is not in the graph and whose effect no schema declares:

* a Python function passed through ``torch.compiler.allow_in_graph`` (the node's target is the
  user's function itself);
* a ``torch._dynamo.nonstrict_trace`` call (a function object travels as an argument of a
  ``flat_apply``-style call; on some torch versions a ``flat_apply`` / ``invoke_leaf_function``
  higher-order op);
* a higher-order op without a graph body (``call_torchbind``, ``with_effects``, ...);
* an opaque module (``call_module``) or a method a plain tensor does not have (``call_method`` on a
  subclass).

:func:`opaque_call` names such a call; the finder reports every one that receives state (or an
alias of it, or a cache handle) as uncovered. Torch's own functions (``torch.*`` outside Dynamo's
internals), ``operator``, ``builtins`` and ``math`` are known; operators with schemas and
higher-order ops with bodies are analysed elsewhere.

Not visible here, by construction: a custom op whose ``mutates_args`` under-declares what it writes.
Its schema is all the graph knows; ``pcppass audit --dynamic`` and the run-time cross-rank state
digest catch it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.fx

#: Modules whose functions never run user code on tensors they receive.
KNOWN_MODULES = ("_operator", "operator", "builtins", "math", "cmath")
#: Torch modules that run user code (Dynamo's wrappers of non-traced calls).
OPAQUE_TORCH_MODULES = ("torch._dynamo", "torch._higher_order_ops")
#: Higher-order ops without a graph body whose effect is explicit in the graph or analysed apart.
KNOWN_HIGHER_ORDER_OPS = frozenset({
    "auto_functionalized", "auto_functionalized_v2",  # functional: writes come back as copy_ nodes
    "triton_kernel_wrapper_functional",
    "triton_kernel_wrapper_mutation",  # Triton's own analysis says which pointers it writes
})


def _module_of(target: object) -> str | None:
    module = getattr(target, "__module__", None)
    if module is None:  # a method descriptor: torch.Tensor.add_ -> torch._C.TensorBase
        module = getattr(getattr(target, "__objclass__", None), "__module__", None)
    if module is None:
        owner = getattr(target, "__self__", None)
        module = getattr(owner, "__name__", None) if type(owner).__name__ == "module" else None
    return module


def _is_known_function(target: object) -> bool:
    try:
        return _is_known_cached(target)
    except TypeError:  # an unhashable callable
        return _is_known_uncached(target)


@functools.lru_cache(maxsize=4096)
def _is_known_cached(target: object) -> bool:
    return _is_known_uncached(target)


def _is_known_uncached(target: object) -> bool:
    module = _module_of(target)
    if module is None:
        return False
    if module in KNOWN_MODULES:
        return True
    return (module == "torch" or module.startswith("torch.")) and not module.startswith(OPAQUE_TORCH_MODULES)


def _callable_arguments(node: torch.fx.Node) -> list[str]:
    """Function objects a call receives from ``get_attr`` nodes (not graph modules: region bodies)."""
    owner = node.graph.owning_module
    found = []
    for arg in node.all_input_nodes:
        if arg.op != "get_attr" or owner is None:
            continue
        value = getattr(owner, str(arg.target), None)
        if callable(value) and not isinstance(value, (torch.fx.GraphModule, torch.Tensor)):
            found.append(_qualname(_user_function(value)))
    return found


def _user_function(fn: object, depth: int = 4) -> object:
    """The user's function inside torch's wrappers (a partial, a leaf callable, a closure)."""
    for _ in range(depth):
        inner = getattr(fn, "func", None) or getattr(fn, "_fn", None) or getattr(fn, "__wrapped__", None)
        if inner is None and _is_known_function(fn) is False and (_module_of(fn) or "").startswith("torch"):
            cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
                     if _cell_is_set(c) and callable(c.cell_contents)]
            inner = cells[0] if cells else None
        if inner is None:
            return fn
        fn = inner
    return fn


def _cell_is_set(cell: object) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _qualname(target: object) -> str:
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__qualname__
    module = _module_of(target)
    return f"{module}.{name}" if module else name


@dataclass(frozen=True)
class OpaqueCall:
    """A call the analysis cannot see into: ``op`` names what runs, ``kind`` how it got there."""

    op: str
    kind: str


def opaque_call(node: torch.fx.Node, has_body: bool) -> OpaqueCall | None:
    """The call at ``node`` if the graph cannot see what it does; None for a call whose effect is
    known (a schema operator, torch's own function, a higher-order op whose bodies are walked).

    ``has_body``: the node is a higher-order op with graph bodies (the finder walks them).
    """
    target = node.target
    if node.op == "call_module":
        owner = node.graph.owning_module
        module = owner.get_submodule(str(target)) if owner is not None else None
        if module is not None and type(module).__module__.startswith("torch.nn"):
            return None
        return OpaqueCall(_qualname(type(module)) if module is not None else str(target), "opaque module")
    if node.op == "call_method":
        if hasattr(torch.Tensor, str(target)):
            return None
        return OpaqueCall(f"Tensor.{target}", "method a plain tensor does not have")
    if node.op != "call_function" or isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return None
    functions = _callable_arguments(node)
    if functions:
        return OpaqueCall(", ".join(functions), f"function called through {_qualname(target)} (nonstrict_trace)")
    if isinstance(target, torch._ops.HigherOrderOperator):
        name = getattr(target, "__name__", str(target))
        if has_body or name in KNOWN_HIGHER_ORDER_OPS:
            return None
        return OpaqueCall(f"higher_order.{name}", "higher-order op without a graph body")
    if _is_known_function(target):
        return None
    return OpaqueCall(_qualname(target), "Python function in the graph (allow_in_graph)")
