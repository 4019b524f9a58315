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
the one the graph was compiled for, are refused at run time before anything is written. Two
ranks writing one slot (of a context cache, or of a graph cache synced in the same collective; under
the immediate schedule, of the last layer's cache after the first layer's rows were synced): every
rank raises the same error and every cache, context and graph, is as it was before the step.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
from torch._library.opaque_object import get_opaque_type_name, register_opaque_type
from torch._opaque_base import OpaqueBase

import pcppass.ops  # noqa: F401  (pcppass::reshape_and_cache_flash)
from pcppass.compiler import PcpBackend
from pcppass.engine.launch import launch
from pcppass.errors import PcpCoverageError, PcpSyncError
from pcppass.registry import register_pattern, register_resolver, unregister_resolver
from pcppass.spec import ContextCache, Recipe, Reviewed, WritePattern

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


def _attend(q: torch.Tensor, layer_name, dep: torch.Tensor) -> torch.Tensor:
    return q + CONTEXT[_name(layer_name)]["kv"].float().sum() / 64


# Each op twice: the layer name as a string, and (suffix _h) as the hoisted opaque Handle.
LIB = torch.library.Library("ctxtest", "FRAGMENT")
for suffix, handle_type in (("", "str"), ("_h", get_opaque_type_name(Handle))):
    LIB.define(f"write_rows{suffix}(Tensor x, {handle_type} layer_name) -> Tensor")
    LIB.define(f"attend{suffix}(Tensor q, {handle_type} layer_name, Tensor dep) -> Tensor")
    LIB.impl(f"write_rows{suffix}", _write, "CompositeExplicitAutograd")
    LIB.impl(f"attend{suffix}", _attend, "CompositeExplicitAutograd")
    torch.library.register_fake(f"ctxtest::write_rows{suffix}", lambda x, layer_name: x.new_empty(0), lib=LIB)
    torch.library.register_fake(f"ctxtest::attend{suffix}", lambda q, layer_name, dep: torch.empty_like(q),
                                lib=LIB)


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
    reviewed=Reviewed("tests/test_context_caches.py: _attend only reads the context cache", evidence=(
        "tests/test_context_caches.py::test_context_caches_synced_under_every_compiler_and_refused_when_unresolved")),
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


def _rank_run(rank: int, world: int, inner: str, opaque: bool, schedule: str):
    register_resolver("ctxtest", resolve, replace=True)
    _fresh_context(torch.bfloat16)
    backend = PcpBackend(inner=inner, schedule=schedule)
    compiled = torch.compile(Model(opaque), backend=backend, fullgraph=True)
    outputs, caches = [], []
    for step in range(2):
        x, slots = _step_inputs(step, rank, world)
        _set_slots(slots)
        outputs.append(compiled(x).numpy())  # numpy: sent back by value, not shared memory
        caches.append({name: CONTEXT[name]["kv"].view(torch.int16).numpy().copy() for name in LAYERS})
    report = backend.reports[-1]
    return outputs, caches, report.mode, report.all_gather_nodes, [
        (w.op, w.state, w.recipe.value) for w in report.writes]


