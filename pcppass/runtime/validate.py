"""Run-time input validation of a rewritten step graph, before it touches any state.

Slot mappings that arrive as graph inputs are checked on every call: integers (int64, int32, any
width), one slot per row of the op that consumes them, every slot in ``[-1, num_slots)`` of the
cache it addresses. A bad mapping raises :class:`~pcppass.errors.PcpInputError` naming the rank,
the op, the cache and the source line; the graph has not run, so every cache is untouched.

Slot -1 means "skip this row" only for ops that implement it (every ``pcppass::`` cache write, as
vLLM's kernels). An aten in-place write (``cache.view(-1, ...)[slots] = x``, ``index_put_``,
``index_copy_``) follows Python indexing: -1 is the LAST row. The engine pads with -1 and the
replica sync skips -1 rows, so each rank would write its padding into the last row and no sync
would reconcile it: for those sites any negative slot is refused.

Row counts and cache sizes may be symbolic (dynamic shapes); they are evaluated per call from the
graph's inputs (SymInt inputs, or the input tensor dims the symbols were taken from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx

from pcppass.errors import PcpInputError
from pcppass.sync.device_checks import is_slot_tensor
from pcppass.rewrite.plan import ContextRef, SyncPlan, num_slots_expr, size_expr



def _fake(node: torch.fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


@dataclass(frozen=True)
class SlotInputCheck:
    input_index: int
    input_name: str
    op: str
    state: str
    source: str
    rows: Any  # int, sympy expression, or None (no row argument to compare with)
    num_slots: Any  # int or sympy expression
    #: aten in-place family of the write (Python indexing: -1 is the last row); None: -1 skips
    aten_family: str | None = None

    @property
    def lowest_slot(self) -> int:
        return 0 if self.aten_family else -1


class GraphSymbols:
    """Where each size symbol of the graph can be read from the call's arguments."""

    def __init__(self, placeholders: Sequence[torch.fx.Node]):
        self.sources: dict[sympy.Symbol, tuple[int, int | None]] = {}
        for i, node in enumerate(placeholders):
            value = _fake(node)
            if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
                self.sources[value.node.expr] = (i, None)
        for i, node in enumerate(placeholders):
            value = _fake(node)
            if isinstance(value, torch.Tensor):
                for d, size in enumerate(value.shape):
                    if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                        self.sources.setdefault(size.node.expr, (i, d))

    def evaluate(self, expr: Any, args: Sequence[Any]) -> int | None:
        if isinstance(expr, int):
            return expr
        values = {}
        for sym in expr.free_symbols:
            if sym not in self.sources:
                return None
            i, d = self.sources[sym]
            values[sym] = int(args[i]) if d is None else int(args[i].shape[d])
        return int(expr.xreplace(values))


@dataclass(frozen=True)
class HandleInputCheck:
    """A cache handle the graph receives as an input (a hoisted opaque object such as vLLM's
    ``LayerName``): the sync fetches the caches of the value the graph was compiled for, so a call
    with another value (from a caller that skips Dynamo's guards, as vLLM does) is refused."""

    input_index: int
    input_name: str
    op: str
    source: str
    #: the compiled-for object, compared with ``==`` (a value type's guard compares the same way)
    expected: Any
    handle: str


