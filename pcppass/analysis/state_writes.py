"""Find every write into persistent state in a Dynamo (torch-level) graph.

Persistent state is anything the graph receives from outside: tensor placeholders (module buffers,
parameters, forward arguments such as the ``caches`` dict, globals the traced code reads) and
``get_attr`` tensors. A write into a tensor created inside the graph (routing scratch, masks) is a
temporary and is not reported.

A node writes through one of its arguments when

* its target is an operator (``torch.ops.ns.op`` packet or overload) whose schema marks that argument
  ``Tensor(a!)`` or ``Tensor(a!)[]`` (for a packet the overload is resolved from the argument
  values; a written list writes every tensor in it);
* it is an in-place tensor method or torch function (``index_copy_``, ``add_``, private ones such
  as ``_foreach_copy_``): resolved to the aten overload of that name, whose schema says which
  arguments are written, else its first argument (each tensor of a list); an in-place Python
  operator (``operator.setitem``, ``+=``), or a call with an ``out=`` tensor;
* it is a user Triton kernel traced into the graph (``triton_kernel_wrapper_mutation``): the
  written pointers come from Triton's own analysis of the kernel.

The written argument is resolved to its base state through :mod:`pcppass.analysis.views`.

The bodies of higher-order ops (``torch.utils.checkpoint`` -> ``tag_activation_checkpoint``,
``wrap``, ``invoke_subgraph``, ``cond``...) are walked too, their placeholders mapped to the op's
operands: a write there that reaches state is reported, uncovered, against the higher-order op
node (the rewrite cannot place sync inside a region body).

Writes the graph does not spell out are reported too, uncovered, never assumed absent:

* a custom op that takes a cache handle (an opaque ``LayerName``, a layer-name string; see
  :mod:`pcppass.analysis.handles`), whatever it returns and declares: one record per handle
  (vLLM's ``unified_kv_cache_update`` and attention ops);
* a custom op that declares no write and returns only a dependency token: through each cache-like
  state tensor it takes, or as a side effect when it takes none;
* an opaque call that receives state or a handle (``allow_in_graph``, ``nonstrict_trace``, a
  higher-order op without a body; :mod:`pcppass.analysis.opaque`);
* a write into a tensor whose storage cannot be read (it may be state).

A custom op whose ``mutates_args`` under-declares what it writes cannot be told from one that reads:
``pcppass audit --dynamic`` (:mod:`pcppass.analysis.dynamic`) and the run-time state digest catch it.

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
from pcppass.analysis.handles import Handle, call_handles, pattern_options, value_handles
from pcppass.analysis.opaque import OpaqueCall, opaque_call
from pcppass.analysis.records import StateKind, StateWrite, Uncovered
from pcppass.analysis.schema import (
    SETITEM_ARGS, aten_overload, bind_schema, resolve_overload, written_args,
)
from pcppass.analysis.views import AliasMap, fake_value, node_value, storage_keys, view_info
from pcppass.registry import pattern_for_op

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


# ----------------------------------------------------------------------------- write sites


def _tensor_nodes(value: object, name: str) -> list[tuple[str, torch.fx.Node]]:
    """``(arg label, node)`` for a written argument: a node, or a list of nodes (``Tensor[]``)."""
    if isinstance(value, torch.fx.Node):
        return [(name, value)]
    if isinstance(value, (list, tuple)):
        return [(f"{name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.fx.Node)]
    return []


def _is_torch_namespace(qualified: str) -> bool:
    return qualified.split("::", 1)[0] in TORCH_NAMESPACES


def _inplace_family(name: str) -> str | None:
    """In-place spelling -> family name; None when the name is not an in-place data write.

    Private in-place ops count (``_foreach_add_``, ``_index_put_impl_``): only dunders are
    spelled differently from their aten op.
    """
    if name == "__setitem__":
        return "setitem"
    if name.startswith("__") and name.endswith("__"):
        inplace = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_", "__itruediv__": "div_"}
        return inplace.get(name)
    if name.endswith("_") and name.strip("_") and name not in NON_DATA_INPLACE:
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
    try:
        written = tkw.get_mutated_tensors(
            kernel_idx, node.kwargs["constant_args_idx"], fake_value(dict(node.kwargs["kwargs"])),
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


def _schema_sites(
    node: torch.fx.Node, overload: torch._ops.OpOverload, op: str, family: str | None
) -> list[WriteSite]:
    """One site per tensor in every argument the schema marks written (each element of a list)."""
    bound = bind_schema(overload._schema, node.args, node.kwargs) or {}
    return [
        WriteSite(node, op, label, tensor, family, bound)
        for arg in written_args(overload._schema)
        for label, tensor in _tensor_nodes(bound.get(arg), arg)
    ]


def _inplace_sites(node: torch.fx.Node, name: str) -> list[WriteSite]:
    """A tensor method or torch function spelled in place (``index_copy_``, ``_foreach_add_``).

    The aten overload of the same name says which arguments are written; without one, the first
    argument (each tensor of it, for a list) is.
    """
    family = _inplace_family(name)
    if family is None or not node.args:
        return []
    if family == "setitem":
        bound = dict(zip(SETITEM_ARGS, node.args))
        return [WriteSite(node, "Tensor.setitem", "self", node.args[0], family, bound)]
    overload = aten_overload(family, node.args, node.kwargs)
    if overload is not None:
        return _schema_sites(node, overload, f"aten::{family}", family)
    bound = {"self": node.args[0], **{f"arg{i}": a for i, a in enumerate(node.args[1:], start=1)},
             **node.kwargs}
    return [
        WriteSite(node, f"Tensor.{family}", label, tensor, family, bound)
        for label, tensor in _tensor_nodes(node.args[0], "self")
    ]


def write_sites(node: torch.fx.Node) -> list[WriteSite]:
    """Every (argument, tensor) ``node`` writes, whatever the spelling."""
    target = node.target
    if node.op == "call_method":
        name = str(target)
        return _inplace_sites(node, name) + _out_sites(node, name)
    if node.op != "call_function":
        return []
    if type(target).__name__ == "TritonKernelWrapperMutation":
        return _triton_sites(node)
    if target in INPLACE_OPERATORS and node.args and isinstance(node.args[0], torch.fx.Node):
        family = INPLACE_OPERATORS[target]
        if family == "setitem":
            bound = dict(zip(SETITEM_ARGS, node.args))
            return [WriteSite(node, "operator.setitem", "self", node.args[0], family, bound)]
        bound = {"self": node.args[0], "other": node.args[1]}
        return [WriteSite(node, f"aten::{family}", "self", node.args[0], family, bound)]
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        overload = resolve_overload(target, node.args, node.kwargs)
        if overload is None:
            return []
        qualified = overload._schema.name
        family = qualified.split("::", 1)[1] if _is_torch_namespace(qualified) else None
        return _schema_sites(node, overload, qualified, family)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return []  # its body is walked as a region (see _region_writes)
    name = getattr(target, "__name__", "")
    sites = _inplace_sites(node, name)
    if not sites and node.kwargs.get("inplace") is True and node.args:
        bound = {"self": node.args[0], **node.kwargs}
        sites = [
            WriteSite(node, f"{name}(inplace=True)", label, tensor, name, bound)
            for label, tensor in _tensor_nodes(node.args[0], "self")
        ]
    return sites + _out_sites(node, name)


def _out_sites(node: torch.fx.Node, name: str) -> list[WriteSite]:
    out = node.kwargs.get("out")
    return [
        WriteSite(node, f"{name}(out=)", label, tensor, f"{name}(out=)", dict(node.kwargs))
        for label, tensor in _tensor_nodes(out, "out")
    ]


# ----------------------------------------------------------------------------- handles


def _custom_op(node: torch.fx.Node) -> torch._ops.OpOverload | None:
    """The overload of a call to an operator outside torch's own namespaces; None otherwise."""
    if node.op != "call_function" or not isinstance(
        node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    ):
        return None
    overload = resolve_overload(node.target, node.args, node.kwargs)
    if overload is None or _is_torch_namespace(overload._schema.name):
        return None
    return overload