def _reference(world: int, opaque: bool, schedule: str):
    """Every rank's step run eagerly on one process. Deferred schedule: rank r starts from the
    caches as synced after the previous step and adds its own rows (what its replica holds while it
    computes). Immediate schedule: layer by layer, every rank's rows are in before any rank reads
    the layer's cache. Returns per step the outputs of every rank and the synced caches."""
    _fresh_context(torch.bfloat16)
    synced = {name: CONTEXT[name]["kv"].clone() for name in LAYERS}
    outputs, caches = [], []
    for step in range(2):
        inputs = [_step_inputs(step, rank, world) for rank in range(world)]
        if schedule == "immediate":
            xs = [x for x, _ in inputs]
            for name in LAYERS:
                CONTEXT[name]["kv"] = synced[name]
                for r, (_, slots) in enumerate(inputs):
                    _set_slots(slots)
                    _write(xs[r] * 2, name)
                xs = [_attend(x, name, x) for x in xs]
            outputs.append(xs)
        else:
            merged = {name: t.clone() for name, t in synced.items()}
            per_rank = []
            for x, slots in inputs:
                for name in LAYERS:
                    CONTEXT[name]["kv"] = synced[name].clone()
                _set_slots(slots)
                per_rank.append(Model(opaque)(x))
                s = slots[slots >= 0]
                for name in LAYERS:
                    merged[name][s // BLOCK, s % BLOCK] = CONTEXT[name]["kv"][s // BLOCK, s % BLOCK]
            synced = merged
            outputs.append(per_rank)
        caches.append({name: t.clone() for name, t in synced.items()})
    return outputs, caches


def _rank_unresolved(rank: int, world: int) -> tuple[str, str] | None:
    """Compile with the resolver unregistered: the refusal (type, message), or None."""
    unregister_resolver("ctxtest")
    _fresh_context()
    x, slots = _step_inputs(0, rank, world)
    _set_slots(slots)
    compiled = torch.compile(Model(False), backend=PcpBackend(inner="eager"), fullgraph=True)
    try:
        compiled(x)
    except Exception as exc:  # noqa: BLE001
        inner = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
        return type(inner).__name__, str(inner)
    return None


def _rank_wider_rows(rank: int, world: int) -> tuple[str, str] | None:
    """After a first step, the engine hands out caches whose rows are wider than compiled for:
    the step's sync refuses (type, message) before it writes any replica."""
    register_resolver("ctxtest", resolve, replace=True)
    _fresh_context()
    compiled = torch.compile(Model(False), backend=PcpBackend(inner="eager"), fullgraph=True)
    x, slots = _step_inputs(0, rank, world)
    _set_slots(slots)
    compiled(x)
    for name in LAYERS:
        CONTEXT[name]["kv"] = torch.zeros(BLOCKS, BLOCK, WIDTH, dtype=torch.float64)
    try:
        compiled(x)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None


#: (inner compiler, opaque handle, schedule): strings under eager, hoisted opaque objects under AOT
#: and Inductor; the immediate schedule (the readers wait on the sync) under Inductor
COMPILERS = [("eager", False, "deferred"), ("aot_eager", True, "deferred"), ("inductor", True, "deferred"),
             ("inductor", False, "immediate")]


def _rank_all(rank: int, world: int):
    synced = []
    for inner, opaque, schedule in COMPILERS:
        torch._dynamo.reset()
        synced.append(_rank_run(rank, world, inner, opaque, schedule))
    torch._dynamo.reset()
    unresolved = _rank_unresolved(rank, world)
    torch._dynamo.reset()
    # last: a failed step aborts the process group (fail-stop)
    return synced, _rank_wider_rows(rank, world), unresolved


@pytest.mark.timeout(400)
def test_context_caches_synced_under_every_compiler_and_refused_when_unresolved():
    world = 2
    ranks = launch(_rank_all, world, timeout_s=380)
    for i, (inner, opaque, schedule) in enumerate(COMPILERS):
        ref_outputs, ref_caches = _reference(world, opaque, schedule)
        suffix = "_h" if opaque else ""
        for rank in range(world):
            outputs, caches, mode, gathers, writes = ranks[rank][0][i]
            # one collective per step (deferred) or per write site (immediate)
            assert mode == "sharded" and gathers == (1 if schedule == "deferred" else 2), (inner, mode, gathers)
            assert sorted(writes) == sorted(
                [(f"ctxtest::write_rows{suffix}", name, "copy_rows") for name in LAYERS]
                + [(f"ctxtest::attend{suffix}", name, "read_only") for name in LAYERS])
            for step in range(2):
                for name in LAYERS:
                    # the sync wrote the other rank's rows: every replica equals the merged cache
                    assert torch.equal(torch.from_numpy(caches[step][name]),
                                       ref_caches[step][name].view(torch.int16)), (inner, schedule, rank, step, name)
                # deferred: step 1 reads the rows the other rank wrote at step 0 (synced at its
                # end); immediate: each layer reads every rank's rows of the step
                torch.testing.assert_close(torch.from_numpy(outputs[step]), ref_outputs[step][rank])
    for rank in range(world):
        _, wider, unresolved = ranks[rank]
        assert wider is not None and wider[0] == PcpSyncError.__name__, wider
        assert "'layers.0'" in wider[1] and "64 B per row, compiled for 32" in wider[1], wider[1]
        assert unresolved is not None and unresolved[0] == PcpCoverageError.__name__, unresolved
        assert "ctxtest::write_rows writes layers.0" in unresolved[1], unresolved[1]
        assert "resolver 'ctxtest', which is not registered" in unresolved[1], unresolved[1]


def _rank_other_handle(rank: int, world: int):
    """A caller that skips Dynamo's guards (vLLM calls the compiled graph directly) hands the graph
    another layer's handle: refused before the graph runs, nothing written."""
    register_resolver("ctxtest", resolve, replace=True)
    _fresh_context()
    compiled_steps = []

    def backend(gm, example_inputs):
        step = PcpBackend(inner="eager")(gm, example_inputs)

        def run(*args):
            compiled_steps.append(args)
            return step(*args)

        compiled_steps.append(run)
        return run

    compiled = torch.compile(Model(True), backend=backend, fullgraph=True)
    x, slots = _step_inputs(0, rank, world)
    _set_slots(slots)
    compiled(x)
    run, args = compiled_steps[0], list(compiled_steps[1])
    handles = [i for i, a in enumerate(args) if isinstance(a, Handle)]
    args[handles[0]], args[handles[1]] = args[handles[1]], args[handles[0]]  # layers swapped
    before = {name: CONTEXT[name]["kv"].clone() for name in LAYERS}
    try:
        run(*args)
    except Exception as exc:  # noqa: BLE001
        untouched = all(torch.equal(before[n], CONTEXT[n]["kv"]) for n in LAYERS)
        return type(exc).__name__, str(exc), untouched
    return None


@pytest.mark.timeout(120)
def test_graph_called_with_another_handle_is_refused_before_it_runs():
    for result in launch(_rank_other_handle, 2, timeout_s=100):
        assert result is not None and result[0] == "PcpInputError", result
        assert "compiled for 'layers." in result[1] and "Handle" in result[1], result[1]
        assert result[2], "a refused step wrote a cache"


class MixedModel(Model):
    """A graph cache pair written by ``pcppass::reshape_and_cache_flash``, then the context
    layers: one collective syncs both kinds."""

    def forward(self, x, slots, k, v):
        one = torch.ones(())
        rows = x.view(-1, 2, 4)
        torch.ops.pcppass.reshape_and_cache_flash(rows, rows * 2, k, v, slots, "auto", one, one)
        return super().forward(x)


def _two_owner_step(rank: int, world: int, group, model: torch.nn.Module, inner: str, conflict: str,
                    schedule: str = "deferred"):
    """Step 0 as usual, then a step in which both ranks also write slot 20 of the context caches
    (``conflict="context"``; ``"context_last"``: of the last layer's only, after the first layer's
    rows were synced under the immediate schedule) or of the graph caches (``"graph"``): the
    error, and every cache's bytes before and after the refused step."""
    register_resolver("ctxtest", resolve, replace=True)
    _fresh_context()
    torch._dynamo.reset()
    k, v = torch.zeros(BLOCKS, BLOCK, 2, 4), torch.zeros(BLOCKS, BLOCK, 2, 4)
    mixed = isinstance(model, MixedModel)
    compiled = torch.compile(model, backend=PcpBackend(group=group, inner=inner, schedule=schedule),
                             fullgraph=True)

    def run(x, context_slots, graph_slots, last_layer_slots=None):
        _set_slots(context_slots)
        if last_layer_slots is not None:
            CONTEXT[LAYERS[-1]]["slots"] = last_layer_slots
        return compiled(x, graph_slots, k, v) if mixed else compiled(x)

    def state() -> list[bytes]:
        tensors = [CONTEXT[name]["kv"] for name in LAYERS] + ([k, v] if mixed else [])
        return [t.numpy().tobytes() for t in tensors]

    x, slots = _step_inputs(0, rank, world)
    run(x, slots, slots)
    before = state()
    x, slots = _step_inputs(1, rank, world)
    both = slots.clone()
    both[-1] = 20  # the padding row writes slot 20 on every rank
    try:
        run(x, both if conflict == "context" else slots, both if conflict == "graph" else slots,
            both if conflict == "context_last" else None)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}", before, state()
    return None, before, state()


