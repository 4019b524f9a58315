"""The library route (``pcppass.compile``, ``pcppass.backend``) around what Dynamo and the ranks do
outside pcppass's graph, on 2 gloo ranks.

Every step moves ownership: request ``q`` writes its own slot each step and is owned by rank
``(q + step) % 2``, so a replica that missed a row differs from the single-rank reference. Each case
runs on a freshly initialised world group (a refusal aborts the group) and ends by comparing the
caches bitwise across ranks. Expected, before anything is written:

* ``pcppass.compile`` runs decode steps (deferred) and mixed steps (immediate) exactly as one rank,
  ``step(...)`` also a step whose ranks read each other's rows (``step.decode(...)`` on it, the
  control, does not: deferred is the caller's declaration, call by call);
* a step Dynamo would run eagerly (``set_stance("force_eager")`` mid-run, ``"eager_on_recompile"``
  with a new row count) is refused with ``PcpSyncError``, the caches untouched;
* a graph break anywhere in the step (inside a loop, a step that only calls a
  ``@torch.compiler.disable`` helper, such a helper on the first statement, an ``autograd.Function``
  with ``mark_dirty``) is refused while tracing with ``PcpGraphBreakError``, nothing written;
* a graph compiled through ``pcppass.backend`` before ``init_process_group`` (one rank, no sync) is
  refused when Dynamo reuses it on two ranks;
* ranks whose row counts make Dynamo specialise differently (0 rows of a cache on one rank, 1 on
  the other) fail at compile time on every rank, naming the inputs, instead of a SIGABRT in gloo;
  ranks running one graph dynamic in the row count with different counts are refused on every
  rank before it runs, naming the counts;
* one rank failing outside pcppass (Dynamo's ``FailOnRecompileLimitHit`` on that rank only; a user
  error between steps under ``pcppass.fail_stop()``), hanging (SIGSTOP, sockets open) or leaving
  the group ends its peer's step within seconds, naming it, while the failing rank stays alive.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import pcppass
import pcppass.ops  # noqa: F401
from pcppass.checks import SyncChecks
from pcppass.compiler import PcpBackend
from pcppass.engine.launch import free_port, launch
from pcppass.errors import PcpError
from pcppass.sync import fingerprint

NB, BS, H, D = 8, 4, 2, 8
REQUESTS = 4
#: process-group timeout of every case: a peer that waited for it would take this long
PG_TIMEOUT_S = 60
#: a failing rank stays alive after its error (a serving process would not exit) until its peer
#: has its outcome, at most this long
LINGER_S = 20
#: a peer's error must come this long after the failure at most (far below LINGER_S and the
#: process-group timeout)
BOUND_S = 10
#: a directory both ranks see, for "the peer has its outcome" flags (set by _run_cases)
_FLAGS = {"dir": ""}
FAST_WATCH = SyncChecks(liveness_timeout_s=2.0, liveness_interval_s=0.25)


def kv_step(x, slots, k_cache, v_cache):
    k = x.reshape(-1, H, D)
    torch.ops.pcppass.reshape_and_cache_flash(k, k * 2, k_cache, v_cache, slots, "auto",
                                              torch.ones(()), torch.ones(()))
    return x.sum(1)


def break_in_loop(x, slots, k_cache, v_cache):
    for _ in range(1):
        torch._dynamo.graph_break()  # Dynamo skips the frame: the loop's write would run eagerly
        k = x.reshape(-1, H, D)
        torch.ops.pcppass.reshape_and_cache_flash(k, k * 2, k_cache, v_cache, slots, "auto",
                                                  torch.ones(()), torch.ones(()))
    return x.sum(1)


@torch.compiler.disable
def _eager_kv(x, slots, k_cache, v_cache):
    kv_step(x, slots, k_cache, v_cache)


def only_a_disabled_helper(x, slots, k_cache, v_cache):
    _eager_kv(x, slots, k_cache, v_cache)  # the whole step eager: no graph, no backend call
    return x


def disabled_helper_first(x, slots, k_cache, v_cache):
    _eager_kv(x, slots, k_cache, v_cache)  # the eager write runs before any graph
    return x.sum(1) * 2


class _WriteAndMarkDirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k_cache, v_cache, x, slots):
        kv_step(x, slots, k_cache, v_cache)
        ctx.mark_dirty(k_cache, v_cache)
        return k_cache, v_cache

    @staticmethod
    def backward(ctx, *grads):
        return None, None, None, None


def mark_dirty_first(x, slots, k_cache, v_cache):
    _WriteAndMarkDirty.apply(k_cache, v_cache, x, slots)
    return x.sum(1)


def reads_every_rank_rows(x, slots, all_slots, k_cache, v_cache):
    kv_step(x, slots, k_cache, v_cache)
    return k_cache.view(-1, H, D)[all_slots].sum((1, 2))  # a prefill-style read of every rank's rows


def two_caches_step(x, slots, xb, slots_b, k_cache, v_cache, kb_cache, vb_cache):
    kv_step(x, slots, k_cache, v_cache)
    kv_step(xb, slots_b, kb_cache, vb_cache)  # rank 0 has 0 rows here, rank 1 has 1
    return x.sum(1)


# -- rows, caches, outcomes ------------------------------------------------------------------------

def _rows(step: int, rank: int | None, padding: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of ``step`` (all rows for ``rank=None``): request q owned by (q + step) % 2,
    writing slot 8 q + step, its values a function of (q, step); ``padding`` rows of slot -1."""
    mine = [q for q in range(REQUESTS) if rank is None or (q + step) % 2 == rank]
    x = torch.stack([torch.sin(torch.arange(H * D) * (q + 1) + step) for q in mine])
    slots = torch.tensor([8 * q + step for q in mine])
    if padding:
        x = torch.cat([x, torch.zeros(padding, H * D)])
        slots = torch.cat([slots, torch.full((padding,), -1)])
    return x, slots