def _declares_no_write_custom_op(node: torch.fx.Node) -> torch._ops.OpOverload | None:
    overload = _custom_op(node)
    return None if overload is None or written_args(overload._schema) else overload


def _only_a_dependency_token(node: torch.fx.Node, defuse: DefUse) -> bool:
    """The op's result carries no data: unused, or empty (a dependency token).

    A non-empty result is data even when only other opaque ops consume it: vLLM's DeepSeek-V2
    graph feeds ``vllm_ir::rms_norm``'s output (the normalised latent) only to the MLA KV-update
    and attention ops."""
    value = node_value(node)
    if value is None or not defuse.users(node):
        return True
    values = value if isinstance(value, (list, tuple)) else [value]
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return all(isinstance(v, torch.Tensor) and statically_known_true(v.numel() == 0) for v in values)


def qualified_name(target: object) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return target._qualified_op_name


def _row_input(state: StateTensor) -> bool:
    """A per-step input sized by the symbolic row count (token ids, slot mappings): not persistent."""
    return any(isinstance(d, torch.SymInt) for d in node_value(state.node).shape)


def _cache_like(state: StateTensor) -> bool:
    """Weights and per-step row inputs are not cache handles."""
    return state.kind is not StateKind.PARAMETER and not _row_input(state)


def _handle_record(node: torch.fx.Node, op: str, handle: Handle, declared: list[str],
                   bound: dict[str, object]) -> StateWrite:
    source = source_location(node)
    writes = f"declares writes only to {', '.join(declared)}" if declared else "declares no mutation"
    return StateWrite(
        node=node, op=op, state=handle.name, state_node=None, arg=handle.arg, source=source,
        reason=Uncovered.UNDECLARED_CACHE_HANDLE, state_kind=StateKind.HANDLE, bound_args=bound,
        detail=(f"{op} at {source} {writes} and takes the cache handle {handle.arg}="
                f"{handle.name!r}: the state it reaches through that handle is not in the graph, so "
                f"what it writes there cannot be seen; a context-addressed pattern must cover it "
                f"(or declare that it only reads), or run `pcppass audit --dynamic`"),
    )