#: name: (graph caches too, inner compiler, where two ranks write slot 20, schedule)
TWO_OWNER_CASES = {
    "context_eager": (False, "eager", "context", "deferred"),
    "context_inductor": (False, "inductor", "context", "deferred"),
    "mixed_graph_conflict": (True, "eager", "graph", "deferred"),
    "mixed_context_conflict": (True, "inductor", "context", "deferred"),
    "immediate_last_layer_eager": (False, "eager", "context_last", "immediate"),
    "immediate_last_layer_inductor": (False, "inductor", "context_last", "immediate"),
    "immediate_mixed_last_layer": (True, "inductor", "context_last", "immediate"),
}


def _rank_two_owners(rank: int, world: int) -> dict:
    out = {}
    for name, (mixed, inner, conflict, schedule) in TWO_OWNER_CASES.items():
        model = MixedModel(False) if mixed else Model(False)
        out[name] = _two_owner_step(rank, world, dist.new_group(list(range(world))), model, inner, conflict,
                                    schedule)
    return out


@pytest.mark.timeout(400)
def test_a_refused_two_owner_step_leaves_every_cache_as_before():
    ranks = launch(_rank_two_owners, 2, timeout_s=380)
    for name in TWO_OWNER_CASES:
        (error, before, _), (error1, before1, _) = ranks[0][name], ranks[1][name]
        assert error == error1, (name, error, error1)
        assert error is not None and error.startswith("PcpSyncError: "), (name, error)
        assert "slot 20 was written by ranks [0, 1]" in error, (name, error)
        assert "every replica holds what it held before the step" in error, (name, error)
        assert before == before1 and any(any(b) for b in before), name
        for rank in range(2):
            assert ranks[rank][name][2] == ranks[rank][name][1], \
                f"{name}: rank {rank}'s caches changed although the step was refused"


