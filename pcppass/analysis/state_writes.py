"""Find every write into persistent state in a Dynamo (torch-level) graph.

Persistent state is anything the graph receives from outside: tensor placeholders (module buffers,
parameters, forward arguments such as the ``caches`` dict, globals the traced code reads) and
``get_attr`` tensors. A write into a tensor created inside the graph (routing scratch, masks) is a
temporary and is not reported.

A node writes through one of its arguments when

* its target is an operator (``torch.ops.ns.op`` packet or overload) whose schema marks that argument
  ``Tensor(a!)`` (for a packet the overload is resolved from the argument values);
* it is an in-place tensor method or function (``index_copy_``, ``add_``, any ``*_``), an in-place
  Python operator (``operator.setitem``, ``+=``), or a call with an ``out=`` tensor;
* it is a user Triton kernel traced into the graph (``triton_kernel_wrapper_mutation``): the
  written pointers come from Triton's own analysis of the kernel.

The written argument is resolved to its base state through :mod:`pcppass.analysis.views`.
Separately, an operator that declares no write at all but returns only a dependency token and takes
a cache-like handle (a state tensor or a layer-name string) is reported: it may write state the graph
cannot see (vLLM's ``unified_kv_cache_update``).

Example, a model whose forward does ``torch.ops.pcppass.reshape_and_cache_flash(k, v,
caches["k.0"], caches["v.0"], slots, "auto", s, s)`` and ``self.count.add_(1)``::

    reshape_and_cache_flash = torch.ops.pcppass.reshape_and_cache_flash(l_k_, l_v_,
        l_caches_k_0_, l_caches_v_0_, l_slots_, 'auto', ...)      -> 2 writes (key_cache, value_cache)
    add_ = l_self_buffers_count_.add_(1)                          -> 1 write  (self, non-row state)
"""

from __future__ import annotations

import operator
import os
import re
from dataclasses import dataclass, field

import torch
import torch.fx

from pcppass.analysis.defuse import DefUse
from pcppass.analysis.records import StateKind, StateWrite, Uncovered
from pcppass.analysis.views import AliasMap, node_value, view_info

#: Operator namespaces that are torch's own (never a user cache-write op).
TORCH_NAMESPACES = frozenset({
    "aten", "prims", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd",
    "_dtensor", "higher_order", "profiler", "_quantized", "quantized", "_prims", "debugprims",
})

#: ``*_`` methods that change no tensor data.
NON_DATA_INPLACE = frozenset({"requires_grad_", "share_memory_", "retain_grad", "record_stream"})

#: In-place Python operators Dynamo records as ``call_function`` (``x += y`` -> ``operator.iadd``).
INPLACE_OPERATORS: dict[object, str] = {
    operator.setitem: "setitem",
    operator.iadd: "add_",
    operator.isub: "sub_",
    operator.imul: "mul_",
    operator.itruediv: "div_",
    operator.ifloordiv: "floor_divide_",
    operator.imod: "remainder_",
    operator.ipow: "pow_",
    operator.iand: "bitwise_and_",
    operator.ior: "bitwise_or_",
    operator.ixor: "bitwise_xor_",
    operator.ilshift: "bitwise_left_shift_",
    operator.irshift: "bitwise_right_shift_",
}

#: Node meta key under which :mod:`pcppass.analysis.trace` keeps a placeholder's source name
#: (Dynamo drops ``meta["grapharg"]`` once the backend returns).
SOURCE_META_KEY = "pcppass_source"


@dataclass
class StateTensor:
    node: torch.fx.Node
    name: str
    kind: StateKind


@dataclass
class WriteSite:
    """One (node, written argument) pair before alias resolution."""

    node: torch.fx.Node
    op: str
    arg: str
    tensor: torch.fx.Node
    family: str | None = None
    bound_args: dict[str, object] = field(default_factory=dict)


# ----------------------------------------------------------------------------- state tensors


def _kind_of(name: str, source: object) -> StateKind:
    if "._buffers[" in name or ".buffers[" in name:
        return StateKind.BUFFER
    if "._parameters[" in name or ".parameters[" in name:
        return StateKind.PARAMETER
    root = source
    while getattr(root, "base", None) is not None:
        root = root.base
    if root is not None and type(root).__name__ == "GlobalSource" or name.startswith("G["):
        return StateKind.GLOBAL
    return StateKind.INPUT