def _handle_records(
    node: torch.fx.Node, defuse: DefUse, aliases: AliasMap, names: dict[torch.fx.Node, StateTensor]
) -> list[StateWrite]:
    """Records for a custom op that may write state the graph cannot see.

    Every handle the op takes is one record, whatever the op returns or declares. An op that
    declares no write, takes no handle and returns only a dependency token is reported through each
    cache-like state tensor it takes, or, taking none, as a call that exists only for a side effect.
    """
    overload = _custom_op(node)
    if overload is None:
        return []
    op = overload._schema.name
    bound = bind_schema(overload._schema, node.args, node.kwargs) or {}
    declared = written_args(overload._schema)
    handles = call_handles(overload._schema, bound, pattern_options(pattern_for_op(op)))
    records = [_handle_record(node, op, h, declared, bound) for h in handles]
    if records or declared or not _only_a_dependency_token(node, defuse):
        return records
    for arg, value in bound.items():
        for label, tensor in _tensor_nodes(value, arg):
            alias = aliases.alias_of(tensor)
            if alias is None or not _cache_like(names[alias.base]):
                continue
            state = names[alias.base]
            records.append(StateWrite(
                node=node, op=op, state=state.name, state_node=alias.base,
                arg=label, view_chain=list(alias.chain), source=source_location(node),
                reason=Uncovered.UNDECLARED_CACHE_HANDLE, written_node=tensor,
                view=view_info(alias, tensor), state_kind=state.kind, bound_args=bound,
                detail=(f"{op} declares no mutation and its result is only a "
                        f"dependency token, yet it takes the state tensor {state.name} as {label}"),
            ))
    if not records:
        source = source_location(node)
        records.append(StateWrite(
            node=node, op=op, state="<unknown>", state_node=None, arg=None, source=source,
            reason=Uncovered.SIDE_EFFECT_ONLY, state_kind=StateKind.UNKNOWN, bound_args=bound,
            detail=(f"{op} at {source} declares no mutation and its result carries no data (unused, "
                    f"empty, or only a dependency of other opaque ops): it runs for a side effect "
                    f"the graph cannot see, possibly a write into state"),
        ))
    return records


# ----------------------------------------------------------------------------- opaque calls


def _labelled_inputs(node: torch.fx.Node) -> list[tuple[str, object]]:
    """A call's arguments flattened through lists, tuples and dicts, each with a label."""
    out: list[tuple[str, object]] = []

    def walk(label: str, value: object) -> None:
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{label}[{i}]", v)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{label}[{k!r}]", v)
        else:
            out.append((label, value))

    for i, arg in enumerate(node.args):
        walk(f"arg{i}", arg)
    for key, arg in node.kwargs.items():
        walk(key, arg)
    return out