class _Seen(Exception):
    pass


def _rewritten(model: torch.nn.Module, inputs: tuple, schedule: str) -> torch.fx.GraphModule:
    """The graph Dynamo hands a backend, rewritten for 2 ranks (nothing runs)."""
    from pcppass.analysis import find_state_writes
    from pcppass.rewrite.insert import insert_sync
    from pcppass.rewrite.plan import plan_sync

    seen = []

    def backend(gm, example_inputs):
        plan = plan_sync([w for w in find_state_writes(gm) if w.covered])
        insert_sync(gm, plan, schedule=schedule, group_name="0", world_size=2)
        seen.append(gm)
        raise _Seen

    torch._dynamo.reset()
    try:
        torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    except Exception:  # noqa: BLE001 - Dynamo wraps what the backend raised
        if not seen:
            raise
    return seen[0]


@pytest.mark.parametrize("schedule", ["deferred", "immediate"])
def test_the_snapshot_precedes_each_context_write_and_the_verdict_every_scatter(schedule):
    """What orders the restore, in the graph itself (a CPU run keeps FX order whatever the edges):
    each context write takes the snapshot's copy of its row input, and every op that applies rows
    or re-runs takes the index the verdict returns."""
    register_resolver("ctxtest", resolve, replace=True)
    _fresh_context()
    x, slots = _step_inputs(0, 0, 2)
    _set_slots(slots)
    k, v = torch.zeros(BLOCKS, BLOCK, 2, 4), torch.zeros(BLOCKS, BLOCK, 2, 4)
    gm = _rewritten(MixedModel(False), (x, slots, k, v), schedule)
    ops = torch.ops.pcppass
    snapshots = gm.graph.find_nodes(op="call_function", target=ops.sync_context_snapshot.default)
    verdicts = gm.graph.find_nodes(op="call_function", target=ops.sync_context_verdict.default)
    writes = [n for t in (torch.ops.ctxtest.write_rows, torch.ops.ctxtest.write_rows.default)
              for n in gm.graph.find_nodes(op="call_function", target=t)]
    assert len(writes) == len(snapshots) == 2
    for write in writes:
        (copy,) = [n for n in write.all_input_nodes if n.target is operator.getitem and n.args[1] == 1]
        assert copy.args[0] in snapshots, write.format_node()
    # deferred: one collective; immediate: one per site (graph-only ones decided there too)
    assert len(verdicts) == (1 if schedule == "deferred" else 3)
    appliers = [ops.sync_scatter_context.default, ops.sync_scatter_rows_all.default, ops.sync_unpack.default,
                ops.sync_verdict.default]
    applied = [n for t in appliers for n in gm.graph.find_nodes(op="call_function", target=t)]
    assert applied
    for node in applied:
        assert any(a in verdicts for a in node.all_input_nodes), node.format_node()
