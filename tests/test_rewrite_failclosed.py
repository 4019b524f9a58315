"""Sync preconditions and run-time state checks, on 2 gloo ranks (one launch, one subgroup per case:
a case whose error aborts its group leaves the next case's group alone).

* the default schedule on a step where a rank reads another rank's rows in the same step: exact;
* a re-run op that mutates its own per-row input: replicas re-run on what the owner's op read
  (deferred and immediate);
* a re-run site reading a cache written before and after it: refused under the deferred schedule,
  exact under the immediate one;
* two ranks writing one slot in one step: every rank raises the same error naming slot, ranks,
  op, state and line, and every replica is as it was before the step, also when a re-run site
  splits the collective's scatters (eager and Inductor);
* state rebound by the step (a module buffer, a cache dict entry): refused when compiled, naming
  the state and the line;
* a custom op whose ``mutates_args`` omits the cache it writes: the state digest names the cache
  (and, with the digest off, the replicas silently differ: the check is what catches it);
* slot mappings the graph computes, bad on one rank only (out of range for a cache-write op, -1 for
  an aten index write): every rank refuses the step with the same error before anything is
  written, and every replica is unchanged.
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

NB, BS, W = 4, 4, 8


# -- ops and patterns -------------------------------------------------------------------------

@torch.library.custom_op("failclosed::store_then_scale", mutates_args=("memory", "x"))
def store_then_scale(x: torch.Tensor, memory: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    s = slot_mapping[keep]
    memory[s // BS, s % BS] = torch.tanh(x[keep])
    x.mul_(2.0)  # the op updates its own per-row input


@store_then_scale.register_fake
def _(x, memory, slot_mapping):
    return None


@torch.library.custom_op("failclosed::save_state", mutates_args=("state",))
def save_state(x: torch.Tensor, state: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    s = slot_mapping[keep]
    state[s // BS, s % BS] = x[keep]


@save_state.register_fake
def _(x, state, slot_mapping):
    return None


@torch.library.custom_op("failclosed::compress", mutates_args=("memory",))
def compress(state: torch.Tensor, memory: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    s = slot_mapping[keep]
    memory[s // BS, s % BS] = state[s // BS, s % BS] * 2.0  # reads the state rows


@compress.register_fake
def _(state, memory, slot_mapping):
    return None


@torch.library.custom_op("failclosed::undeclared_write", mutates_args=())
def undeclared_write(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    keep = slot_mapping >= 0
    s = slot_mapping[keep]
    cache[s // BS, s % BS] = x[keep]  # writes a cache its schema does not declare
    return x * 2.0


@undeclared_write.register_fake
def _(x, cache, slot_mapping):
    return torch.empty_like(x)


def _register_patterns() -> None:
    rows = {"x": 0, "slot_mapping": 0}
    register_pattern(WritePattern(name="failclosed.store_then_scale", ops=("failclosed::store_then_scale",),
                                  caches=(CacheRole("memory", slots="slot_mapping", layout=PagedRows()),),
                                  row_args=rows, recipe=Recipe.RERUN), replace=True)
    register_pattern(WritePattern(name="failclosed.save_state", ops=("failclosed::save_state",),
                                  caches=(CacheRole("state", slots="slot_mapping", layout=PagedRows()),),
                                  row_args=rows), replace=True)
    register_pattern(WritePattern(name="failclosed.compress", ops=("failclosed::compress",),
                                  caches=(CacheRole("memory", slots="slot_mapping", layout=PagedRows()),),
                                  row_args={"slot_mapping": 0}, recipe=Recipe.RERUN), replace=True)


# -- steps ------------------------------------------------------------------------------------

def rerun_scales_its_input(h, slots, memory):
    x = h * 3.0
    torch.ops.failclosed.store_then_scale(x, memory, slots)
    return x.sum(1)


def rewritten_around_rerun(h, slots, state, memory):
    torch.ops.failclosed.save_state(h, state, slots)
    torch.ops.failclosed.compress(state, memory, slots)  # reads the rows just saved
    torch.ops.failclosed.save_state(h + 1.0, state, slots)  # ... and overwrites them
    return h.sum(1)


def reads_every_rank_rows(x, slots, all_slots, k_cache, v_cache):
    k = x.view(-1, 2, 4)
    scale = torch.ones(())
    torch.ops.pcppass.reshape_and_cache_flash(k, k, k_cache, v_cache, slots, "auto", scale, scale)
    return k_cache[all_slots // BS, all_slots % BS].sum((1, 2))  # prefill-style read of other ranks' rows


def kv_step(x, slots, k_cache, v_cache):
    k = x.view(-1, 2, 4)
    scale = torch.ones(())
    torch.ops.pcppass.reshape_and_cache_flash(k, k * 2, k_cache, v_cache, slots, "auto", scale, scale)
    return x.sum(1)


def split_by_rerun(h, slots, state, memory, k_cache, v_cache):
    """Three sites in one deferred collective, whose scatters the re-run site splits in two
    batches: the state rows (before the re-run), the re-run, the K/V rows (after it)."""
    torch.ops.failclosed.save_state(h, state, slots)
    torch.ops.failclosed.compress(state, memory, slots)
    return kv_step(h, slots, k_cache, v_cache)


def under_declared(x, slots, k_cache, v_cache, hidden_cache):
    y = torch.ops.failclosed.undeclared_write(x, hidden_cache, slots)
    return kv_step(y, slots, k_cache, v_cache)


def computed_kv_slots(x, base, offset, k_cache, v_cache):
    slots = base + offset  # computed in the graph: no input check sees it
    return kv_step(x, slots, k_cache, v_cache)


def computed_index_rows(x, positions, cache):
    rows = positions - 1  # -1 for position 0: the LAST row of an aten index write
    cache.index_copy_(0, rows, x)
    return x.sum(1)


class Rebinding(nn.Module):
    def __init__(self, what: str):
        super().__init__()
        self.what = what
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x, slots, caches):
        kv_step(x, slots, caches["k"], caches["v"])
        if self.what == "buffer":
            self.steps = self.steps + 1
        elif self.what == "dict":
            caches["extra"] = caches["extra"] + x.sum()
        else:  # a new shape every step: the next call is a new graph (a recompile)
            caches["extra"] = torch.cat([caches["extra"], x.sum(0, keepdim=True)[:, 0]])
        return x.sum(1)


# -- one rank ---------------------------------------------------------------------------------

def _bytes(*tensors: torch.Tensor) -> list[bytes]:
    """Exact bytes of each tensor: results cross the process boundary as plain data (a tensor
    would be shared through its worker, which may have exited by the time it is read)."""
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]


def _rows(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[2 * rank:2 * rank + 2].clone()


def _compiled(fn, group, **config):
    torch._dynamo.reset()
    return torch.compile(fn, backend=PcpBackend(group=group, inner="eager", **config), fullgraph=True)


def _error(call) -> str | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - Dynamo wraps compile-time errors
        while not isinstance(exc, PcpError) and (exc.__cause__ or getattr(exc, "inner_exception", None)):
            exc = exc.__cause__ or exc.inner_exception
        return f"{type(exc).__name__}: {exc}"
    return None


H = torch.randn(4, W, generator=torch.Generator().manual_seed(0))
SLOTS = torch.tensor([1, 2, 5, 6])


def case_default_schedule(rank, group):
    caches = torch.zeros(NB, BS, 2, 4), torch.zeros(NB, BS, 2, 4)
    out = _compiled(reads_every_rank_rows, group)(_rows(H, rank), _rows(SLOTS, rank), SLOTS, *caches)
    reference = reads_every_rank_rows(H, SLOTS, SLOTS, torch.zeros(NB, BS, 2, 4), torch.zeros(NB, BS, 2, 4))
    return {"equal": torch.equal(out, reference)}


def case_mutated_rerun_input(rank, group, schedule):
    memory = torch.zeros(NB, BS, W)
    _compiled(rerun_scales_its_input, group, schedule=schedule)(_rows(H, rank), _rows(SLOTS, rank), memory)
    reference = torch.zeros(NB, BS, W)
    reference[SLOTS // BS, SLOTS % BS] = torch.tanh(H * 3.0)
    return {"equal": torch.equal(memory, reference)}


def case_replay_hazard(rank, group, schedule):
    state, memory = torch.zeros(NB, BS, W), torch.zeros(NB, BS, W)
    step = _compiled(rewritten_around_rerun, group, schedule=schedule)
    error = _error(lambda: step(_rows(H, rank), _rows(SLOTS, rank), state, memory))
    reference = torch.zeros(NB, BS, W)
    reference[SLOTS // BS, SLOTS % BS] = H * 2.0
    return {"error": error, "equal": torch.equal(memory, reference)}


def case_conflict(rank, group):
    caches = torch.zeros(NB, BS, 2, 4), torch.zeros(NB, BS, 2, 4)
    slots = torch.tensor([5, 9]) if rank == 0 else torch.tensor([5, 3])  # slot 5 twice
    step = _compiled(kv_step, group, schedule="deferred")
    return {"error": _error(lambda: step(_rows(H, rank), slots, *caches)), "caches": _bytes(*caches)}


def case_conflict_split(rank, group, inner):
    """A slot written by both ranks in a collective split by a re-run site, after a step that
    filled rows 5, 9 and 3: the verdict refuses before any batch or re-run, every rank writes back
    what its own sites wrote, so every cache is as before the refused step."""
    caches = torch.zeros(NB, BS, W), torch.zeros(NB, BS, W), torch.zeros(NB, BS, 2, 4), torch.zeros(NB, BS, 2, 4)
    torch._dynamo.reset()
    step = torch.compile(split_by_rerun, backend=PcpBackend(group=group, inner=inner, schedule="deferred"),
                         fullgraph=True)
    first = _error(lambda: step(_rows(H, rank), torch.tensor([5, 9]) if rank == 0 else torch.tensor([-1, 3]), *caches))
    before = _bytes(*caches)
    slots = torch.tensor([5, 9]) if rank == 0 else torch.tensor([5, 3])  # slot 5 twice
    error = _error(lambda: step(_rows(H, rank) + 1.0, slots, *caches))
    return {"first": first, "error": error, "before": before, "caches": _bytes(*caches)}


def case_rebinding(rank, group, what):
    model = Rebinding(what)
    caches = {"k": torch.zeros(NB, BS, 2, 4), "v": torch.zeros(NB, BS, 2, 4),
              "extra": torch.zeros(1) if what == "grow" else torch.zeros(())}
    torch._dynamo.reset()
    backend = PcpBackend(group=group, inner="eager", schedule="deferred")
    step = torch.compile(model, backend=backend, fullgraph=True)
    errors, synced = [], []
    for i in range(2):
        errors.append(_error(lambda: step(_rows(H, rank), _rows(SLOTS, rank) + 8 * i, caches)))
        synced.append(_bytes(caches["k"], caches["v"]))
    state = model.steps if what == "buffer" else caches["extra"]
    return {"errors": errors, "synced": synced, "rebound": _bytes(state.reshape(-1)), "compiles": len(backend.reports)}


def case_under_declared(rank, group, digest):
    caches = torch.zeros(NB, BS, 2, 4), torch.zeros(NB, BS, 2, 4), torch.zeros(NB, BS, W)
    step = _compiled(under_declared, group, schedule="deferred", checks=SyncChecks(state_digest=digest))
    error = _error(lambda: step(_rows(H, rank), _rows(SLOTS, rank), *caches))
    return {"error": error, "hidden_cache": _bytes(caches[2])}


def case_computed_slots(rank, group, kind):
    if kind == "kv":
        caches = [torch.zeros(NB, BS, 2, 4), torch.zeros(NB, BS, 2, 4)]
        step = _compiled(computed_kv_slots, group, schedule="deferred")
        good = lambda: step(_rows(H, rank), _rows(SLOTS, rank), torch.tensor(0), *caches)  # noqa: E731
        bad_offset = torch.tensor(NB * BS if rank == 1 else 0)  # rank 1 only: out of range
        bad = lambda: step(_rows(H, rank), _rows(SLOTS, rank), bad_offset, *caches)  # noqa: E731
    else:
        caches = [torch.zeros(NB * BS, W)]
        step = _compiled(computed_index_rows, group, schedule="deferred")
        good = lambda: step(_rows(H, rank), _rows(SLOTS, rank) + 1, *caches)  # noqa: E731
        bad_positions = _rows(SLOTS, rank) + 1 if rank == 0 else torch.tensor([0, 3])  # rank 1: row -1
        bad = lambda: step(_rows(H, rank), bad_positions, *caches)  # noqa: E731
    good_error = _error(good)
    after_good = _bytes(*caches)
    return {"good_error": good_error, "after_good": after_good, "error": _error(bad), "caches": _bytes(*caches)}


CASES = {
    "default_schedule": (case_default_schedule,),
    "mutated_deferred": (case_mutated_rerun_input, "deferred"),
    "mutated_immediate": (case_mutated_rerun_input, "immediate"),
    "hazard_deferred": (case_replay_hazard, "deferred"),
    "hazard_immediate": (case_replay_hazard, "immediate"),
    "conflict": (case_conflict,),
    "conflict_split_eager": (case_conflict_split, "eager"),
    "conflict_split_inductor": (case_conflict_split, "inductor"),
    "rebind_buffer": (case_rebinding, "buffer"),
    "rebind_dict": (case_rebinding, "dict"),
    "rebind_grow": (case_rebinding, "grow"),
    "undeclared_digest": (case_under_declared, True),
    "undeclared_no_digest": (case_under_declared, False),
    "computed_kv": (case_computed_slots, "kv"),
    "computed_index": (case_computed_slots, "index"),
}


def _rank(rank: int, world: int) -> dict:
    _register_patterns()
    out = {}
    for name, (case, *args) in CASES.items():
        group = dist.new_group(list(range(world)))
        out[name] = case(rank, group, *args)
    return out


@pytest.fixture(scope="module")
def outcomes():
    return launch(_rank, 2, timeout_s=280)


pytestmark = pytest.mark.timeout(300)


def test_default_schedule_is_exact_when_ranks_read_each_others_rows(outcomes):
    assert all(o["default_schedule"]["equal"] for o in outcomes)


@pytest.mark.parametrize("schedule", ["deferred", "immediate"])
def test_rerun_op_that_mutates_its_input_is_replayed_on_what_it_read(outcomes, schedule):
    assert all(o[f"mutated_{schedule}"]["equal"] for o in outcomes)


def test_rerun_reading_rows_overwritten_later_is_refused_deferred_and_exact_immediate(outcomes):
    for o in outcomes:
        error = o["hazard_deferred"]["error"]
        assert error is not None and "deferred schedule would re-run" in error, error
        assert "failclosed::compress" in error and "failclosed::save_state" in error
        assert o["hazard_immediate"]["error"] is None and o["hazard_immediate"]["equal"]


def test_conflicting_slot_raises_everywhere_and_replicas_stay_identical(outcomes):
    errors = [o["conflict"]["error"] for o in outcomes]
    assert errors[0] == errors[1], errors
    assert "PcpSyncError" in errors[0] and "slot 5 was written by ranks [0, 1]" in errors[0]
    assert "pcppass::reshape_and_cache_flash" in errors[0] and "L['k_cache']" in errors[0]
    assert "test_rewrite_failclosed.py:" in errors[0]
    for a, b in zip(outcomes[0]["conflict"]["caches"], outcomes[1]["conflict"]["caches"]):
        assert a == b == bytes(len(a)), "a replica changed although the step was refused"


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_conflict_in_a_collective_split_by_a_rerun_leaves_every_cache_as_before_the_step(outcomes, inner):
    cases = [o[f"conflict_split_{inner}"] for o in outcomes]
    assert all(c["first"] is None for c in cases), [c["first"] for c in cases]
    assert cases[0]["error"] == cases[1]["error"], [c["error"] for c in cases]
    error = cases[0]["error"]
    assert "PcpSyncError" in error and "slot 5 was written by ranks [0, 1]" in error, error
    assert "failclosed::save_state" in error and "pcppass::reshape_and_cache_flash" in error, error
    assert "every replica holds what it held before the step" in error, error
    for c in cases:  # the refused step's own writes were undone, no other rank's row applied
        for name, before, after in zip(("state", "memory", "k_cache", "v_cache"), c["before"], c["caches"]):
            assert before == after, f"{name} changed although the step was refused"
    assert cases[0]["before"] == cases[1]["before"]


@pytest.mark.parametrize("what, state", [("buffer", "_buffers"), ("dict", "['extra']"),
                                         ("grow", "['extra']")])
def test_state_rebound_by_the_step_is_refused_when_compiled(outcomes, what, state):
    """The step that would rebind state (Dynamo stores what it computed after the graph) is
    refused when compiled, on every rank, before it runs: its cache writes are absent and every
    state is as before, on every rank."""
    cases = [o[f"rebind_{what}"] for o in outcomes]
    for o in cases:
        first, second = o["errors"]
        for error in (first, second):
            assert error is not None and error.startswith("PcpCoverageError: ") and "rebinds state" in error, error
            assert state in error and "test_rewrite_failclosed.py:" in error, error
        assert o["synced"][0] == o["synced"][1] == [bytes(len(b)) for b in o["synced"][0]], "a cache was written"
    assert cases[0]["rebound"] == cases[1]["rebound"]  # untouched: what it was before the step


def test_under_declared_write_is_named_by_the_state_digest(outcomes):
    for o in outcomes:
        error = o["undeclared_digest"]["error"]
        assert error is not None and "diverged" in error and "hidden_cache" in error, error
        assert o["undeclared_no_digest"]["error"] is None
    # negative control: without the digest the replicas silently differ
    assert outcomes[0]["undeclared_no_digest"]["hidden_cache"] != outcomes[1]["undeclared_no_digest"]["hidden_cache"]


@pytest.mark.parametrize("kind, op, bad", [("kv", "pcppass::reshape_and_cache_flash", "outside [-1, 16)"),
                                           ("index", "index_copy_", "holds slot -1, outside [0, 16)")])
def test_computed_slots_are_refused_on_every_rank_before_any_write(outcomes, kind, op, bad):
    errors = [o[f"computed_{kind}"]["error"] for o in outcomes]
    assert errors[0] == errors[1], errors  # every rank refuses the same step
    assert "PcpInputError" in errors[0] and errors[0].count("rank 1:") == 1 and bad in errors[0]
    assert op in errors[0] and "test_rewrite_failclosed.py:" in errors[0]
    for o in outcomes:
        assert o[f"computed_{kind}"]["good_error"] is None
        for before, after in zip(o[f"computed_{kind}"]["after_good"], o[f"computed_{kind}"]["caches"]):
            assert before == after, "a replica changed although the step was refused"
    for a, b in zip(outcomes[0][f"computed_{kind}"]["caches"], outcomes[1][f"computed_{kind}"]["caches"]):
        assert a == b