def _receives_state(node: torch.fx.Node, aliases: AliasMap) -> bool:
    """Whether any input is state (or a view of it), or a graph input that may be a handle."""
    return any(
        a.op in ("placeholder", "get_attr") or aliases.alias_of(a) is not None for a in node.all_input_nodes
    )


def _opaque_detail(call: OpaqueCall, what: str, label: str, source: str) -> str:
    return (f"{call.op} ({call.kind}) at {source} receives {what} as {label}; the graph cannot see "
            f"what it does with it, so it may write it: make the write visible (a custom op that "
            f"declares it in mutates_args, or in-place tensor ops traced into the graph)")


def _opaque_records(
    node: torch.fx.Node, call: OpaqueCall, aliases: AliasMap, names: dict[torch.fx.Node, StateTensor]
) -> list[StateWrite]:
    """One uncovered record per state alias and per cache handle an opaque call receives."""
    source = source_location(node)
    inputs = _labelled_inputs(node)
    records = []
    for label, value in inputs:
        alias = aliases.alias_of(value)
        if alias is None or _row_input(names[alias.base]):
            continue
        state = names[alias.base]
        records.append(StateWrite(
            node=node, op=call.op, state=state.name, state_node=alias.base, arg=label,
            view_chain=list(alias.chain), source=source, written_node=value,
            view=view_info(alias, value), state_kind=state.kind, reason=Uncovered.OPAQUE_CALL,
            detail=_opaque_detail(call, f"the state {state.name}", label, source),
        ))
    for handle in value_handles(inputs):
        records.append(StateWrite(
            node=node, op=call.op, state=handle.name, state_node=None, arg=handle.arg, source=source,
            state_kind=StateKind.HANDLE, reason=Uncovered.OPAQUE_CALL,
            detail=_opaque_detail(call, f"the cache handle {handle.name!r}", handle.arg, source),
        ))
    return records


# ----------------------------------------------------------------------------- higher-order op regions


@dataclass
class _Reach:
    """How a tensor inside a region reaches persistent state: the state, and the tensor of the
    top-level graph the outermost higher-order op receives for it (None while still top-level)."""

    state: StateTensor
    outer: torch.fx.Node | None = None


