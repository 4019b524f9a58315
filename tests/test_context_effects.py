"""A resolver's ``effect`` decides, per handle, whether an op writes through it or only reads.

The attention-like op here (``effx::attend``) behaves like vLLM's ``unified_attention_with_output``:
it takes a layer name and writes ``out``; on some layers (those whose "backend" stores K/V inside
the op) it also stores its ``x`` rows into the layer's context cache. Its pattern lists the handle
both as context roles and as a read, and the resolver's ``effect`` says which holds per layer:

* the audit reports the op read-only on a layer that only reads and a covered COPY_ROWS write on
  a layer that stores, with the engine's reason; a layer the engine cannot decide (its effect
  raises) and a resolver with no ``effect`` leave the write uncovered, named;
* on 2 gloo ranks (deferred schedule) the stored rows reach every replica: each cache equals the
  merged cache of both ranks' rows, bitwise;
* negative control: the same op declared read-only for every layer (no per-handle decision)
  leaves the replicas different;
* under the immediate schedule (ranks read each other's rows within the step) an op that stores
  and reads in one call cannot be synced before its own read: refused at compile time.
"""

from __future__ import annotations

import pytest
import torch

from pcppass.analysis import Uncovered, audit
from pcppass.checks import SyncChecks
from pcppass.compiler import PcpBackend
from pcppass.errors import PcpSyncError
from pcppass.engine.launch import launch
from pcppass.registry import HandleEffect, register_pattern, register_resolver
from pcppass.spec import ContextCache, Recipe, Reviewed, WritePattern

ROWS, WIDTH, BLOCK, BLOCKS = 4, 8, 4, 6
#: layer -> whether its "backend" stores K/V inside the attention op (None: never reviewed)
STORES = {"l0": False, "l1": True}
CONTEXT: dict[str, dict[str, torch.Tensor]] = {}
REVIEW = Reviewed("tests/test_context_effects.py: _attend stores x only where STORES says so",
                  evidence="tests/test_context_effects.py::test_audit_decides_per_layer")


