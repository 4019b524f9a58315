"""Views and aliases of persistent state: which tensor in the graph is (part of) which state.

Aliasing is decided by storage identity of the fake values Dynamo attaches to every node
(``meta["example_value"]``; ``meta["val"]`` on AOT graphs): a node aliases a state tensor exactly
when its value shares that placeholder's storage. This is the ground truth: it sees through
``reshape``/``flatten``/``contiguous`` (views only when the input allows), and it never mistakes
an advanced-indexing ``getitem`` (a copy) for a view.

Storage identity is a :class:`~torch.multiprocessing.reductions.StorageWeakRef` (the key torch's
own re-inplacing pass uses), never the ``id`` of a Python storage object. A tensor subclass that
wraps other tensors (``__tensor_flatten__``: fp8 wrappers, DTensor, ``TwoTensor``) is identified by
the storages of its inner tensors, since its own wrapper storage is not shared by its views. A tensor
whose storage cannot be read at all is never taken for a temporary: it aliases whatever state it is
computed from (fail closed).

The chain of nodes from the base placeholder to an alias is then recovered structurally through
the def-use graph and checked against the table of known view ops below. A chain through an op
that is not a known view (the alias is real but we do not know how the op maps elements) or a view
that overlaps itself (``expand``: several written elements are one state element) is not
invertible.

Shapes may be symbolic (dynamic row count): sizes, strides and offsets are kept as ``SymInt``
and compared with ``statically_known_true``; nothing here specialises a dynamic size.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from pcppass.analysis.defuse import DefUse
from pcppass.analysis.records import ViewInfo

#: Tensor methods / torch functions / aten ops whose result may be a view of their first input.
VIEW_OPS: frozenset[str] = frozenset({
    "view", "view_as", "reshape", "reshape_as", "_reshape_alias", "_unsafe_view",
    "select", "narrow", "slice", "getitem", "unsqueeze", "squeeze", "transpose", "t", "T", "mT",
    "permute", "flatten", "unflatten", "as_strided", "expand", "expand_as", "unbind", "split",
    "split_with_sizes", "chunk", "tensor_split", "movedim", "moveaxis", "swapaxes", "swapdims",
    "diagonal", "unfold", "detach", "alias", "view_as_real", "view_as_complex", "real", "imag",
    "contiguous", "squeeze_", "unsqueeze_", "transpose_", "t_",
    "_get_data_attr",  # ``tensor.data``: the same storage, sizes and strides
})

#: Ops among VIEW_OPS that may map several view elements onto one state element (or the reverse).
OVERLAPPING_VIEW_OPS: frozenset[str] = frozenset({"expand", "expand_as", "as_strided", "unfold"})


def node_value(node: object) -> object:
    """The fake value of an FX node (Dynamo ``example_value`` or AOT ``val``); None if absent."""
    if not isinstance(node, torch.fx.Node):
        return None
    meta = node.meta
    if "example_value" in meta:
        return meta["example_value"]
    return meta.get("val")


def fake_value(value: object) -> object:
    """``value`` with every FX node replaced by its fake value, through lists, tuples and dicts."""
    if isinstance(value, torch.fx.Node):
        return node_value(value)
    if isinstance(value, (list, tuple)):
        return type(value)(fake_value(v) for v in value)
    if isinstance(value, dict):
        return {k: fake_value(v) for k, v in value.items()}
    return value


def op_name(node: torch.fx.Node) -> str:
    """A short spelling of what a node does: method name, function ``__name__`` or aten op name."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if node.op != "call_function":
        return node.op
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


#: :func:`storage_keys` of a tensor whose storage cannot be read (sparse, opaque backends).
UNKNOWN_STORAGE: frozenset = frozenset()


def storage_keys(value: object) -> frozenset | None:
    """The storages a tensor's bytes live in; None for a non-tensor.

    A plain (or fake) tensor has one; a wrapper subclass the union of its inner tensors';
    :data:`UNKNOWN_STORAGE` (empty) when none can be read.
    """
    if not isinstance(value, torch.Tensor):
        return None
    if is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        inner = [storage_keys(getattr(value, name)) for name in names]
        return frozenset().union(*(k for k in inner if k))
    try:
        return frozenset({StorageWeakRef(value.untyped_storage())})
    except (RuntimeError, NotImplementedError, TypeError):  # sparse / opaque tensors have no storage
        return UNKNOWN_STORAGE


def is_plain_tensor(value: object) -> bool:
    """A tensor whose bytes are its own storage (not a wrapper of other tensors)."""
    return isinstance(value, torch.Tensor) and not is_traceable_wrapper_subclass(value) and (
        type(value) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) or isinstance(value, FakeTensor)
    )


