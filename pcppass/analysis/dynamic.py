"""Dynamic audit: run real steps and find state changes no write in the graph explains.

A graph-only analysis cannot see a write made by an op that fetches its cache from a global context
(vLLM's ``unified_kv_cache_update``), by a custom op that under-declares ``mutates_args``, by eager
code around the compiled region, or across a graph break. Here every tensor the step could change is
snapshotted byte for byte before each step (:mod:`pcppass.analysis.live_state`: the tensors
reachable from the step's arguments and the model, and every other live tensor, such as a cache in a
module-global dict, an attribute or a closure); the step runs compiled with a backend that
interprets each graph and records what every state write actually addressed (the rows of its slot
mapping or index for covered writes, the whole written view for writes reported uncovered); and the
bytes that changed outside those rows are reported per storage, as paged slots
(``block * block_size + offset`` for ``[num_blocks, block_size, ...]`` tensors) or dim-0 rows.

The report says "verified" only when nothing escaped the watch: a tensor without a readable storage,
state beyond the snapshot budget, or a TorchBind object (its state lives in C++) makes it say that
it could not verify, never that every change is explained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
from torch._library.fake_class_registry import FakeScriptObject
from torch.multiprocessing.reductions import StorageWeakRef

from pcppass.analysis.live_state import DEFAULT_MAX_BYTES, Watched, holder_name, live_tensors, watch_list
from pcppass.analysis.records import StateWrite, Uncovered
from pcppass.analysis.state_writes import find_state_writes
from pcppass.analysis.trace import StepInputs
from pcppass.analysis.views import is_plain_tensor, node_value, storage_keys

#: Records whose write explains nothing: what such a call writes is exactly the question.
_UNEXPLAINING = frozenset({Uncovered.UNDECLARED_CACHE_HANDLE, Uncovered.OPAQUE_CALL})


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
    steps: int = 0
    watched: int = 0  # storages snapshotted in the last step
    watched_bytes: int = 0
    unreachable: int = 0  # of them, not reachable from the step's arguments or the model
    #: what could not be watched; non-empty means "could not verify"
    blind_spots: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.changes

    @property
    def verified(self) -> bool:
        return not self.blind_spots

    @property
    def ok(self) -> bool:
        return self.clean and self.verified

    def summary_lines(self) -> list[str]:
        lines = [f"unexplained {c.describe()}" for c in self.changes]
        if self.blind_spots:
            lines.append("dynamic audit could NOT verify every state change: "
                         + "; ".join(self.blind_spots))
        elif not self.changes:
            lines.append(
                f"dynamic audit: every state change in {self.steps} step(s) is explained "
                f"({self.watched} storages, {self.watched_bytes} B watched, {self.unreachable} of "
                f"them not reachable from the step's arguments or the model)")
        return lines

    def to_dict(self) -> dict:
        return {
            "unexplained_changes": [
                {"state": c.state, "step": c.step, "unit": c.unit, "rows": c.rows} for c in self.changes
            ],
            "verified": self.verified,
            "blind_spots": list(self.blind_spots),
            "watched_storages": self.watched,
            "watched_bytes": self.watched_bytes,
        }


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _element_ids(t: torch.Tensor) -> torch.Tensor:
    """Storage element index (in ``t``'s dtype units) of every element of ``t``."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.arange(n, device=t.device).as_strided(t.size(), t.stride(), t.storage_offset())


# ------------------------------------------------------------------------------- recording


def _script_objects(gm: torch.fx.GraphModule) -> list[str]:
    """TorchBind objects the graph passes around: state they hold lives in C++, out of sight."""
    found = []
    for node in gm.graph.nodes:
        value = node_value(node) if node.op in ("placeholder", "get_attr") else None
        real = value.real_obj if isinstance(value, FakeScriptObject) else value
        if isinstance(real, torch.ScriptObject):
            found.append(f"TorchBind object {node.target} ({real._type().qualified_name()}) holds "
                         f"state in C++, which no snapshot sees")
    return found


@dataclass
class _Observed:
    key: StorageWeakRef  # the storage written
    itemsize: int  # unit of ``ids``
    ids: torch.Tensor | None  # explained element ids; None: the whole storage


def _observe(record: StateWrite, written: torch.Tensor, env: dict) -> list[_Observed]:
    if not is_plain_tensor(written):  # a subclass: reported statically, its storages wholly
        return [_Observed(key, 1, None) for key in storage_keys(written) or ()]
    key = StorageWeakRef(written.untyped_storage())
    return [_Observed(key, written.element_size(), _explained_ids(record, written, env))]


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
        self.blind_spots: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        records = find_state_writes(gm)
        self.writes += records
        self.num_graphs += 1
        self.blind_spots += _script_objects(gm)
        by_node: dict[torch.fx.Node, list[StateWrite]] = {}
        for r in records:
            if r.written_node is not None and r.reason not in _UNEXPLAINING:
                by_node.setdefault(r.node, []).append(r)
        observed = self.observed

        class Recorder(torch.fx.Interpreter):
            def run_node(self, n: torch.fx.Node) -> Any:
                result = super().run_node(n)
                for r in by_node.get(n, ()):
                    observed.extend(_observe(r, self.env[r.written_node], self.env))
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


def _unexplained(watched: Watched, before: torch.Tensor, observed: list[_Observed],
                 step: int) -> UnexplainedChange | None:
    t = watched.tensor
    changed = _storage_bytes(t) != before
    if not bool(changed.any()):
        return None
    explained = torch.zeros_like(changed)
    for obs in observed:
        if obs.key != watched.key:
            continue
        if obs.ids is None:
            explained[:] = True
        else:
            explained.view(-1, obs.itemsize)[obs.ids] = True
    unexplained = changed & ~explained
    per_element = unexplained.view(-1, t.element_size()).any(-1)[_element_ids(t)] if t.numel() else None
    if per_element is None or not bool(per_element.any()):
        if not bool(unexplained.any()):
            return None
        return UnexplainedChange(watched.label(), step, "byte", unexplained.nonzero().reshape(-1).tolist())
    unit, rows = _rows_of(t, per_element)
    return UnexplainedChange(watched.label(), step, unit, rows)


def _created_since(watched: set[StorageWeakRef], inputs: StepInputs) -> list[str]:
    """Names of live storages that were not watched in the last step (allocated during it)."""
    row_inputs = {StorageWeakRef(t.untyped_storage()) for t, _ in inputs.dynamic}
    fresh = {}
    for t in live_tensors():
        for key in storage_keys(t) or ():
            if key not in watched and key not in row_inputs and t.numel():
                fresh.setdefault(key, t)
    return [holder_name(t, ignore=(fresh,)) for t in fresh.values()]


def _run_step(compiled: Callable[..., Any], backend: _RecordingBackend, model: Any, inputs: StepInputs,
              step: int, max_bytes: int, report: DynamicReport) -> set[StorageWeakRef]:
    """Snapshot, run one step, record its unexplained changes; the storages it watched."""
    watch = watch_list(model, inputs, max_bytes, collect=step == 0)
    report.blind_spots += [b for b in watch.blind_spots if b not in report.blind_spots]
    before = [_storage_bytes(w.tensor).clone() for w in watch.storages]
    backend.observed.clear()
    with torch.no_grad():
        compiled(*inputs.args, **inputs.kwargs)
    for w, old in zip(watch.storages, before):
        change = _unexplained(w, old, backend.observed, step)
        if change is not None:
            report.changes.append(change)
    report.watched, report.watched_bytes = len(watch.storages), watch.nbytes
    report.unreachable = sum(w.name is None for w in watch.storages)
    return {w.key for w in watch.storages}


def dynamic_audit(model: Callable[..., Any], inputs: StepInputs, steps: int = 2,
                  max_bytes: int = DEFAULT_MAX_BYTES) -> DynamicReport:
    """Run ``steps`` compiled steps of ``model`` on ``inputs`` and report unexplained state changes.

    Before each step every tensor that could be state is found again (state created by a step is
    watched from the next one) and snapshotted, up to ``max_bytes``.
    """
    backend = _RecordingBackend()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    report = DynamicReport(steps=steps)
    try:
        watched_keys: set[StorageWeakRef] = set()
        for step in range(steps):
            watched_keys = _run_step(compiled, backend, model, inputs, step, max_bytes, report)
        backend.observed.clear()  # its index tensors are the audit's own, not the step's
        created = _created_since(watched_keys, inputs)
        if created:
            report.blind_spots.append(
                f"{len(created)} tensor(s) created during the last step are still alive (state "
                f"allocated by the step?) and were not checked: {', '.join(created[:5])}; run more steps")
    finally:
        torch._dynamo.reset()
    report.blind_spots += list(dict.fromkeys(backend.blind_spots))
    report.writes = backend.writes
    report.num_graphs = backend.num_graphs
    return report
