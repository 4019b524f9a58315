"""Operator schemas of graph calls: which overload a call dispatches to, its arguments by schema
name, and which of them it writes (``Tensor(a!)``, ``Tensor(a!)[]``).

Shared by the state-write finder and the sync planner, so a call binds the same way in both.

A Dynamo graph spells aten ops as tensor methods (``cache.index_copy_(0, idx, x)``) or torch
functions (``torch._foreach_add_([cache], 1.0)``); :func:`aten_overload` resolves such a spelling to
the overload it dispatches to, whose schema then says which arguments are written::

    aten_overload("_foreach_add_", ([cache], 1.0), {})
        -> aten::_foreach_add_.Scalar(Tensor(a!)[] self, Scalar scalar) -> ()
    written_args(...) -> ["self"]
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx

from pcppass.analysis.views import fake_value

#: ``cache[idx] = src`` binds like ``index_put_(self, indices, values)``.
SETITEM_ARGS = ("self", "indices", "values")


def bind_schema(
    schema: torch.FunctionSchema, args: Sequence, kwargs: dict
) -> dict[str, Any] | None:
    """Schema argument name -> value (node, constant or default); None if the call does not bind."""
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        return None
    bound: dict[str, Any] = {}
    for formal, actual in zip(positional, args):
        bound[formal.name] = actual
    known = {a.name for a in schema.arguments}
    for key, value in kwargs.items():
        if key not in known or key in bound:
            return None
        bound[key] = value
    for formal in schema.arguments:
        if formal.name not in bound:
            if not formal.has_default_value():
                return None
            bound[formal.name] = formal.default_value
    return bound


def resolve_overload(
    target: object, args: Sequence, kwargs: dict
) -> torch._ops.OpOverload | None:
    """The overload a call of ``target`` (packet or overload) dispatches to, from its arguments."""
    if isinstance(target, torch._ops.OpOverload):
        return target
    if not isinstance(target, torch._ops.OpOverloadPacket):
        return None
    names = target.overloads()
    if len(names) == 1:
        return getattr(target, names[0])
    try:
        name = torch._C._jit_resolve_packet(
            target._qualified_op_name, *fake_value(tuple(args)), **fake_value(dict(kwargs))
        )
        return getattr(target, name)
    except (RuntimeError, TypeError):
        pass
    for name in names:  # fall back to the first schema the arguments bind to
        overload = getattr(target, name)
        if bind_schema(overload._schema, args, kwargs) is not None:
            return overload
    return None


def aten_overload(name: str, args: Sequence, kwargs: dict) -> torch._ops.OpOverload | None:
    """The aten overload a tensor method or torch function called ``name`` dispatches to."""
    packet = getattr(torch.ops.aten, name, None) if name else None
    return resolve_overload(packet, args, kwargs) if packet is not None else None


def written_args(schema: torch.FunctionSchema) -> list[str]:
    """Names of the arguments the schema marks as written (``Tensor(a!)`` or ``Tensor(a!)[]``)."""
    return [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def bind_call(node: torch.fx.Node) -> dict[str, Any] | None:
    """Every argument of a call node by its schema name (``self`` for a method receiver).

    ``operator.setitem`` binds like ``index_put_``; a tensor method or torch function binds to the
    aten overload of the same name. None when no schema is known or the call does not bind.
    """
    target = node.target
    if node.op == "call_function" and target is operator.setitem:
        return dict(zip(SETITEM_ARGS, node.args))
    if node.op == "call_method":
        overload = aten_overload(str(target), node.args, node.kwargs)
    elif node.op == "call_function" and isinstance(
        target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    ):
        overload = resolve_overload(target, node.args, node.kwargs)
    elif node.op == "call_function":
        overload = aten_overload(getattr(target, "__name__", ""), node.args, node.kwargs)
    else:
        return None
    if overload is None:
        return None
    return bind_schema(overload._schema, node.args, dict(node.kwargs))
