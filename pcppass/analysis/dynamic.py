"""Dynamic audit: run real steps and find state changes no write in the graph explains.

A graph-only analysis cannot see a write made by an op that fetches its cache from a global context
(vLLM's ``unified_kv_cache_update``), by eager code around the compiled region, or across a graph
break. Here every state tensor (tensors reachable from the step's arguments, except the row inputs,
and the model's buffers) is snapshotted byte for byte before each step, the step runs compiled with
a backend that interprets each graph and records what every state write actually addressed (the
rows of its slot mapping or index for covered writes, the whole written view otherwise), and the
bytes that changed outside those rows are reported per state tensor, as paged slots
(``block * block_size + offset`` for ``[num_blocks, block_size, ...]`` tensors) or dim-0 rows.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from pcppass.analysis.records import StateWrite, Uncovered
from pcppass.analysis.state_writes import find_state_writes
from pcppass.analysis.trace import StepInputs


@dataclass
class UnexplainedChange:
    """Rows of one state tensor that changed in a step although no graph write addressed them."""

    state: str
    step: int
    unit: str  # "slot" (paged [nb, bs, ...]), "row" (dim 0) or "element" (0-/1-D tensors)
    rows: list[int]

    def describe(self) -> str:
        shown = ", ".join(map(str, self.rows[:16])) + (" ..." if len(self.rows) > 16 else "")
        return (f"{self.state}: {len(self.rows)} {self.unit}(s) changed in step {self.step} "
                f"without a write in the graph: {shown}")


@dataclass
class DynamicReport:
    changes: list[UnexplainedChange] = field(default_factory=list)
    writes: list[StateWrite] = field(default_factory=list)  # static records of every graph seen
    num_graphs: int = 0

    @property
    def clean(self) -> bool:
        return not self.changes

    @property
    def ok(self) -> bool:
        return self.clean

    def summary_lines(self, steps: int | None = None) -> list[str]:
        lines = [f"unexplained {c.describe()}" for c in self.changes]
        if not self.changes:
            lines.append("dynamic audit: every state change is explained")
        return lines

    def to_dict(self) -> dict:
        return {"unexplained_changes": [
            {"state": c.state, "step": c.step, "unit": c.unit, "rows": c.rows} for c in self.changes
        ]}


# ------------------------------------------------------------------------------- state discovery


def _walk(obj: object, path: str, out: dict[int, tuple[str, torch.Tensor]], depth: int, seen: set[int]) -> None:
    if isinstance(obj, torch.Tensor):
        out.setdefault(id(obj), (path, obj))
        return
    if depth > 4 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{path}[{k!r}]", out, depth + 1, seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", out, depth + 1, seen)
    elif isinstance(obj, torch.nn.Module):
        return  # modules are covered through named_buffers
    elif hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            _walk(v, f"{path}.{k}", out, depth + 1, seen)


def step_state(model: Any, inputs: StepInputs) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a step may persistently change: argument tensors except row inputs, buffers."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    seen: set[int] = set()
    try:
        target = model.forward if isinstance(model, torch.nn.Module) else model
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        names = []
    for i, a in enumerate(inputs.args):
        _walk(a, names[i] if i < len(names) else f"arg{i}", found, 0, seen)
    for k, v in inputs.kwargs.items():
        _walk(v, k, found, 0, seen)
    row_inputs = {id(t) for t, _ in inputs.dynamic}
    state = [(p, t) for key, (p, t) in found.items() if key not in row_inputs]
    if isinstance(model, torch.nn.Module):
        state += [(f"buffer {n}", b) for n, b in model.named_buffers()]
    return state


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _element_ids(t: torch.Tensor) -> torch.Tensor:
    """Storage element index (in ``t``'s dtype units) of every element of ``t``."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.arange(n, device=t.device).as_strided(t.size(), t.stride(), t.storage_offset())


# ------------------------------------------------------------------------------- recording


@dataclass
class _Observed:
    tensor: torch.Tensor  # the written tensor as the op received it
    ids: torch.Tensor  # explained element ids (tensor's dtype units)


def _explained_ids(record: StateWrite, written: torch.Tensor, env: dict) -> torch.Tensor:
    ids = _element_ids(written)
    layout = record.layout
    if not record.covered or layout is None:
        return ids.reshape(-1)  # reported statically already: the whole written view
    slots_arg = next((c.slots for c in record.pattern.caches if c.arg == record.arg), None)
    if record.family is not None:
        index = record.bound_args.get("index", record.bound_args.get("indices"))
        if isinstance(index, (list, tuple)):
            index = next(i for i in index if isinstance(i, torch.fx.Node))
        idx = env[index].reshape(-1).long()
        idx = idx[idx >= 0]
        if layout.kind == "paged_rows":
            return ids[idx].reshape(-1)
        return ids.index_select(layout.dim, idx).reshape(-1)
    slots = env[record.bound_args[slots_arg]].reshape(-1).long()
    slots = slots[slots >= 0]
    bs = layout.block_size
    if layout.kind == "paged_rows":
        return ids.flatten(0, 1)[slots].reshape(-1)
    if layout.kind == "block_split":
        per_block = ids.reshape(ids.shape[0], -1)
        parts = [
            per_block[b, base + o * stride: base + o * stride + length]
            for s in slots.tolist()
            for b, o in [divmod(s, bs)]
            for base, stride, length in layout.segments
        ]
        return torch.cat(parts) if parts else ids.new_empty(0)
    if layout.kind == "indexed_dim":
        return ids.index_select(layout.dim, slots).reshape(-1)
    return ids.reshape(-1)  # a user layout kind: trust the op for its whole view


class _RecordingBackend:
    """Interprets each graph, recording what every state write addressed at run time."""

    def __init__(self) -> None:
        self.writes: list[StateWrite] = []
        self.observed: list[_Observed] = []
        self.num_graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        records = find_state_writes(gm)
        self.writes += records
        self.num_graphs += 1
        by_node: dict[torch.fx.Node, list[StateWrite]] = {}
        for r in records:
            # an undeclared handle explains nothing: what it writes is exactly the question
            if r.written_node is not None and r.reason is not Uncovered.UNDECLARED_CACHE_HANDLE:
                by_node.setdefault(r.node, []).append(r)
        observed = self.observed

        class Recorder(torch.fx.Interpreter):
            def run_node(self, n: torch.fx.Node) -> Any:
                result = super().run_node(n)
                for r in by_node.get(n, ()):
                    written = self.env[r.written_node]
                    observed.append(_Observed(written, _explained_ids(r, written, self.env)))
                return result

        def run(*args: Any) -> Any:
            return Recorder(gm).run(*args)

        return run


# ------------------------------------------------------------------------------- audit


def _rows_of(t: torch.Tensor, element_mask: torch.Tensor) -> tuple[str, list[int]]:
    if t.dim() >= 3:
        hit = element_mask.reshape(t.shape[0], t.shape[1], -1).any(-1).nonzero().tolist()
        return "slot", [b * t.shape[1] + o for b, o in hit]
    if t.dim() == 2:
        return "row", element_mask.any(-1).nonzero().reshape(-1).tolist()
    return "element", element_mask.reshape(-1).nonzero().reshape(-1).tolist()


def dynamic_audit(model: Callable[..., Any], inputs: StepInputs, steps: int = 2) -> DynamicReport:
    """Run ``steps`` compiled steps of ``model`` on ``inputs`` and report unexplained state changes."""
    backend = _RecordingBackend()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    state = step_state(model, inputs)
    report = DynamicReport()
    try:
        for step in range(steps):
            before = [_storage_bytes(t).clone() for _, t in state]
            backend.observed.clear()
            with torch.no_grad():
                compiled(*inputs.args, **inputs.kwargs)
            for (name, t), old in zip(state, before):
                storage = _storage_bytes(t)
                changed = storage != old
                if not bool(changed.any()):
                    continue
                explained = torch.zeros_like(changed)
                storage_key = StorageWeakRef(t.untyped_storage())
                for obs in backend.observed:
                    if StorageWeakRef(obs.tensor.untyped_storage()) != storage_key:
                        continue
                    isz = obs.tensor.element_size()
                    explained.view(-1, isz)[obs.ids] = True
                unexplained = changed & ~explained
                isz = t.element_size()
                per_element = unexplained.view(-1, isz).any(-1)[_element_ids(t)]
                if bool(per_element.any()):
                    unit, rows = _rows_of(t, per_element)
                    report.changes.append(UnexplainedChange(name, step, unit, rows))
    finally:
        torch._dynamo.reset()
    report.writes = backend.writes
    report.num_graphs = backend.num_graphs
    return report