def _tensor_values(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


@dataclass
class Alias:
    """``node`` is (a view of) the state placeholder ``base``; ``chain`` = base ... node."""

    base: torch.fx.Node
    chain: list[torch.fx.Node]


class AliasMap:
    """For every node of ``graph``: the state placeholder it aliases, if any, and the chain to it.

    ``state_nodes`` are the persistent-state placeholders (and ``get_attr`` tensors). Nodes are
    visited in graph order over the def-use graph, so a chain is found in one pass: an aliasing
    node's predecessor is the first of its inputs aliasing the same base. A node whose storage
    cannot be read aliases the state of its first input that aliases one.
    """

    def __init__(self, defuse: DefUse, state_nodes: list[torch.fx.Node]):
        self._by_storage: dict[StorageWeakRef, torch.fx.Node] = {}
        self._alias: dict[torch.fx.Node, Alias] = {}
        for s in state_nodes:
            for key in storage_keys(node_value(s)) or ():
                self._by_storage.setdefault(key, s)
            self._alias[s] = Alias(s, [s])
        for node in defuse.nodes():
            if node in self._alias or node.op not in ("call_function", "call_method"):
                continue
            if not any(a in self._alias for a in node.all_input_nodes):
                continue  # an alias of state is always computed from one: a fresh tensor
            bases = self._bases_of(node, defuse)
            if len(bases) != 1:
                continue  # fresh tensor (a temporary), or a tuple over several states
            base = bases.pop()
            parent = next(
                (a for a in defuse.inputs(node) if a in self._alias and self._alias[a].base is base),
                None,
            )
            chain = (self._alias[parent].chain if parent is not None else [base]) + [node]
            self._alias[node] = Alias(base, chain)

    def _bases_of(self, node: torch.fx.Node, defuse: DefUse) -> set[torch.fx.Node]:
        bases: set[torch.fx.Node] = set()
        for value in _tensor_values(node_value(node)):
            keys = storage_keys(value)
            if not keys:  # storage unknown: never a temporary
                inputs = [self._alias[a].base for a in defuse.inputs(node) if a in self._alias]
                bases.update(inputs[:1])
            else:
                bases.update(self._by_storage[k] for k in keys if k in self._by_storage)
        return bases

    def alias_of(self, node: object) -> Alias | None:
        if not isinstance(node, torch.fx.Node):
            return None
        return self._alias.get(node)

    def base_of_value(self, value: object) -> torch.fx.Node | None:
        """The state placeholder whose storage the fake tensor ``value`` shares, if any."""
        for key in storage_keys(value) or ():
            if key in self._by_storage:
                return self._by_storage[key]
        return None


#: In-place Python operators (``x += y`` -> ``operator.iadd``) and their dunders: they return ``x``.
INPLACE_OPERATOR_NAMES = frozenset(
    name
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift",
               "rshift", "matmul")
    for name in (f"i{op}", f"__i{op}__")
)


def _same_tensor_step(node: torch.fx.Node) -> bool:
    """In-place ops return their (mutated) first argument: not a view step, the same tensor."""
    name = op_name(node)
    if name in INPLACE_OPERATOR_NAMES:
        return True
    return name.endswith("_") and not name.startswith("__") and name not in VIEW_OPS


def view_info(alias: Alias, written: torch.fx.Node) -> ViewInfo | None:
    """Size/stride/offset of ``written`` inside ``alias.base`` and whether the chain is invertible."""
    base_value = node_value(alias.base)
    value = node_value(written)
    if isinstance(value, (tuple, list)) or value is None:
        return None
    ops: list[str] = []
    why_not = ""
    for step in alias.chain[1:]:
        name = op_name(step)
        if _same_tensor_step(step):
            continue
        ops.append(name)
        if name not in VIEW_OPS and not why_not:
            why_not = f"{name} aliases the state but is not a known view op"
    offset = value.storage_offset() - base_value.storage_offset()
    if not why_not:
        for size, stride in zip(value.shape, value.stride()):
            if statically_known_true(stride == 0) and not statically_known_true(size <= 1):
                why_not = "the view repeats state elements (zero stride)"
                break
    if not why_not and any(o in OVERLAPPING_VIEW_OPS for o in ops):
        if not _non_overlapping_dense(value):
            why_not = f"{'/'.join(o for o in ops if o in OVERLAPPING_VIEW_OPS)} overlaps state elements"
    return ViewInfo(
        size=tuple(value.shape),
        stride=tuple(value.stride()),
        storage_offset=offset,
        ops=tuple(ops),
        invertible=not why_not,
        why_not=why_not,
    )


def _non_overlapping_dense(value: torch.Tensor) -> bool:
    """Every element at its own address: strides sorted descending each cover the inner extent."""
    dims = sorted(
        ((s, st) for s, st in zip(value.shape, value.stride()) if not statically_known_true(s == 1)),
        key=lambda p: p[1] if isinstance(p[1], int) else 0,
    )
    extent = 1
    for size, stride in dims:
        if not statically_known_true(stride >= extent):
            return False
        extent = stride * size
    return True


def is_base_flattened_paged(base_value: torch.Tensor, view: ViewInfo) -> bool:
    """``view`` is ``base[num_blocks, block_size, *row]`` with its first two dims merged.

    Then row ``i`` of the view is slot ``i`` of the paged base: a single-index write on dim 0 of
    the view is a paged-row write.
    """
    if base_value.dim() < 3 or len(view.size) != base_value.dim() - 1 or not view.invertible:
        return False
    nb, bs = base_value.shape[0], base_value.shape[1]
    s0, s1 = base_value.stride(0), base_value.stride(1)
    return (
        statically_known_true(view.storage_offset == 0)
        and statically_known_true(view.size[0] == nb * bs)
        and statically_known_true(view.stride[0] == s1)
        and statically_known_true(s0 == s1 * bs)
        and all(
            statically_known_true(a == b)
            for a, b in zip(view.size[1:], base_value.shape[2:])
        )
        and all(
            statically_known_true(a == b)
            for a, b in zip(view.stride[1:], base_value.stride()[2:])
        )
    )
