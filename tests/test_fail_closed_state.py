"""Writes no graph shows, state rebound after the graph, overlapping cache views, two owners of
one slot and int32 slot mappings, on 2 gloo ranks with decode ownership moving every step (one
launch, one subgroup per case: a case whose error aborts its group leaves the next one alone):

* an under-declared custom op (``mutates_args=()``) whose first write comes at step 7, into a
  registered buffer, an ``nn.Parameter(requires_grad=False)``, or a cache it fetches from a
  module-global dict by an int layer index: the state digest names it (at the sampled step 64,
  or at step 7 with ``SyncChecks(digest_every=1)``), whatever the state looked like before;
* state the step rebinds (a buffer written and never read, a closure variable rebound with
  ``nonlocal``, a list the step appends to): refused when compiled, before anything is written;
* two caches viewing one buffer with different row shapes, rank 0's row of one overlapping rank
  1's row of the other, and two ranks writing one slot: refused on every rank, and every replica
  is as it was before the step (deferred and immediate schedules);
* int32 slot mappings of a row-copy op, a re-run op and an aten index write: every replica
  bitwise equal to one rank's run (deferred under Inductor, immediate under eager);
* a step one rank refuses (its int32 slot out of range) while the other's graph already wrote:
  that rank writes its rows back, every replica is as before the step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pcppass.ops  # noqa: F401
from pcppass.checks import SyncChecks
from pcppass.compiler import PcpBackend
from pcppass.engine.launch import launch
from pcppass.errors import PcpError
from pcppass.registry import register_pattern
from pcppass.spec import CacheRole, PagedRows, Recipe, WritePattern

NB, BS, W = 8, 4, 8
FIRST_WRITE = 7
#: caches an op fetches by layer index (vLLM-style context held by the model's module)
HIDDEN: dict[int, torch.Tensor] = {}


# -- ops and patterns -------------------------------------------------------------------------

@torch.library.custom_op("failstate::late_write", mutates_args=())
def late_write(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Writes ``cache`` (undeclared) from step ``FIRST_WRITE`` on."""
    if int(step) >= FIRST_WRITE:
        keep = slots >= 0
        cache[slots[keep] // BS, slots[keep] % BS] = x[keep]
    return x * 2.0


@late_write.register_fake
def _(x, cache, slots, step):
    return torch.empty_like(x)


@torch.library.custom_op("failstate::write_once", mutates_args=())
def write_once(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Writes ``cache`` (undeclared) at step ``FIRST_WRITE`` only."""
    if int(step) == FIRST_WRITE:
        keep = slots >= 0
        cache[slots[keep] // BS, slots[keep] % BS] = x[keep]
    return x * 2.0


@write_once.register_fake
def _(x, cache, slots, step):
    return torch.empty_like(x)


@torch.library.custom_op("failstate::layer_write", mutates_args=())
def layer_write(x: torch.Tensor, slots: torch.Tensor, layer: int, step: torch.Tensor) -> torch.Tensor:
    """Fetches its cache by layer index and writes it (undeclared) from step ``FIRST_WRITE`` on."""
    if int(step) >= FIRST_WRITE:
        keep = slots >= 0
        HIDDEN[layer][slots[keep] // BS, slots[keep] % BS] = x[keep]
    return x * 2.0


@layer_write.register_fake
def _(x, slots, layer, step):
    return torch.empty_like(x)


@torch.library.custom_op("failstate::store32", mutates_args=("cache",))
def store32(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    assert slots.dtype == torch.int32  # the op's own dtype, on the owner and in the re-run alike
    keep = slots >= 0
    s = slots[keep].long()
    cache[s // BS, s % BS] = x[keep]


@store32.register_fake
def _(x, cache, slots):
    return None


@torch.library.custom_op("failstate::rerun32", mutates_args=("cache",))
def rerun32(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    assert slots.dtype == torch.int32
    keep = slots >= 0
    s = slots[keep].long()
    cache[s // BS, s % BS] = torch.tanh(x[keep])


@rerun32.register_fake
def _(x, cache, slots):
    return None


def _register_patterns() -> None:
    rows = {"x": 0, "slots": 0}
    register_pattern(WritePattern(name="failstate.store32", ops=("failstate::store32",),
                                  caches=(CacheRole("cache", slots="slots", layout=PagedRows()),),
                                  row_args=rows), replace=True)
    register_pattern(WritePattern(name="failstate.rerun32", ops=("failstate::rerun32",),
                                  caches=(CacheRole("cache", slots="slots", layout=PagedRows()),),
                                  row_args=rows, recipe=Recipe.RERUN), replace=True)


# -- steps ------------------------------------------------------------------------------------

def kv(x, slots, k, v):
    one = torch.ones(())
    rows = x.view(-1, 2, 4)
    torch.ops.pcppass.reshape_and_cache_flash(rows, rows * 2, k, v, slots, "auto", one, one)
    return x.sum(1)


class HiddenWriter(nn.Module):
    """A covered K/V write plus an under-declared write into state held as ``where`` says."""

    def __init__(self, where: str, op):
        super().__init__()
        self.where, self.op = where, op
        hidden = torch.zeros(NB, BS, W)
        if where == "parameter":
            self.hidden = nn.Parameter(hidden, requires_grad=False)
        elif where == "buffer":
            self.register_buffer("hidden", hidden)

    def forward(self, x, slots, step, k, v, arg):
        if self.where == "dict":
            y = torch.ops.failstate.layer_write(x, slots, 0, step)
        else:
            y = self.op(x, arg if self.where == "argument" else self.hidden, slots, step)
        return kv(y, slots, k, v)


class LastH(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("last_h", torch.zeros(W))

    def forward(self, x, slots, k, v):
        out = kv(x, slots, k, v)
        self.last_h = x.sum(0)  # written, never read
        return out


def closure_step(how: str):
    last, history = torch.zeros(W), []

    def step(x, slots, k, v):
        nonlocal last
        out = kv(x, slots, k, v)
        if how == "nonlocal":
            last = x.sum(0)
        elif how == "nonlocal_read":
            last = last + x.sum(0)
        else:
            history.append(x.sum(0))
        return out

    return step


def two_views(x, slots_a, slots_b, ka, va, kb, vb):
    one = torch.ones(())
    a = x.view(-1, 2, 4)
    torch.ops.pcppass.reshape_and_cache_flash(a, a, ka, va, slots_a, "auto", one, one)
    b = x[:, :4].reshape(-1, 1, 4)
    torch.ops.pcppass.reshape_and_cache_flash(b, b, kb, vb, slots_b, "auto", one, one)
    return x.sum(1)


def int32_step(x, slots, a, b, flat):
    torch.ops.failstate.store32(x, a, slots)
    torch.ops.failstate.rerun32(x * 2, b, slots)
    flat.index_put_((slots,), x * 3)  # an aten write with an int32 row index
    return x.sum(1)


# -- one rank ---------------------------------------------------------------------------------

def _bytes(*tensors: torch.Tensor) -> list[bytes]:
    return [t.detach().contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]


def _error(call) -> str | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - Dynamo wraps compile-time errors
        while not isinstance(exc, PcpError) and (exc.__cause__ or getattr(exc, "inner_exception", None)):
            exc = exc.__cause__ or exc.inner_exception
        return f"{type(exc).__name__}: {exc}"
    return None


def _compiled(fn, group, inner="eager", **config):
    torch._dynamo.reset()
    return torch.compile(fn, backend=PcpBackend(group=group, inner=inner, **config), fullgraph=True)


def _owned(step: int, rank: int, world: int) -> list[int]:
    """Requests this rank owns at ``step``: round-robin over 2 * world requests, moving every step."""
    return [r for r in range(2 * world) if (r + step) % world == rank]


def _slots(step: int, requests: list[int], dtype=torch.int64) -> torch.Tensor:
    return torch.tensor([r * 8 + step % 8 for r in requests], dtype=dtype)


def _x(step: int, requests: list[int]) -> torch.Tensor:
    every = torch.randn(8, W, generator=torch.Generator().manual_seed(step))
    return every[requests]


def case_hidden(rank, world, group, where, op, steps, checks):
    k, v, arg = torch.zeros(NB, BS, 2, 4), torch.zeros(NB, BS, 2, 4), torch.zeros(NB, BS, W)
    HIDDEN[0] = torch.zeros(NB, BS, W)
    model = HiddenWriter(where, getattr(torch.ops.failstate, op))
    step = _compiled(model, group, schedule="deferred", checks=checks)
    for i in range(steps):
        mine = _owned(i, rank, world)
        error = _error(lambda: step(_x(i, mine), _slots(i, mine), torch.tensor(i), k, v, arg))
        if error is not None:
            return {"step": i, "error": error}
    return {"step": None, "error": None}


def case_rebinding(rank, world, group, how):
    k, v = torch.zeros(NB, BS, 2, 4), torch.zeros(NB, BS, 2, 4)
    fn = LastH() if how == "buffer" else closure_step(how)
    step = _compiled(fn, group, schedule="deferred")
    mine = _owned(0, rank, world)
    return {"error": _error(lambda: step(_x(0, mine), _slots(0, mine), k, v)), "caches": _bytes(k, v)}


def case_views(rank, world, group, schedule):
    kbuf, vbuf = torch.zeros(NB * BS * 8), torch.zeros(NB * BS * 8)
    ka, va = kbuf.view(NB, BS, 2, 4), vbuf.view(NB, BS, 2, 4)          # rows of 32 bytes
    kb, vb = kbuf.view(NB, 2 * BS, 1, 4), vbuf.view(NB, 2 * BS, 1, 4)  # rows of 16 bytes
    step = _compiled(two_views, group, schedule=schedule)
    none = torch.tensor([-1])
    # step 0: each rank its own row of ka; step 1: rank 0 writes slot 2 of ka (bytes 64..96), rank 1
    # slot 4 of kb (bytes 64..80): one buffer, two owners
    first = _error(lambda: step(_x(0, [rank]), torch.tensor([rank]), none, ka, va, kb, vb))
    before = _bytes(kbuf, vbuf)
    slots_a, slots_b = (torch.tensor([2]), none) if rank == 0 else (none, torch.tensor([4]))
    error = _error(lambda: step(_x(1, [rank]), slots_a, slots_b, ka, va, kb, vb))
    return {"first": first, "error": error, "before": before, "after": _bytes(kbuf, vbuf)}


def case_two_owners(rank, world, group, schedule):
    k, v = torch.zeros(NB, BS, 2, 4), torch.zeros(NB, BS, 2, 4)
    step = _compiled(kv, group, schedule=schedule)
    first = _error(lambda: step(_x(0, _owned(0, rank, world)), _slots(0, _owned(0, rank, world)), k, v))
    before = _bytes(k, v)
    mine = _owned(1, rank, world)
    slots = _slots(1, mine)
    slots[0] = 9  # both ranks: one row, two owners (the other rows move owner as usual)
    error = _error(lambda: step(_x(1, mine), slots, k, v))
    return {"first": first, "error": error, "before": before, "after": _bytes(k, v)}


def case_int32(rank, world, group, schedule, inner):
    caches = [torch.zeros(NB, BS, W), torch.zeros(NB, BS, W), torch.zeros(NB * BS, W)]
    reference = [torch.zeros_like(c) for c in caches]
    step = _compiled(int32_step, group, inner=inner, schedule=schedule)
    errors = []
    for i in range(3):
        mine = _owned(i, rank, world)
        errors.append(_error(lambda: step(_x(i, mine), _slots(i, mine, torch.int32), *caches)))
        every = list(range(2 * world))
        int32_step(_x(i, every), _slots(i, every, torch.int32), *reference)
    return {"errors": errors, "equal": [torch.equal(c, r) for c, r in zip(caches, reference)],
            "caches": _bytes(*caches)}


def case_refused_on_one_rank(rank, world, group):
    """Rank 1's int32 slot is out of range: its input check refuses the step before its graph
    runs, while rank 0's graph writes its rows and then finds the group aborted (fail-stop, the
    default group): rank 0 writes its rows back."""
    caches = [torch.zeros(NB, BS, W), torch.zeros(NB, BS, W), torch.zeros(NB * BS, W)]
    step = _compiled(int32_step, None, schedule="deferred")
    first = _error(lambda: step(_x(0, _owned(0, rank, world)), _slots(0, _owned(0, rank, world), torch.int32), *caches))
    before = _bytes(*caches)
    mine = _owned(1, rank, world)
    bad = _slots(1, mine, torch.int32)
    if rank == 1:
        bad[-1] = NB * BS
    error = _error(lambda: step(_x(1, mine), bad, *caches))
    return {"first": first, "error": error, "before": before, "after": _bytes(*caches)}


EVERY_CALL = SyncChecks(digest_every=1, digest_outside=False)  # the state is an argument: no scan
CASES = {
    "late_buffer": (case_hidden, "buffer", "late_write", 70, SyncChecks()),
    "once_parameter": (case_hidden, "parameter", "write_once", 70, SyncChecks()),
    "late_dict": (case_hidden, "dict", "late_write", 70, SyncChecks()),
    "once_argument_every_call": (case_hidden, "argument", "write_once", 9, EVERY_CALL),
    "rebind_buffer": (case_rebinding, "buffer"),
    "rebind_nonlocal": (case_rebinding, "nonlocal"),
    "rebind_nonlocal_read": (case_rebinding, "nonlocal_read"),
    "rebind_list": (case_rebinding, "append"),
    "views_deferred": (case_views, "deferred"),
    "views_immediate": (case_views, "immediate"),
    "owners_deferred": (case_two_owners, "deferred"),
    "owners_immediate": (case_two_owners, "immediate"),
    "int32_deferred_inductor": (case_int32, "deferred", "inductor"),
    "int32_immediate_eager": (case_int32, "immediate", "eager"),
    "refused_on_one_rank": (case_refused_on_one_rank,),  # last: it aborts the default group
}


def _rank(rank: int, world: int) -> dict:
    _register_patterns()
    out = {}
    for name, (case, *args) in CASES.items():
        out[name] = case(rank, world, dist.new_group(list(range(world))), *args)
    return out


@pytest.fixture(scope="module")
def outcomes():
    return launch(_rank, 2, timeout_s=400)


pytestmark = pytest.mark.timeout(420)


@pytest.mark.parametrize("case, step, state, how", [
    ("late_buffer", 64, "_buffers['hidden']", "diverged across ranks in this step"),
    ("once_parameter", 64, "_parameters['hidden']", "differed across ranks before this step"),
    ("late_dict", 64, "HIDDEN[0] (outside the graph)", "diverged across ranks in this step"),
    ("once_argument_every_call", FIRST_WRITE, "L['arg']", "diverged across ranks in this step"),
])
def test_undeclared_writes_are_named_wherever_the_state_lives_and_whenever_they_come(outcomes, case, step, state, how):
    for o in outcomes:
        out = o[case]
        assert out["step"] == step and out["error"].startswith("PcpSyncError: "), out
        assert state in out["error"] and how in out["error"], out["error"]


@pytest.mark.parametrize("how, state", [("buffer", "['last_h']"), ("nonlocal", "closure variable 'last'"),
                                        ("nonlocal_read", "closure variable 'last'"), ("list", "L['history']")])
def test_state_rebound_by_the_step_is_refused_before_anything_is_written(outcomes, how, state):
    for o in outcomes:
        out = o[f"rebind_{how}"]
        assert out["error"].startswith("PcpCoverageError: ") and "rebinds state" in out["error"], out["error"]
        assert state in out["error"] and "test_fail_closed_state.py:" in out["error"], out["error"]
        assert out["caches"] == [bytes(len(b)) for b in out["caches"]], "a cache was written"


@pytest.mark.parametrize("schedule", ["deferred", "immediate"])
def test_overlapping_views_of_one_buffer_are_one_cache(outcomes, schedule):
    cases = [o[f"views_{schedule}"] for o in outcomes]
    assert cases[0]["error"] == cases[1]["error"], [c["error"] for c in cases]
    error = cases[0]["error"]
    assert "PcpSyncError" in error and "(rank 0, slot 2)" in error and "(rank 1, slot 4)" in error, error
    assert "overlapping bytes [64, 80) of one buffer" in error, error
    for c in cases:
        assert c["first"] is None and c["after"] == c["before"], "a replica changed although the step was refused"
    assert cases[0]["before"] == cases[1]["before"]


@pytest.mark.parametrize("schedule", ["deferred", "immediate"])
def test_a_refused_two_owner_step_leaves_every_replica_as_before(outcomes, schedule):
    cases = [o[f"owners_{schedule}"] for o in outcomes]
    assert cases[0]["error"] == cases[1]["error"], [c["error"] for c in cases]
    assert "PcpSyncError" in cases[0]["error"] and "slot 9 was written by ranks [0, 1]" in cases[0]["error"]
    for c in cases:
        assert c["first"] is None and c["after"] == c["before"], "a replica changed although the step was refused"
    assert cases[0]["before"] == cases[1]["before"] != [bytes(len(b)) for b in cases[0]["before"]]


@pytest.mark.parametrize("case", ["int32_deferred_inductor", "int32_immediate_eager"])
def test_int32_slot_mappings_are_synchronised_byte_exact(outcomes, case):
    cases = [o[case] for o in outcomes]
    for c in cases:
        assert c["errors"] == [None] * 3, c["errors"]
        assert all(c["equal"]), "a replica differs from one rank's run"
    assert cases[0]["caches"] == cases[1]["caches"]


def test_a_step_one_rank_refuses_leaves_every_replica_as_before(outcomes):
    cases = [o["refused_on_one_rank"] for o in outcomes]
    assert cases[1]["error"].startswith("PcpInputError") and "holds slot 32, outside [-1, 32)" in cases[1]["error"]
    assert cases[0]["error"].startswith("PcpSyncError"), cases[0]["error"]  # its peer aborted the group
    for c in cases:
        assert c["first"] is None and c["after"] == c["before"], "a replica changed although the step was refused"
    assert cases[0]["before"] == cases[1]["before"]


def test_state_outside_the_graph_is_named_by_its_module_path():
    """A cache held as a plain attribute of a layer (vLLM's ``Attention.kv_cache``) is named by the
    layer's path in the model, so the error tells one layer from the next."""
    from pcppass.analysis.live_state import holder_name

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kv_cache = torch.zeros(2)

    model = nn.Sequential(nn.ModuleDict({"attn": Layer()}), Layer())
    assert holder_name(model[0]["attn"].kv_cache) == "Sequential.0.attn.kv_cache"
    assert holder_name(model[1].kv_cache) == "Sequential.1.kv_cache"