def _caches(n: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(NB, BS, H, D) for _ in range(n)]


def _replicas_equal(caches: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
    flat = torch.cat([c.reshape(-1) for c in caches])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat, group=group)
    return torch.equal(gathered[0], gathered[1])


def _reference(steps: int) -> list[torch.Tensor]:
    caches = _caches()
    for step in range(steps):
        kv_step(*_rows(step, None), *caches)
    return caches


def _try(fn, *args) -> dict:
    t0 = time.monotonic()
    try:
        fn(*args)
        return {"error": None, "elapsed": time.monotonic() - t0}
    except Exception as exc:
        inner = getattr(exc, "inner_exception", None)
        err = inner if isinstance(inner, PcpError) else exc
        return {"error": type(err).__name__, "message": str(err), "elapsed": time.monotonic() - t0}


def _fresh_world(rank: int, port: int, before_init=None):
    if dist.is_initialized():
        dist.destroy_process_group()
    fingerprint._ordinals.clear()  # compile ordinals belong to the store of the old group
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 8
    warm = before_init() if before_init is not None else None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    return warm


# -- cases: what Dynamo does around the step --------------------------------------------------------

def _sharded_like_one_rank(rank: int) -> dict:
    step = pcppass.compile(kv_step, inner="eager")
    caches = _caches()
    for i in range(3):
        step.decode(*_rows(i, rank), *caches)  # deferred: one collective
    step(*_rows(3, rank), *caches)  # immediate
    reference = _reference(4)
    return {"equal": _replicas_equal(caches),
            "like_one_rank": all(torch.equal(c, r) for c, r in zip(caches, reference)),
            "backends": {kind: [r.mode for r in b.reports] for kind, b in step.backends.items()}}


def _rows_read_across_ranks(rank: int) -> dict:
    """``step(...)`` on a step whose ranks read each other's rows is exact; the same step declared
    decode-only (``step.decode``) reads rows before they arrive (the control: why the deferred
    schedule is a declaration, call by call)."""
    step = pcppass.compile(reads_every_rank_rows, inner="eager")
    caches, reference = _caches(), _caches()
    exact = []
    for i, run in enumerate((step, step.decode)):
        every_slot = _rows(i, None)[1]
        out = run(*_rows(i, rank), every_slot, *caches)
        exact.append(torch.equal(out, reads_every_rank_rows(*_rows(i, None), every_slot, *reference)))
    return {"any_step_exact": exact[0], "declared_decode_exact": exact[1], "equal": _replicas_equal(caches)}


