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
from pcppass.sync.stats import SYNC_COUNTERS
from pcppass.rewrite.plan import ContextRef, SyncPlan



def _fake(node: torch.fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _expr(size: Any) -> Any:
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return int(size)


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


class _Symbols:
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

    def __init__(self, checks: list[SlotInputCheck], symbols: _Symbols, rank: int | None = None,
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
        return cls(list(checks.values()), _Symbols(placeholders), rank, _handle_checks(plan, index))

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
            return _expr(fake.shape[dim])
    return None


def num_slots_expr(cache: torch.Tensor, layout) -> Any:
    if layout.kind == "paged_rows":
        return _expr(cache.shape[0]) * _expr(cache.shape[1])
    if layout.kind == "block_split":
        return _expr(cache.shape[0]) * layout.block_size
    return _expr(cache.shape[layout.dim])


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


# ---------------------------------------------------------------------------------------------
# Slot mappings checked inside the graph, agreed on by every rank before any write
# ---------------------------------------------------------------------------------------------
#
# A computed slot mapping exists only on its rank, and only once the graph has run up to it; which
# rows two ranks both write (two owners of one slot, overlapping views of one buffer) shows only in
# every rank's slots together. The rewrite (:mod:`pcppass.rewrite.slot_checks`) emits, before the
# step's first write:
#
#     record   = pcppass::slot_check_record(slots, limits, rows, aten, send)        # this rank
#     gathered = wait_tensor(all_gather_into_tensor(record, world, group))          # every rank
#     checked  = pcppass::slot_check_verdict(gathered, slots, labels, aten, caches, layouts, sites)
#
# and the writes take ``checked`` (the same values) as their slots, so they run after the verdict.
# Every rank sees every rank's record: all raise the same error, or none does.

#: record columns: problem code, the offending value, the bound it broke
_OK, _LENGTH, _RANGE = 0, 1, 2


@torch.library.custom_op("pcppass::slot_check_record", mutates_args=())
def slot_check_record(slots: list[torch.Tensor], limits: list[int], rows: list[int],
                      aten: list[bool], send: bool = False) -> torch.Tensor:
    """``[n * 3]`` int64: for each slot mapping, (problem, value, bound) on this rank, followed,
    with ``send``, by every mapping's slots as int64. ``limits``: slots of the cache it addresses
    (-1: unchecked); ``rows``: rows of its op (-1: unknown); ``aten``: an aten index write, where
    negative slots are refused too."""
    out = torch.zeros(len(slots), 3, dtype=torch.int64)
    for i, (s, limit, expected, is_aten) in enumerate(zip(slots, limits, rows, aten)):
        s = s.reshape(-1)
        if expected >= 0 and s.numel() != expected:
            out[i] = torch.tensor([_LENGTH, s.numel(), expected])
            continue
        if limit < 0:
            continue
        bad = s[(s < (0 if is_aten else -1)) | (s >= limit)]
        if bad.numel():
            out[i] = torch.tensor([_RANGE, int(bad[0]), limit])
    sent = [s.reshape(-1).to(torch.int64).cpu() for s in slots] if send else []
    return torch.cat([out.reshape(-1), *sent]).to(slots[0].device)


@slot_check_record.register_fake
def _slot_check_record_fake(slots, limits, rows, aten, send=False):
    size = 3 * len(slots)
    if send:
        for s in slots:
            size = size + s.numel()
    return slots[0].new_empty((size,), dtype=torch.int64)


def _range_problem(rank: int, label: str, code: int, value: int, bound: int, is_aten: bool) -> str:
    what = (f"has {value} slots for {bound} rows" if code == _LENGTH
            else f"holds slot {value}, outside [{0 if is_aten else -1}, {bound}) of the cache")
    aten_note = (" (an aten index write takes -1 as the LAST row: mask padding rows in the model or "
                 "write through an op that skips slot -1)" if code == _RANGE and is_aten and value < 0 else "")
    return f"rank {rank}: {label}: the slot mapping computed in the graph {what}{aten_note}"


_UNCHANGED = ("Checked on every rank before the step wrote any state: every rank refuses this step and "
              "every replica is unchanged.")


@torch.library.custom_op("pcppass::slot_check_verdict", mutates_args=())
def slot_check_verdict(gathered: torch.Tensor, slots: list[torch.Tensor], labels: str,
                       aten: list[bool], caches: list[torch.Tensor], layouts: list[int],
                       sites: str) -> list[torch.Tensor]:
    """Raise on every rank if any rank's record shows a problem; else ``slots`` (copies). With
    ``caches`` (one per slot mapping, rows addressed through the i-th of ``layouts``, written by
    the site on line i of ``sites``), the records carry every rank's slots, and a row (or bytes
    of one buffer) two ranks would write is refused too (:mod:`pcppass.sync.owners`)."""
    from pcppass.errors import PcpSyncError
    from pcppass.sync.owners import Written, find_problems
    from pcppass.sync.rows import decode_layouts

    n = len(slots)
    world = gathered.numel() // (3 * n + (sum(s.numel() for s in slots) if caches else 0))
    per_rank = gathered.cpu().view(world, -1)
    SYNC_COUNTERS.record(per_rank.shape[1] * 8, world)  # a collective of the step, like its syncs
    names = labels.split("\n")
    for rank in range(world):
        for i, (code, value, bound) in enumerate(per_rank[rank, :3 * n].view(n, 3).tolist()):
            if code != _OK:
                raise PcpInputError(f"{_range_problem(rank, names[i], code, value, bound, aten[i])}. {_UNCHANGED}")
    if caches:
        sizes = [s.numel() for s in slots]
        every_rank = [torch.split(per_rank[r, 3 * n:], sizes) for r in range(world)]
        written = [Written(cache, layout, label, [every_rank[r][i] for r in range(world)])
                   for i, (cache, layout, label) in enumerate(zip(caches, decode_layouts(layouts), sites.split("\n")))]
        problems = find_problems(written)
        if problems:
            raise PcpSyncError(f"pcppass: {'; '.join(problems)}; every row must have exactly one owner per step. "
                               f"{_UNCHANGED}")
    return [s.clone() for s in slots]


@slot_check_verdict.register_fake
def _slot_check_verdict_fake(gathered, slots, labels, aten, caches, layouts, sites):
    return [torch.empty_like(s) for s in slots]