def _flat_nodes(value: object) -> list[torch.fx.Node]:
    if isinstance(value, torch.fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _flat_nodes(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _flat_nodes(v)]
    return []


def _is_higher_order(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def _region_bodies(node: torch.fx.Node) -> list[tuple[torch.fx.Node, torch.fx.GraphModule]]:
    """The subgraphs (``get_attr`` graph modules) a higher-order op node runs."""
    owner = node.graph.owning_module
    bodies = []
    for arg in _flat_nodes((node.args, dict(node.kwargs))):
        if arg.op != "get_attr" or owner is None:
            continue
        try:
            body = owner.get_submodule(str(arg.target))
        except AttributeError:
            continue
        if isinstance(body, torch.fx.GraphModule):
            bodies.append((arg, body))
    return bodies


def _region_operands(node: torch.fx.Node, body_args: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """What a body's placeholders receive, in order: the op's arguments after its last body.

    True of ``wrap``, ``tag_activation_checkpoint``, ``invoke_subgraph``, ``cond``,
    ``while_loop``, ``map_impl``, ``scan``...; where the counts do not match (``flex_attention``),
    placeholders are matched to state by storage instead.
    """
    flat = _flat_nodes(node.args)
    last = max((i for i, n in enumerate(flat) if n in body_args), default=-1)
    return [n for n in flat[last + 1:] if n not in body_args]


def _region_writes(
    hop: torch.fx.Node,
    aliases: AliasMap,
    reach: dict[torch.fx.Node, _Reach],
    top_hop: torch.fx.Node,
    top_aliases: AliasMap,
    path: tuple[str, ...],
) -> list[StateWrite]:
    """Writes into persistent state inside the bodies of the higher-order op node ``hop``.

    ``aliases`` and ``reach`` describe the graph holding ``hop`` (its state bases and how each
    reaches a top-level state tensor). Body placeholders are mapped to the op's operands; a write
    through one that aliases state is reported against the top-level op node ``top_hop``, as a
    write the rewrite cannot cover: sync cannot be placed inside a region body.
    """
    bodies = _region_bodies(hop)
    operands = _region_operands(hop, {arg for arg, _ in bodies})
    records: list[StateWrite] = []
    for _, body in bodies:
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        positional = len(operands) == len(placeholders)
        inner: dict[torch.fx.Node, _Reach] = {}
        for i, placeholder in enumerate(placeholders):
            operand = operands[i] if positional else None
            alias = aliases.alias_of(operand)
            base = alias.base if alias is not None else aliases.base_of_value(node_value(placeholder))
            if base is None:
                continue
            outer = reach[base].outer or (operand if alias is not None else base)
            inner[placeholder] = _Reach(reach[base].state, outer)
        if not inner:
            continue
        body_aliases = AliasMap(DefUse(body.graph), list(inner))
        for node in body.graph.nodes:
            for site in write_sites(node):
                alias = body_aliases.alias_of(site.tensor)
                if alias is not None:
                    records.append(_region_record(top_hop, top_aliases, path, node, site, inner[alias.base]))
            if _is_higher_order(node):
                records += _region_writes(node, body_aliases, inner, top_hop, top_aliases,
                                          path + (_hop_name(node),))
    return records


def _hop_name(node: torch.fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _region_record(
    top_hop: torch.fx.Node, top_aliases: AliasMap, path: tuple[str, ...], node: torch.fx.Node,
    site: WriteSite, reach: _Reach,
) -> StateWrite:
    state = reach.state
    written = reach.outer if reach.outer is not None else state.node
    alias = top_aliases.alias_of(written)
    source = source_location(node)
    region = " > ".join(path)
    return StateWrite(
        node=top_hop, op=site.op, state=state.name, state_node=state.node, arg=site.arg,
        view_chain=list(alias.chain) if alias is not None else [state.node], source=source,
        written_node=written, view=view_info(alias, written) if alias is not None else None,
        state_kind=state.kind, family=site.family, reason=Uncovered.WRITE_IN_HIGHER_ORDER_OP,
        detail=(f"{site.op} writes {state.name} through {site.arg} at {source}, inside the body "
                f"of higher-order op {region} (node {top_hop.name}); replica sync cannot be "
                f"placed inside a region body: move the write out of the region"),
    )


# ----------------------------------------------------------------------------- entry point


def _unknown_storage_record(site: WriteSite) -> StateWrite:
    """A write into a tensor whose storage cannot be read: it may be state, so it is reported."""
    value = node_value(site.tensor)
    source = source_location(site.node)
    return StateWrite(
        node=site.node, op=site.op, state=f"<unknown storage of {site.tensor.name}>", state_node=None,
        arg=site.arg, source=source, written_node=site.tensor, family=site.family,
        bound_args=site.bound_args, reason=Uncovered.UNKNOWN_STORAGE,
        detail=(f"{site.op} at {source} writes {site.tensor.name} ({type(value).__qualname__}, layout "
                f"{getattr(value, 'layout', '?')}), whose storage cannot be read: the analysis cannot "
                f"tell whether it is persistent state, so it is not taken for a temporary"),
    )


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
    reach = {s.node: _Reach(s) for s in states}
    records: list[StateWrite] = []
    for node in gm.graph.nodes:
        sites = write_sites(node)
        for site in sites:
            alias = aliases.alias_of(site.tensor)
            if alias is None:
                if storage_keys(node_value(site.tensor)) == frozenset():
                    records.append(_unknown_storage_record(site))
                continue  # a temporary created inside the graph
            state = names[alias.base]
            records.append(StateWrite(
                node=node, op=site.op, state=state.name, state_node=alias.base, arg=site.arg,
                view_chain=list(alias.chain), source=source_location(node),
                written_node=site.tensor, view=view_info(alias, site.tensor),
                state_kind=state.kind, family=site.family, bound_args=site.bound_args,
            ))
        has_body = False
        if _is_higher_order(node):
            has_body = bool(_region_bodies(node))
            records += _region_writes(node, aliases, reach, node, aliases, (_hop_name(node),))
        else:
            records += _handle_records(node, defuse, aliases, names)
        call = None if sites or not _receives_state(node, aliases) else opaque_call(node, has_body)
        if call is not None:
            records += _opaque_records(node, call, aliases, names)
    if classify:
        from pcppass.analysis.classify import classify_writes

        classify_writes(records)
    return records