def _eager_stance(rank: int, stance: str) -> dict:
    step = pcppass.compile(kv_step, inner="eager")
    caches = _caches()
    first = _try(step.decode, *_rows(0, rank), *caches)
    before = [c.clone() for c in caches]
    # eager_on_recompile: a new row count would recompile, so Dynamo would run the step eagerly
    rows = _rows(1, rank, padding=1 if stance == "eager_on_recompile" else 0)
    with torch.compiler.set_stance(stance):
        out = _try(step.decode, *rows, *caches)
    out.update(first=first, untouched=all(torch.equal(b, c) for b, c in zip(before, caches)))
    return out


def _graph_break(rank: int, fn) -> dict:
    step = pcppass.compile(fn, inner="eager")
    caches = _caches()
    out = _try(step.decode, *_rows(0, rank), *caches)
    out["written"] = any(bool(c.any()) for c in caches)
    if out["error"] is None:  # traced whole (no break on this torch): the step must be synced
        out["as_one_rank"] = all(torch.equal(c, r) for c, r in zip(caches, _reference(1)))
    return out


def _compiled_before_init(rank: int, port: int) -> dict:
    caches = _caches()

    def warm_up():  # before the process group exists: one rank, a graph with no sync
        compiled = torch.compile(kv_step, backend=pcppass.backend, fullgraph=True)
        compiled(torch.zeros(2, H * D), torch.tensor([-1, -1]), *caches)  # padding rows
        return compiled

    compiled = _fresh_world(rank, port, warm_up)
    out = _try(compiled, *_rows(1, rank), *caches)
    out.update(written=any(bool(c.any()) for c in caches), equal=_replicas_equal(caches))
    return out


def _zero_and_one_rows(rank: int) -> dict:
    """Rank 0 has no row for the second cache pair, rank 1 one: Dynamo specialises both sizes."""
    compiled = torch.compile(two_caches_step, backend=PcpBackend(schedule="deferred", inner="eager"),
                             fullgraph=True)
    caches = _caches(4)
    x, slots = _rows(0, rank)
    xb, slots_b = _rows(1, None)
    out = _try(compiled, x, slots, xb[:rank], slots_b[:rank] + 16, *caches)
    out.update(written=any(bool(c.any()) for c in caches))
    return out


def _unequal_rows_one_dynamic_graph(rank: int) -> dict:
    """Both ranks run 2 rows, then 3 (Dynamo recompiles one graph dynamic in the row count), then
    rank 0 runs 2 rows and rank 1 3 (a padding row) through that one graph."""
    step = pcppass.compile(kv_step, inner="eager")
    caches = _caches()
    warm = [_try(step.decode, *_rows(0, rank), *caches),
            _try(step.decode, *_rows(1, rank, padding=1), *caches)]
    before = [c.clone() for c in caches]
    out = _try(step.decode, *_rows(2, rank, padding=rank), *caches)
    out.update(warm=warm, graphs=len(step.backends["decode"].reports),
               untouched=all(torch.equal(b, c) for b, c in zip(before, caches)))
    return out


# -- cases: a rank failing outside pcppass's graph --------------------------------------------------

def _flag(name: str) -> str:
    return os.path.join(_FLAGS["dir"], name)


def _linger(rank: int, failing: int, case: str) -> None:
    """The failing rank stays alive until its peer has its outcome (at most LINGER_S): a peer
    released by the failing process's exit would not prove anything; the peer says it is done."""
    if rank != failing:
        open(_flag(case), "w").close()
        return
    deadline = time.monotonic() + LINGER_S
    while not os.path.exists(_flag(case)) and time.monotonic() < deadline:
        time.sleep(0.1)


def _one_rank_recompile_limit(rank: int) -> dict:
    """Rank 1's second step fails a guard there only, past the recompile limit: Dynamo raises
    before any pcppass code, while rank 0 runs its step."""
    torch._dynamo.config.recompile_limit = 1
    step = pcppass.compile(kv_step, inner="eager", checks=FAST_WATCH)
    caches = _caches()
    step.decode(*_rows(0, rank), *caches)
    x, slots = _rows(1, rank)
    if rank == 1:
        x = x.t().contiguous().t()  # other strides: a guard fails on rank 1 only
    out = _try(step.decode, x, slots, *caches)
    _linger(rank, 1, "recompile_limit")
    return out