def state_tensors(gm: torch.fx.GraphModule) -> list[StateTensor]:
    """Every tensor the graph receives from outside (placeholders and ``get_attr`` tensors)."""
    states: list[StateTensor] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if not isinstance(node_value(node), torch.Tensor):
                continue  # SymInt / scalar inputs
            grapharg = node.meta.get("grapharg")
            source = getattr(grapharg, "source", None)
            if source is not None:
                name = source.name() if callable(source.name) else source.name
                states.append(StateTensor(node, name, _kind_of(name, source)))
            elif SOURCE_META_KEY in node.meta:
                name, kind = node.meta[SOURCE_META_KEY]
                states.append(StateTensor(node, name, StateKind(kind)))
            else:
                states.append(StateTensor(node, str(node.target), StateKind.UNKNOWN))
        elif node.op == "get_attr":
            value = node_value(node)
            if value is None:
                value = getattr(gm, str(node.target), None)
                if isinstance(value, torch.Tensor):
                    node.meta.setdefault("example_value", value)
            if isinstance(value, torch.Tensor):
                states.append(StateTensor(node, f"self.{node.target}", StateKind.ATTRIBUTE))
    return states


# ----------------------------------------------------------------------------- schema binding


def _fake(arg: object) -> object:
    if isinstance(arg, torch.fx.Node):
        return node_value(arg)
    if isinstance(arg, (list, tuple)):
        return type(arg)(_fake(a) for a in arg)
    return arg


def resolve_overload(
    target: object, args: tuple, kwargs: dict
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
            target._qualified_op_name, *_fake(tuple(args)), **_fake(dict(kwargs))
        )
        return getattr(target, name)
    except (RuntimeError, TypeError):
        pass
    for name in names:  # fall back to the first schema the arguments bind to
        overload = getattr(target, name)
        if bind_schema(overload._schema, args, kwargs) is not None:
            return overload
    return None


def bind_schema(schema: torch.FunctionSchema, args: tuple, kwargs: dict) -> dict[str, object] | None:
    """Schema argument name -> value (node, constant or default); None if the call does not bind."""
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        return None
    bound: dict[str, object] = {}
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


def _written_schema_args(schema: torch.FunctionSchema) -> list[str]:
    return [
        a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
    ]


