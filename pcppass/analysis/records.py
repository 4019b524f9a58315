"""What the analysis reports about one write into persistent state.

Produced by :func:`pcppass.analysis.find_state_writes`, consumed by classification, the audit CLI
and the rewrite. One :class:`StateWrite` per (mutating node, written state tensor): a fused op that
writes two caches yields two records sharing ``node``.

Handle records (the contract context-addressed patterns build on; keep this shape stable). An op
that takes a cache handle (an opaque script object such as vLLM's ``LayerName``, or a string that
names a layer; see :mod:`pcppass.analysis.handles`) yields one record per handle argument, whatever
it returns and whatever else it declares:

* ``node``: the call; ``op``: its qualified name (``"vllm::unified_kv_cache_update"``);
* ``state_node`` None, ``written_node`` None: no tensor of the graph holds that state;
* ``state``: the handle's value (``"model.layers.0.self_attn.attn"``);
* ``arg``: the handle's schema argument name (``"layer_name"``);
* ``state_kind``: :attr:`StateKind.HANDLE`; ``bound_args``: every argument by schema name (the
  handle as the graph holds it: a placeholder node or a constant);
* ``reason``: :attr:`Uncovered.UNDECLARED_CACHE_HANDLE` until a pattern classifies it.

Other records with ``state_node`` None: a token-only op that takes no handle and no state
(:attr:`Uncovered.SIDE_EFFECT_ONLY`, ``state`` "<unknown>"), and a write into a tensor whose storage
cannot be read (:attr:`Uncovered.UNKNOWN_STORAGE`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch.fx

from pcppass.spec import Recipe, ResolvedLayout, WritePattern


class Uncovered(str, enum.Enum):
    """Why a write into persistent state cannot be decode-sharded safely."""

    UNKNOWN_MUTATING_OP = "unknown mutating op"
    UNKNOWN_LAYOUT = "unknown layout"
    NON_ROW_STATE = "non-row state"
    NON_INVERTIBLE_VIEW = "view the rewrite cannot invert"
    UNDECLARED_CACHE_HANDLE = "op declares no mutation but takes a cache-like handle"
    SIDE_EFFECT_ONLY = "op declares no mutation and runs only for a side effect"
    OPAQUE_CALL = "opaque call receives state"
    USER_TRITON_KERNEL = "user Triton kernel writes state"
    WRITE_IN_HIGHER_ORDER_OP = "write inside a higher-order op region"
    ROW_BYTES_MISMATCH = "layout bytes per row differ from the bytes the op writes per row"
    SLOT_DTYPE = "slot mapping is not an integer tensor"
    TENSOR_SUBCLASS_STATE = "state is a tensor subclass"
    UNKNOWN_STORAGE = "written tensor's storage is unknown"
    STALE_REVIEW = "declaration reviewed for another release"
    UNDECIDED_HANDLE = "the engine cannot say what the op does through the handle"
    REFUSED_OP = "op refused by name"


class StateKind(str, enum.Enum):
    """Where a persistent state tensor comes from (``grapharg.source`` of its placeholder)."""

    BUFFER = "buffer"
    PARAMETER = "parameter"
    INPUT = "input"  # a forward argument (e.g. the ``caches`` dict of the model contract)
    GLOBAL = "global"  # a module-level tensor the traced code reads
    ATTRIBUTE = "attribute"  # a get_attr constant of the graph module
    UNKNOWN = "unknown"  # a placeholder without source information (AOT / make_fx graphs)
    HANDLE = "handle"  # state addressed through a cache handle argument (a layer name)


@dataclass(frozen=True)
class ViewInfo:
    """How the written tensor sits in its base state tensor (element units, symbolic allowed).

    ``invertible`` is False when the chain holds an op that is not a known view (the alias was found
    only through storage identity) or when the view overlaps itself (``expand``, zero strides), so
    one written element is not one state element.
    """

    size: tuple
    stride: tuple
    storage_offset: object
    ops: tuple[str, ...]  # view ops from base to written tensor, e.g. ("select", "view")
    invertible: bool = True
    why_not: str = ""


@dataclass
class StateWrite:
    node: torch.fx.Node  # the node that performs the write
    op: str  # qualified op name or aten method/function spelling ("aten::index_copy_")
    state: str  # the base state tensor's source name, e.g. "L['caches']['layers.0.kv']"
    state_node: torch.fx.Node | None  # the base placeholder (None: an undeclared handle)
    arg: str | None  # schema argument (or role) through which the write happens
    view_chain: list[torch.fx.Node] = field(default_factory=list)  # base -> written tensor
    source: str = "<unknown>"  # "file.py:123" from node.meta["stack_trace"]
    pattern: WritePattern | None = None
    layout: ResolvedLayout | None = None
    reason: Uncovered | None = None
    detail: str = ""  # human-readable explanation (always set when uncovered)
    #: the tensor node the op receives as ``arg`` (last of ``view_chain``, or ``state_node``)
    written_node: torch.fx.Node | None = None
    view: ViewInfo | None = None
    state_kind: StateKind = StateKind.UNKNOWN
    #: aten family of an in-place spelling ("index_copy_", "setitem", ...); None for schema ops
    family: str | None = None
    #: the call's arguments by schema name (nodes or constants): slot mappings, row inputs, dims
    bound_args: dict[str, object] = field(default_factory=dict)
    #: bytes per cache row the op writes, from the written value's shape and dtype (an int, or the
    #: symbolic expression); None where the value is not known (no declared values, a scalar fill)
    written_bytes_per_row: object = None
    #: what the sync does for this record once covered: the pattern's recipe, or READ_ONLY where the
    #: engine says the op only reads through this handle (:class:`~pcppass.registry.HandleEffect`),
    #: or the alternative classification chose (:mod:`pcppass.analysis.recipes`)
    recipe: Recipe | None = None
    #: where the pattern lists alternative recipes: the bytes per row each would move, by recipe
    #: value (``{"copy_rows": 10112, "rerun": 1168}``; a recipe that cannot run here is absent)
    recipe_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def covered(self) -> bool:
        return self.pattern is not None and self.reason is None

    @property
    def bytes_per_row(self) -> int | None:
        return self.layout.bytes_per_row if self.layout is not None else None

    def describe(self) -> str:
        where = f"{self.state}" + (f" via {self.arg}" if self.arg else "")
        status = (
            f"covered by {self.pattern.name} ({self.recipe.value if self.recipe else '?'})"
            if self.covered
            else f"UNCOVERED: {self.reason.value if self.reason else 'unclassified'}: {self.detail}"
        )
        return f"{self.op} writes {where} at {self.source}: {status}"
