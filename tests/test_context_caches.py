"""Context-addressed caches: ops that fetch their cache by handle at run time, synced through a
resolver, on 2 gloo ranks.

The ops here behave like vLLM's (``vllm::unified_kv_cache_update``): they take a layer name (a
string, or a hoisted opaque value object like vLLM's ``LayerName``), fetch the cache and the slot
mapping from a per-step context, declare no mutation and return an empty dependency token. The
caches are never graph inputs, so the sync ops that write them must survive functionalization and
dead-code elimination: checked under eager, aot_eager and Inductor. After a step every cache is
bitwise identical on both ranks and holds every rank's rows; the next step's outputs (which read
the whole cache) equal a single-rank run's. A handle whose resolver is not registered is refused
at compile time; a cache whose rows no longer match the compiled layout, and a handle other than
the one the graph was compiled for, are refused at run time before anything is written.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

from pcppass.compiler import PcpBackend
from pcppass.engine.launch import launch
from pcppass.errors import PcpCoverageError, PcpInputError, PcpSyncError
from pcppass.registry import register_pattern, register_resolver, unregister_resolver
from pcppass.spec import ContextCache, Recipe, WritePattern

ROWS, WIDTH, BLOCK, BLOCKS = 4, 8, 4, 6
LAYERS = ("layers.0", "layers.1")

#: the per-step context the ops read (the engine's, in vLLM: the forward context)
CONTEXT: dict[str, dict[str, torch.Tensor]] = {}


class Handle(OpaqueBase):
    """A layer name as a hoisted opaque value object (what vLLM's ``LayerName`` is)."""

    def __init__(self, value: str) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __fx_repr__(self):
        return f"Handle({self.value!r})", {"Handle": Handle}


register_opaque_type(Handle, typ="value", hoist=True)


def _name(layer_name) -> str:
    return layer_name.value if isinstance(layer_name, Handle) else layer_name


def _write(x: torch.Tensor, layer_name) -> torch.Tensor:
    entry = CONTEXT[_name(layer_name)]
    slots = entry["slots"]
    keep = slots >= 0
    s = slots[keep]
    entry["kv"][s // BLOCK, s % BLOCK] = x[keep].to(entry["kv"].dtype)
    return x.new_empty(0)


def _attend(q: torch.Tensor, layer_name) -> torch.Tensor:
    return q + CONTEXT[_name(layer_name)]["kv"].float().sum() / 64


@torch.library.custom_op("ctxtest::write_rows", mutates_args=())
def write_rows(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    return _write(x, layer_name)


@write_rows.register_fake
def _(x, layer_name):
    return x.new_empty(0)


@torch.library.custom_op("ctxtest::attend", mutates_args=())
def attend(q: torch.Tensor, layer_name: str, dep: torch.Tensor) -> torch.Tensor:
    return _attend(q, layer_name)


@attend.register_fake
def _(q, layer_name, dep):
    return torch.empty_like(q)


@torch.library.custom_op("ctxtest::write_rows_h", mutates_args=())
def write_rows_h(x: torch.Tensor, layer_name: Handle) -> torch.Tensor:
    return _write(x, layer_name)


@write_rows_h.register_fake
def _(x, layer_name):
    return x.new_empty(0)


@torch.library.custom_op("ctxtest::attend_h", mutates_args=())
def attend_h(q: torch.Tensor, layer_name: Handle, dep: torch.Tensor) -> torch.Tensor:
    return _attend(q, layer_name)


@attend_h.register_fake
def _(q, layer_name, dep):
    return torch.empty_like(q)


def resolve(handle: str) -> dict[str, torch.Tensor]:
    entry = CONTEXT[handle]
    return {"kv_cache": entry["kv"], "slot_mapping": entry["slots"]}


register_pattern(WritePattern(
    name="ctxtest.write_rows", ops=("ctxtest::write_rows", "ctxtest::write_rows_h"), caches=(),
    context=(ContextCache("layer_name", cache="kv_cache", slots="slot_mapping"),),
    resolver="ctxtest", row_args={"x": 0}, recipe=Recipe.COPY_ROWS,
))
register_pattern(WritePattern(
    name="ctxtest.attend", ops=("ctxtest::attend", "ctxtest::attend_h"), caches=(),
    reads=("layer_name",), recipe=Recipe.READ_ONLY,
))


class Model(torch.nn.Module):
    """Two layers: each writes its rows by layer name, then reads the whole cache."""

    def __init__(self, opaque: bool) -> None:
        super().__init__()
        self.opaque = opaque
        self.handles = [Handle(name) for name in LAYERS]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, handle in zip(LAYERS, self.handles):
            if self.opaque:
                token = torch.ops.ctxtest.write_rows_h(x * 2, handle)
                x = torch.ops.ctxtest.attend_h(x, handle, token)
            else:
                token = torch.ops.ctxtest.write_rows(x * 2, name)
                x = torch.ops.ctxtest.attend(x, name, token)
        return x


def _step_inputs(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of this rank (distinct values) and their slots: rank r owns slots r, r + world, ...;
    the last row is padding (slot -1)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(ROWS, WIDTH, generator=g)
    slots = torch.tensor([step * ROWS * world + r * world + rank for r in range(ROWS - 1)] + [-1])
    return x, slots


def _fresh_context(dtype=torch.float32) -> None:
    CONTEXT.clear()
    for name in LAYERS:
        CONTEXT[name] = {"kv": torch.zeros(BLOCKS, BLOCK, WIDTH, dtype=dtype), "slots": torch.empty(0)}


def _set_slots(slots: torch.Tensor) -> None:
    for name in LAYERS:
        CONTEXT[name]["slots"] = slots


def _rank_run(rank: int, world: int, inner: str, opaque: bool):
    register_resolver("ctxtest", resolve, replace=True)
    _fresh_context(torch.bfloat16)
    backend = PcpBackend(inner=inner)
    compiled = torch.compile(Model(opaque), backend=backend, fullgraph=True)
    outputs, caches = [], []
    for step in range(2):
        x, slots = _step_inputs(step, rank, world)
        _set_slots(slots)
        outputs.append(compiled(x))
        caches.append({name: CONTEXT[name]["kv"].clone() for name in LAYERS})
    report = backend.reports[-1]
    return outputs, caches, report.mode, report.all_gather_nodes, [
        (w.op, w.state, w.pattern.recipe.value) for w in report.writes]


def _reference(world: int, opaque: bool):
    """Every rank's rows run on one rank, eagerly: the caches and outputs to match."""
    _fresh_context(torch.bfloat16)
    model = Model(opaque)
    outputs, caches = [], []
    for step in range(2):
        per_rank = [_step_inputs(step, r, world) for r in range(world)]
        for x, slots in per_rank:  # every rank's writes
            _set_slots(slots)
            for name in LAYERS:
                _write(x * 2, name)
        caches.append({name: CONTEXT[name]["kv"].clone() for name in LAYERS})
        # what rank r computes once the whole cache holds every row (its reads follow its writes)
        outputs.append([x + CONTEXT[LAYERS[0]]["kv"].float().sum() / 64 for x, _ in per_rank])
    return outputs, caches


@pytest.mark.timeout(300)
@pytest.mark.parametrize("inner,opaque", [("eager", False), ("aot_eager", True), ("inductor", False),
                                          ("inductor", True)])
def test_context_caches_synced_under_every_compiler(inner, opaque):
    world = 2
    ranks = launch(_rank_run, world, inner, opaque, timeout_s=280)
    _, ref_caches = _reference(world, opaque)
    for outputs, caches, mode, gathers, writes in ranks:
        assert mode == "sharded" and gathers == 1, (mode, gathers)
        assert sorted(writes) == sorted(
            [("ctxtest::write_rows" + ("_h" if opaque else ""), name, "copy_rows") for name in LAYERS]
            + [("ctxtest::attend" + ("_h" if opaque else ""), name, "read_only") for name in LAYERS])
        for step in range(2):
            for name in LAYERS:
                # the sync wrote the other rank's rows: both replicas equal the single-rank cache
                assert torch.equal(caches[step][name].view(torch.int16),
                                   ref_caches[step][name].view(torch.int16)), (inner, step, name)
    # step 1 reads the whole cache written at step 0 (synced at its end): outputs agree across ranks
    for r in range(world):
        assert torch.isfinite(ranks[r][0][1]).all()
    totals = {float(CONTEXT_SUM(ranks[r][1][0][LAYERS[0]])) for r in range(world)}
    assert len(totals) == 1


def CONTEXT_SUM(kv: torch.Tensor) -> torch.Tensor:
    return kv.float().sum()


def _rank_unresolved(rank: int, world: int):
    unregister_resolver("ctxtest")
    _fresh_context()
    _set_slots(_step_inputs(0, rank, world)[1])
    compiled = torch.compile(Model(False), backend=PcpBackend(inner="eager"), fullgraph=True)
    try:
        compiled(_step_inputs(0, rank, world)[0])
    except Exception as exc:  # noqa: BLE001
        inner = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
        return type(inner).__name__, str(inner)
    return None


@pytest.mark.timeout(120)
def test_handle_without_resolver_is_refused():
    for result in launch(_rank_unresolved, 2, timeout_s=100):
        assert result is not None and result[0] == PcpCoverageError.__name__, result
        assert "ctxtest::write_rows" in result[1] and "'layers.0'" in result[1], result[1]
        assert "resolver 'ctxtest'" in result[1] and "not registered" in result[1], result[1]


def _rank_bad_runtime(rank: int, world: int, what: str):
    register_resolver("ctxtest", resolve, replace=True)
    _fresh_context()
    backend = PcpBackend(inner="eager")
    compiled = torch.compile(Model(False), backend=backend, fullgraph=True)
    x, slots = _step_inputs(0, rank, world)
    _set_slots(slots)
    compiled(x)
    if what == "row_bytes":  # the engine now hands out a cache whose rows are wider
        for name in LAYERS:
            CONTEXT[name]["kv"] = torch.zeros(BLOCKS, BLOCK, 2 * WIDTH)
    before = {name: CONTEXT[name]["kv"].clone() for name in LAYERS}
    try:
        compiled(x)
    except Exception as exc:  # noqa: BLE001
        untouched = all(torch.equal(before[n], CONTEXT[n]["kv"]) for n in LAYERS[1:])
        return type(exc).__name__, str(exc), untouched
    return None


@pytest.mark.timeout(120)
def test_cache_that_no_longer_fits_the_compiled_layout_is_refused():
    for result in launch(_rank_bad_runtime, 2, "row_bytes", timeout_s=100):
        assert result is not None and result[0] == PcpSyncError.__name__, result
        assert "'layers.0'" in result[1] and "compiled for" in result[1], result[1]