def _tensor_nodes(value: object, name: str) -> list[tuple[str, torch.fx.Node]]:
    """``(arg label, node)`` for a written argument: a node, or a list of nodes (``Tensor[]``)."""
    if isinstance(value, torch.fx.Node):
        return [(name, value)]
    if isinstance(value, (list, tuple)):
        return [(f"{name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.fx.Node)]
    return []


def _aten_method_binding(name: str, args: tuple, kwargs: dict) -> dict[str, object]:
    """Bind an in-place method call to aten's schema names (``self``, ``dim``, ``index``...)."""
    packet = getattr(torch.ops.aten, name, None)
    overload = resolve_overload(packet, args, kwargs) if packet is not None else None
    if overload is not None:
        bound = bind_schema(overload._schema, args, kwargs)
        if bound is not None:
            return bound
    bound = {"self": args[0]} if args else {}
    bound.update({f"arg{i}": a for i, a in enumerate(args[1:], start=1)})
    bound.update(kwargs)
    return bound


# ----------------------------------------------------------------------------- write sites


def _is_torch_namespace(qualified: str) -> bool:
    return qualified.split("::", 1)[0] in TORCH_NAMESPACES


def _method_family(name: str) -> str | None:
    """In-place spelling -> family name; None when the method writes no tensor data."""
    if name == "__setitem__":
        return "setitem"
    if name.startswith("__") and name.endswith("__"):
        inplace = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_", "__itruediv__": "div_"}
        return inplace.get(name)
    if name.endswith("_") and not name.startswith("_") and name not in NON_DATA_INPLACE:
        return name
    return None


def _triton_sites(node: torch.fx.Node) -> list[WriteSite]:
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    kernel_idx = node.kwargs["kernel_idx"]
    tensor_kwargs: dict[str, torch.fx.Node] = {
        k: v for k, v in node.kwargs["kwargs"].items() if isinstance(v, torch.fx.Node)
    }
    kernel = tkw.kernel_side_table.get_kernel(kernel_idx)
    fn = getattr(kernel, "fn", kernel)
    name = getattr(fn, "__name__", "kernel")
    fake_kwargs = {k: _fake(v) for k, v in node.kwargs["kwargs"].items()}
    try:
        written = tkw.get_mutated_tensors(
            kernel_idx, node.kwargs["constant_args_idx"], fake_kwargs,
            node.kwargs.get("tma_descriptor_metadata", {}),
        )
    except Exception:  # Triton cannot analyse the kernel here: every pointer may be written
        written = list(tensor_kwargs)
    bound = dict(node.kwargs["kwargs"])
    return [
        WriteSite(node, f"triton::{name}", arg, tensor_kwargs[arg], None, bound)
        for arg in written
        if arg in tensor_kwargs
    ]


def write_sites(node: torch.fx.Node) -> list[WriteSite]:
    """Every (argument, tensor) ``node`` writes, whatever the spelling."""
    target = node.target
    if node.op == "call_method":
        name = str(target)
        family = _method_family(name)
        sites = []
        if family is not None and node.args:
            bound = _aten_method_binding(family if family != "setitem" else name, node.args, node.kwargs)
            op = f"aten::{family}" if hasattr(torch.ops.aten, family) else f"Tensor.{family}"
            sites.append(WriteSite(node, op, "self", node.args[0], family, bound))
        sites += _out_sites(node, name)
        return sites
    if node.op != "call_function":
        return []
    if type(target).__name__ == "TritonKernelWrapperMutation":
        return _triton_sites(node)
    if target in INPLACE_OPERATORS and node.args and isinstance(node.args[0], torch.fx.Node):
        family = INPLACE_OPERATORS[target]
        if family == "setitem":
            bound = {"self": node.args[0], "indices": node.args[1], "values": node.args[2]}
            return [WriteSite(node, "operator.setitem", "self", node.args[0], family, bound)]
        bound = {"self": node.args[0], "other": node.args[1]}
        return [WriteSite(node, f"aten::{family}", "self", node.args[0], family, bound)]
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        overload = resolve_overload(target, node.args, node.kwargs)
        if overload is None:
            return []
        qualified = overload._schema.name
        bound = bind_schema(overload._schema, node.args, node.kwargs) or {}
        family = qualified.split("::", 1)[1] if _is_torch_namespace(qualified) else None
        return [
            WriteSite(node, qualified, label, tensor, family, bound)
            for arg in _written_schema_args(overload._schema)
            for label, tensor in _tensor_nodes(bound.get(arg), arg)
        ]
    name = getattr(target, "__name__", "")
    sites = []
    family = _method_family(name) if name else None
    if family is not None and node.args and isinstance(node.args[0], torch.fx.Node):
        bound = _aten_method_binding(family, node.args, node.kwargs)
        sites.append(WriteSite(node, f"aten::{family}", "self", node.args[0], family, bound))
    elif node.kwargs.get("inplace") is True and node.args and isinstance(node.args[0], torch.fx.Node):
        bound = {"self": node.args[0], **node.kwargs}
        sites.append(WriteSite(node, f"{name}(inplace=True)", "self", node.args[0], name, bound))
    return sites + _out_sites(node, name)


def _out_sites(node: torch.fx.Node, name: str) -> list[WriteSite]:
    out = node.kwargs.get("out")
    return [
        WriteSite(node, f"{name}(out=)", label, tensor, f"{name}(out=)", dict(node.kwargs))
        for label, tensor in _tensor_nodes(out, "out")
    ]


# ----------------------------------------------------------------------------- handles


def _declares_no_write_custom_op(node: torch.fx.Node) -> torch._ops.OpOverload | None:
    if node.op != "call_function" or not isinstance(
        node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    ):
        return None
    overload = resolve_overload(node.target, node.args, node.kwargs)
    if overload is None or _is_torch_namespace(overload._schema.name):
        return None
    return None if _written_schema_args(overload._schema) else overload


def _only_a_dependency_token(node: torch.fx.Node, defuse: DefUse) -> bool:
    """The op's result carries no data: unused, empty, or only fed to other opaque ops."""
    value = node_value(node)
    if value is None or not defuse.users(node):
        return True
    values = value if isinstance(value, (list, tuple)) else [value]
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if all(isinstance(v, torch.Tensor) and statically_known_true(v.numel() == 0) for v in values):
        return True
    return all(
        _declares_no_write_custom_op(u) is not None or (
            u.op == "call_function"
            and isinstance(u.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
            and not _is_torch_namespace(qualified_name(u.target))
        )
        for u in defuse.users(node)
    )


def qualified_name(target: object) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return target._qualified_op_name


def _cache_like(state: StateTensor) -> bool:
    """Weights and per-step row inputs (sized by the symbolic row count) are not cache handles."""
    if state.kind is StateKind.PARAMETER:
        return False
    value = node_value(state.node)
    return not any(isinstance(d, torch.SymInt) for d in value.shape)


def _handle_records(
    node: torch.fx.Node, defuse: DefUse, aliases: AliasMap, names: dict[torch.fx.Node, StateTensor]
) -> list[StateWrite]:
    overload = _declares_no_write_custom_op(node)
    if overload is None or not _only_a_dependency_token(node, defuse):
        return []
    bound = bind_schema(overload._schema, node.args, node.kwargs) or {}
    records = []
    for arg, value in bound.items():
        if isinstance(value, str):
            records.append(StateWrite(
                node=node, op=overload._schema.name, state=f"handle {arg}={value!r}",
                state_node=None, arg=arg, source=source_location(node),
                reason=Uncovered.UNDECLARED_CACHE_HANDLE,
                detail=(f"{overload._schema.name} declares no mutation, its result is only a "
                        f"dependency token, and it takes the handle {arg}={value!r}: it may write "
                        f"state fetched by that handle (run `pcppass audit --dynamic` to check)"),
            ))
    if records:
        return records  # the string handle names the state; row tensors beside it are inputs
    for arg, value in bound.items():
        for label, tensor in _tensor_nodes(value, arg):
            alias = aliases.alias_of(tensor)
            if alias is None or not _cache_like(names[alias.base]):
                continue
            state = names[alias.base]
            records.append(StateWrite(
                node=node, op=overload._schema.name, state=state.name, state_node=alias.base,
                arg=label, view_chain=list(alias.chain), source=source_location(node),
                reason=Uncovered.UNDECLARED_CACHE_HANDLE, written_node=tensor,
                view=view_info(alias, tensor), state_kind=state.kind,
                detail=(f"{overload._schema.name} declares no mutation and its result is only a "
                        f"dependency token, yet it takes the state tensor {state.name} as {label}"),
            ))
    return records


# ----------------------------------------------------------------------------- entry point

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def source_location(node: torch.fx.Node) -> str:
    """``path:line`` of the innermost user frame that produced ``node``."""
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME.findall(trace)
    if not frames:
        return "<unknown>"
    path, line = frames[-1]
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:
        pass
    return f"{path}:{line}"


def find_state_writes(gm: torch.fx.GraphModule, *, classify: bool = True) -> list[StateWrite]:
    """Every write into persistent state in ``gm``, in graph order, classified by default.

    ``gm`` is the graph a ``torch.compile`` backend receives (placeholders carry
    ``meta["grapharg"]`` while the backend runs; :func:`pcppass.analysis.trace.capture_graph`
    keeps their names afterwards). Classification attaches the covering pattern and the resolved
    layout, or the reason nothing covers the write (see :mod:`pcppass.analysis.classify`).
    """
    defuse = DefUse(gm.graph)
    states = state_tensors(gm)
    names = {s.node: s for s in states}
    aliases = AliasMap(defuse, [s.node for s in states])
    records: list[StateWrite] = []
    for node in gm.graph.nodes:
        sites = write_sites(node)
        for site in sites:
            alias = aliases.alias_of(site.tensor)
            if alias is None:
                continue  # a temporary created inside the graph
            state = names[alias.base]
            records.append(StateWrite(
                node=node, op=site.op, state=state.name, state_node=alias.base, arg=site.arg,
                view_chain=list(alias.chain), source=source_location(node),
                written_node=site.tensor, view=view_info(alias, site.tensor),
                state_kind=state.kind, family=site.family, bound_args=site.bound_args,
            ))
        if not sites:
            records += _handle_records(node, defuse, aliases, names)
    if classify:
        from pcppass.analysis.classify import classify_writes

        classify_writes(records)
    return records