class InputValidator:
    """Checks the slot-mapping inputs of one rewritten graph (see the module docstring), and the
    cache handles it was compiled for."""

    def __init__(self, checks: list[SlotInputCheck], symbols: GraphSymbols, rank: int | None = None,
                 handle_checks: Sequence[HandleInputCheck] = ()):
        self.checks = checks
        self.symbols = symbols
        self.rank = rank
        self.handle_checks = list(handle_checks)

    @classmethod
    def from_plan(cls, gm: torch.fx.GraphModule, plan: SyncPlan, rank: int | None = None) -> "InputValidator":
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        index = {node: i for i, node in enumerate(placeholders)}
        checks: dict[tuple[int, str], SlotInputCheck] = {}
        for site in plan.sites:
            rows = _row_count(site)
            for c in site.caches:
                if c.slots not in index:
                    continue  # computed in the graph, not an input
                check = SlotInputCheck(index[c.slots], c.slots.name, site.op, c.state, site.source,
                                       rows, num_slots_expr(_fake(c.cache), c.layout),
                                       site.pattern.aten_family)
                key = (index[c.slots], c.state)
                # one mapping feeding a skipping op and an aten write: the aten rule is stricter
                if key not in checks or (check.aten_family and not checks[key].aten_family):
                    checks[key] = check
        return cls(list(checks.values()), GraphSymbols(placeholders), rank, _handle_checks(plan, index))

    def __call__(self, args: Sequence[Any]) -> None:
        for check in self.handle_checks:
            if not check.expected == args[check.input_index]:
                rank = f"rank {self.rank}: " if self.rank is not None else ""
                raise PcpInputError(
                    f"{rank}{check.op} ({check.source}) receives the handle {check.input_name}="
                    f"{args[check.input_index]!r}, but the graph was compiled for {check.handle!r}: "
                    "its replica sync would fetch the caches of another handle")
        for check in self.checks:
            slots = args[check.input_index]
            rank = f"rank {self.rank}: " if self.rank is not None else ""
            where = (f"{rank}{check.op} writing {check.state} ({check.source}): slot mapping "
                     f"{check.input_name}")
            if not is_slot_tensor(slots):
                got = slots.dtype if isinstance(slots, torch.Tensor) else type(slots).__name__
                raise PcpInputError(f"{where} must be an integer tensor (int64, int32, ...), got {got}")
            rows = self.symbols.evaluate(check.rows, args) if check.rows is not None else None
            if rows is not None and slots.numel() != rows:
                raise PcpInputError(f"{where} has {slots.numel()} slots for {rows} rows")
            limit = self.symbols.evaluate(check.num_slots, args)
            if slots.numel() == 0 or limit is None:
                continue
            low, high = int(slots.min()), int(slots.max())
            if check.aten_family and low < 0:
                raise PcpInputError(
                    f"{where} holds slot {low}: {check.aten_family} follows Python indexing, so a "
                    f"padding row (slot -1) would write the LAST row of {check.state} with this "
                    "rank's padding data, which the replica sync (it skips slot -1) never reconciles. "
                    "Mask padding rows in the model (write only rows whose slot is >= 0) or write "
                    "through an op that skips slot -1 (e.g. pcppass::reshape_and_cache_flash)."
                )
            if low < -1 or high >= limit:
                bad = low if low < -1 else high
                raise PcpInputError(f"{where} holds slot {bad}, outside [-1, {limit}) of the cache")


def _row_count(site) -> Any:
    """Rows of the site's first non-slot per-row argument (None if it has none)."""
    slot_names = {c_role.slots for c_role in site.pattern.caches}
    for name, dim in site.pattern.row_args.items():
        value = site.arguments.get(name)
        if name in slot_names or not isinstance(value, torch.fx.Node):
            continue
        fake = _fake(value)
        if isinstance(fake, torch.Tensor) and fake.dim() > dim:
            return size_expr(fake.shape[dim])
    return None


def _handle_checks(plan: SyncPlan, index: dict[torch.fx.Node, int]) -> list[HandleInputCheck]:
    """One check per handle of a context-addressed cache that is a graph input."""
    checks: dict[int, HandleInputCheck] = {}
    for site in plan.sites:
        for c in site.caches:
            node = site.arguments.get(c.arg)
            if isinstance(c.cache, ContextRef) and node in index:
                expected = _fake(node)
                expected = getattr(expected, "real_obj", expected)  # FakeScriptObject -> object
                checks[index[node]] = HandleInputCheck(index[node], node.name, site.op, site.source,
                                                       expected, c.cache.handle)
    return list(checks.values())


def validating(compiled: Callable, validator: InputValidator) -> Callable:
    """``compiled`` (called by Dynamo with the graph inputs) preceded by ``validator``."""
    if not validator.checks and not validator.handle_checks:
        return compiled

    def run(*args: Any) -> Any:
        validator(args)
        return compiled(*args)

    return run