def _store(x: torch.Tensor, layer_name: str) -> None:
    entry = CONTEXT[layer_name]
    keep = entry["slots"] >= 0
    s = entry["slots"][keep]
    entry["kv"][s // BLOCK, s % BLOCK] = x[keep]


def _write(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    _store(x, layer_name)
    return x.new_empty(0)


def _attend(q: torch.Tensor, x: torch.Tensor, layer_name: str, out: torch.Tensor, dep: torch.Tensor) -> None:
    if STORES[layer_name]:
        _store(x, layer_name)
    out.copy_(q + CONTEXT[layer_name]["kv"].sum() / 64)


LIB = torch.library.Library("effx", "FRAGMENT")
LIB.define("write_rows(Tensor x, str layer_name) -> Tensor")
LIB.define("attend(Tensor q, Tensor x, str layer_name, Tensor(a!) out, Tensor dep) -> ()")
LIB.impl("write_rows", _write, "CompositeExplicitAutograd")
LIB.impl("attend", _attend, "CompositeExplicitAutograd")
torch.library.register_fake("effx::write_rows", lambda x, layer_name: x.new_empty(0), lib=LIB)
torch.library.register_fake("effx::attend", lambda q, x, layer_name, out, dep: None, lib=LIB)

_KV = (ContextCache("layer_name", cache="kv_cache", slots="slot_mapping"),)
WRITE_ROWS = WritePattern(name="effx.write_rows", ops=("effx::write_rows",), caches=(), context=_KV,
                          resolver="effx", row_args={"x": 0}, recipe=Recipe.COPY_ROWS)
ATTEND = WritePattern(name="effx.attend", ops=("effx::attend",), caches=(), context=_KV, reads=("layer_name",),
                      resolver="effx", row_args={"x": 0}, recipe=Recipe.COPY_ROWS, reviewed=REVIEW)
#: what a read-only declaration for every layer looks like (the negative control)
ATTEND_READ_ONLY = WritePattern(name="effx.attend", ops=("effx::attend",), caches=(), reads=("layer_name",),
                                recipe=Recipe.READ_ONLY, reviewed=REVIEW)


def resolve(handle: str) -> dict[str, torch.Tensor]:
    return {"kv_cache": CONTEXT[handle]["kv"], "slot_mapping": CONTEXT[handle]["slots"]}


def effect(op: str, handle: str) -> HandleEffect:
    if op == "effx::write_rows":
        return HandleEffect(True, "stores x")
    stores = STORES[handle]
    if stores is None:
        raise ValueError(f"the backend of {handle} was never reviewed")
    return HandleEffect(stores, "stores x inside attend" if stores else "attend reads the cache")


def _register(*, with_effect: bool = True, read_only_for_all: bool = False) -> None:
    register_resolver("effx", resolve, effect=effect if with_effect else None, replace=True)
    register_pattern(WRITE_ROWS, replace=True)
    register_pattern(ATTEND_READ_ONLY if read_only_for_all else ATTEND, replace=True)


class Model(torch.nn.Module):
    """l0 stores through ``write_rows`` and reads in ``attend``; l1 stores inside ``attend``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for name in STORES:  # both layers store the rows of x * 2
            dep = torch.ops.effx.write_rows(x * 2, name) if not STORES[name] else x.new_empty(0)
            out = torch.empty_like(x)
            torch.ops.effx.attend(x, x * 2, name, out, dep)
            outs.append(out)
        return outs[0] + outs[1]


def _fresh_context(slots: torch.Tensor) -> None:
    CONTEXT.clear()
    for name in STORES:
        CONTEXT[name] = {"kv": torch.zeros(BLOCKS, BLOCK, WIDTH), "slots": slots}


def _step_inputs(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows and slots (rank r owns slots r, r + world, ...); the last row is padding."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(ROWS, WIDTH, generator=g)
    slots = torch.tensor([step * ROWS * world + r * world + rank for r in range(ROWS - 1)] + [-1])
    return x, slots


def test_audit_decides_per_layer(monkeypatch):
    _register()
    x, slots = _step_inputs(0, 0, 1)
    _fresh_context(slots)
    report = audit(Model(), (x,), name="effx")
    rows = [(w.op, w.state, w.covered, w.recipe.value if w.recipe else None, w.bytes_per_row) for w in report.writes]
    assert rows == [("effx::write_rows", "l0", True, "copy_rows", WIDTH * 4),
                    ("effx::attend", "l0", True, "read_only", None),
                    ("effx::attend", "l1", True, "copy_rows", WIDTH * 4)], rows
    assert "attend reads the cache" in report.writes[1].detail
    assert report.writes[2].detail == "stores x inside attend"

    monkeypatch.setitem(STORES, "l1", None)  # a layer whose backend nobody reviewed
    (undecided,) = audit(Model(), (x,), name="effx").uncovered
    assert (undecided.op, undecided.state, undecided.reason) == ("effx::attend", "l1", Uncovered.UNDECIDED_HANDLE)
    assert "the backend of l1 was never reviewed" in undecided.detail

    monkeypatch.setitem(STORES, "l1", True)
    _register(with_effect=False)  # the pattern leaves it to the resolver, which cannot say
    uncovered = audit(Model(), (x,), name="effx").uncovered
    assert [(w.op, w.state) for w in uncovered] == [("effx::attend", "l0"), ("effx::attend", "l1")]
    assert all("no resolver registered under that name says so" in w.detail for w in uncovered)


def _rank_run(rank: int, world: int, inner: str, read_only_for_all: bool, *, digest: bool = True) -> list | str:
    """Every layer's cache after each of two steps; with the old declaration and the state digest
    on, the digest's error instead."""
    _register(read_only_for_all=read_only_for_all)
    torch._dynamo.reset()
    compiled = torch.compile(Model(), backend=PcpBackend(inner=inner, schedule="deferred",
                                                          checks=SyncChecks(state_digest=digest)), fullgraph=True)
    caches = []
    for step in range(2):
        x, slots = _step_inputs(step, rank, world)
        if step == 0:
            _fresh_context(slots)
        for name in STORES:
            CONTEXT[name]["slots"] = slots
        try:
            compiled(x)
        except PcpSyncError as exc:
            return str(exc)
        caches.append({name: CONTEXT[name]["kv"].numpy().copy() for name in STORES})
    return caches


def _rank_immediate(rank: int, world: int) -> tuple[str, str] | None:
    """The immediate schedule (ranks read each other's rows in the step) on an op that stores and
    reads in one call: refused at compile time, before anything runs."""
    _register()
    torch._dynamo.reset()
    x, slots = _step_inputs(0, rank, world)
    _fresh_context(slots)
    compiled = torch.compile(Model(), backend=PcpBackend(inner="eager", schedule="immediate"), fullgraph=True)
    try:
        compiled(x)
    except Exception as exc:  # noqa: BLE001
        inner = getattr(exc, "inner_exception", None) or exc
        return type(inner).__name__, str(inner)
    return None


def _rank_all(rank: int, world: int) -> list:
    return [_rank_run(rank, world, "eager", False), _rank_run(rank, world, "inductor", False),
            _rank_run(rank, world, "eager", True, digest=False), _rank_immediate(rank, world),
            _rank_run(rank, world, "eager", True)]


def _merged(world: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's rows of every step, in one cache per layer (what every replica must hold)."""
    kv = {name: torch.zeros(BLOCKS, BLOCK, WIDTH) for name in STORES}
    out = []
    for step in range(2):
        for rank in range(world):
            x, slots = _step_inputs(step, rank, world)
            s = slots[slots >= 0]
            for name in STORES:
                kv[name][s // BLOCK, s % BLOCK] = (x * 2)[slots >= 0]
        out.append({name: t.clone() for name, t in kv.items()})
    return out


@pytest.mark.timeout(300)
def test_rows_stored_inside_the_op_reach_every_replica():
    world = 2
    ranks = launch(_rank_all, world, timeout_s=280)
    merged = _merged(world)
    for run, label in enumerate(("eager", "inductor")):
        for rank in range(world):
            for step in range(2):
                for name in STORES:
                    assert torch.equal(torch.from_numpy(ranks[rank][run][step][name]), merged[step][name]), (
                        label, rank, step, name)
    # read-only for every layer: l1's rows stay on their owners ...
    control = [ranks[rank][2] for rank in range(world)]
    assert not (control[0][0]["l1"] == control[1][0]["l1"]).all(), "unsynced rows did not diverge"
    # ... which the state digest (on by default) names in the first step, as the cache outside the graph
    for rank in range(world):
        caught = ranks[rank][4]
        assert isinstance(caught, str) and "state diverged across ranks" in caught, caught
        assert "CONTEXT['l1']['kv'] (outside the graph)" in caught, caught
    for rank in range(world):
        refused = ranks[rank][3]
        assert refused is not None and "reads before other ranks' rows can arrive" in refused[1], refused