def _user_error_between_steps(rank: int) -> dict:
    step = pcppass.compile(kv_step, inner="eager", checks=FAST_WATCH)
    caches = _caches()
    step.decode(*_rows(0, rank), *caches)
    t0 = time.monotonic()
    try:
        with pcppass.fail_stop():
            if rank == 1:
                raise ValueError("the caller's own code failed between two steps")
            step.decode(*_rows(1, rank), *caches)
        out = {"error": None}
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    out["elapsed"] = time.monotonic() - t0
    _linger(rank, 1, "user_error")
    return out


def _hung_peer(rank: int) -> dict:
    """Rank 1 stops (SIGSTOP: its sockets stay open) between two steps, until rank 0 has its
    outcome (a helper process resumes it after LINGER_S otherwise). Rank 0's step waits in the
    sync all-gather."""
    compiled = torch.compile(kv_step, backend=PcpBackend(schedule="deferred", inner="eager", checks=FAST_WATCH),
                             fullgraph=True)
    caches = _caches()
    compiled(*_rows(0, rank), *caches)
    if rank == 1:
        with open(_flag("hung.pid"), "w") as f:
            f.write(str(os.getpid()))
        subprocess.Popen(["sh", "-c", f"sleep {LINGER_S}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        return {"error": None, "resumed": True}
    out = _try(compiled, *_rows(1, rank), *caches)
    with open(_flag("hung.pid")) as f:
        os.kill(int(f.read()), signal.SIGCONT)
    return out


def _peer_left(rank: int) -> dict:
    """Rank 1 destroys its group after one step (its run ended) and stays alive; rank 0 runs a
    second step."""
    compiled = torch.compile(kv_step, backend=PcpBackend(schedule="deferred", inner="eager", checks=FAST_WATCH),
                             fullgraph=True)
    caches = _caches()
    compiled(*_rows(0, rank), *caches)
    if rank == 1:
        dist.destroy_process_group()
        _linger(rank, 1, "peer_left")
        return {"error": None}
    out = _try(compiled, *_rows(1, rank), *caches)
    _linger(rank, 1, "peer_left")
    return out


CASES = [
    ("sharded", _sharded_like_one_rank),
    ("rows_read_across_ranks", _rows_read_across_ranks),
    ("force_eager", lambda rank: _eager_stance(rank, "force_eager")),
    ("eager_on_recompile", lambda rank: _eager_stance(rank, "eager_on_recompile")),
    ("break_in_loop", lambda rank: _graph_break(rank, break_in_loop)),
    ("only_a_disabled_helper", lambda rank: _graph_break(rank, only_a_disabled_helper)),
    ("disabled_helper_first", lambda rank: _graph_break(rank, disabled_helper_first)),
    ("mark_dirty_first", lambda rank: _graph_break(rank, mark_dirty_first)),
    ("zero_and_one_rows", _zero_and_one_rows),
    ("unequal_rows_one_dynamic_graph", _unequal_rows_one_dynamic_graph),
    ("recompile_limit_on_one_rank", _one_rank_recompile_limit),
    ("user_error_between_steps", _user_error_between_steps),
    ("peer_left", _peer_left),
    ("hung_peer", _hung_peer),  # last: the survivor's abandoned gloo collective outlives the case
]


def _run_cases(rank: int, world: int, ports: list[int], flags: str) -> dict:
    warnings.filterwarnings("ignore")
    _FLAGS["dir"] = flags
    out = {"compiled_before_init": _compiled_before_init(rank, ports[0])}
    for (name, case), port in zip(CASES, ports[1:]):
        _fresh_world(rank, port)
        out[name] = case(rank)
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict]:
    ports = [free_port() for _ in range(len(CASES) + 1)]
    return launch(_run_cases, 2, ports, str(tmp_path_factory.mktemp("flags")), timeout_s=300)


@pytest.mark.timeout(320)
def test_library_step_shards_exactly_like_one_rank(outcomes):
    for o in (r["sharded"] for r in outcomes):
        assert o["equal"] and o["like_one_rank"], o
        assert o["backends"] == {"mixed": ["sharded"], "decode": ["sharded"]}, o


@pytest.mark.timeout(320)
def test_any_step_is_exact_and_deferred_is_declared_call_by_call(outcomes):
    for o in (r["rows_read_across_ranks"] for r in outcomes):
        assert o["any_step_exact"] and o["equal"], o
        # the control: the step that reads other ranks' rows, declared decode-only, reads them stale
        assert not o["declared_decode_exact"], o


@pytest.mark.timeout(320)
@pytest.mark.parametrize("stance", ["force_eager", "eager_on_recompile"])
def test_step_dynamo_would_run_eagerly_is_refused_before_it_writes(outcomes, stance):
    for o in (r[stance] for r in outcomes):
        assert o["first"]["error"] is None, o["first"]
        assert o["error"] == "PcpSyncError" and f"compiler stance is '{stance}'" in o["message"], o
        assert "Nothing was written" in o["message"] and o["untouched"], o


@pytest.mark.timeout(320)
@pytest.mark.parametrize("case", ["break_in_loop", "only_a_disabled_helper", "disabled_helper_first",
                                  "mark_dirty_first"])
def test_graph_break_anywhere_is_refused_before_any_write(outcomes, case):
    for o in (r[case] for r in outcomes):
        if case == "mark_dirty_first" and o["error"] is None:
            # torch 2.11's Dynamo traces this autograd.Function into the graph (no break): then
            # every replica must hold every rank's rows, as one rank running the whole step does
            assert o["as_one_rank"], o
            continue
        assert o["error"] == "PcpGraphBreakError", o
        assert "nothing was written" in o["message"] and "test_library_step.py" in o["message"], o
        assert not o["written"], o


@pytest.mark.timeout(320)
def test_graph_compiled_before_the_group_existed_is_refused(outcomes):
    for o in (r["compiled_before_init"] for r in outcomes):
        assert o["error"] == "PcpSyncError" and "compiled for one rank" in o["message"], o
        assert "now runs on 2 ranks" in o["message"], o
        assert not o["written"] and o["equal"], o


@pytest.mark.timeout(320)
def test_ranks_specialising_row_counts_differently_fail_at_compile_time(outcomes):
    for o in (r["zero_and_one_rows"] for r in outcomes):
        assert o["error"] == "PcpSyncError" and "ranks traced different graphs" in o["message"], o
        assert "Inputs traced differently" in o["message"] and "l_xb_" in o["message"], o
        assert not o["written"], o


@pytest.mark.timeout(320)
def test_ranks_running_one_dynamic_graph_with_different_row_counts_are_refused_before_it_runs(outcomes):
    for o in (r["unequal_rows_one_dynamic_graph"] for r in outcomes):
        assert [w["error"] for w in o["warm"]] == [None, None] and o["graphs"] == 2, o
        assert o["error"] == "PcpSyncError" and "different row counts" in o["message"], o
        assert "rank 0 2, rank 1 3" in o["message"] and "test_library_step.py" in o["message"], o
        assert "nothing was written" in o["message"] and o["untouched"], o


@pytest.mark.timeout(320)
@pytest.mark.parametrize("case", ["recompile_limit_on_one_rank", "user_error_between_steps"])
def test_an_error_on_one_rank_outside_pcppass_stops_its_peer_promptly(outcomes, case):
    waiting, failing = outcomes[0][case], outcomes[1][case]
    assert failing["error"] in ("PcpSyncError", "ValueError"), failing
    assert waiting["error"] == "PcpSyncError" and "Rank 1 failed first" in waiting["message"], waiting
    # rank 1 stays alive until rank 0 has its outcome: rank 0 stopped because of its abort
    assert waiting["elapsed"] < BOUND_S, waiting


@pytest.mark.timeout(320)
def test_a_hung_peer_ends_the_wait_within_the_liveness_timeout(outcomes):
    waiting = outcomes[0]["hung_peer"]
    assert waiting["error"] == "PcpSyncError", waiting
    assert "Rank 1 stopped responding" in waiting["message"], waiting
    assert waiting["elapsed"] < BOUND_S, waiting  # the hung rank is resumed only after that


@pytest.mark.timeout(320)
def test_a_peer_that_left_the_group_is_named(outcomes):
    waiting = outcomes[0]["peer_left"]
    assert waiting["error"] == "PcpSyncError", waiting
    assert "Rank 1 left the process group" in waiting["message"] and "after 1 sharded step" in waiting["message"]
    assert waiting["elapsed"] < BOUND_S, waiting
