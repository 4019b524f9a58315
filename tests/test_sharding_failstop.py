"""Writes no graph sync can see, and failures on one rank only (2 gloo ranks).

Each case runs on its own freshly initialised world group (a fail-stop aborts the group):

* aten in-place writes (``setitem`` / ``index_put_`` / ``index_copy_``) with padding slot -1: Python
  indexing makes -1 the last row, so the step is refused before it runs, caches untouched;
* a graph break (``@torch.compiler.disable`` between graphs): refused, or replicated on request;
* state rebound outside the graph (a cache dict entry, a model buffer): refused when compiled;
* a recompile after warm-up that would run replicated while the engine shards decode: refused
  before it runs, replicas still equal;
* bad slots on one rank only, a recompile on one rank only: every rank fails within seconds
  (the failing rank aborts the group; it stays alive, as a server would), none waits for the
  process-group timeout;
* model buffers are part of the verified state: a buffer that diverges is named.
"""

from __future__ import annotations

import datetime
import time
import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pcppass.ops  # noqa: F401
from pcppass.compiler import PcpBackend, SyncChecks
from pcppass.engine.launch import free_port, launch
from pcppass.sync import fingerprint
from pcppass.cli.run_driver import STEP_COUNT, RunConfig, RunResult, compare, rank_main, reference_run

NB, BS, H, D = 8, 4, 2, 8
#: process-group timeout of every case: a peer that waited for it would take this long
PG_TIMEOUT_S = 120
#: how long a failing rank stays alive after its error (a serving process would not exit)
LINGER_S = 12


def _fresh_world(rank: int, world: int, port: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    fingerprint._ordinals.clear()  # compile ordinals belong to the store of the old group
    torch._dynamo.reset()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))


def _error(exc: BaseException) -> BaseException:
    inner = getattr(exc, "inner_exception", None)
    return inner if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed) and inner else exc


def _outcome(fn, *args, linger: bool = False) -> dict:
    """Run ``fn``; its error type and message, and how long it took to fail (or to return)."""
    t0 = time.monotonic()
    try:
        fn(*args)
        return {"error": None, "elapsed": time.monotonic() - t0}
    except Exception as exc:
        err = _error(exc)
        out = {"error": type(err).__name__, "message": str(err), "elapsed": time.monotonic() - t0}
    if linger:
        time.sleep(LINGER_S)
    return out


def _kv(x, slots, k_cache, v_cache):
    k = x.reshape(-1, H, D)
    torch.ops.pcppass.reshape_and_cache_flash(k, k * 2, k_cache, v_cache, slots, "auto",
                                              torch.ones(()), torch.ones(()))


# -- aten in-place writes with padding slot -1 -------------------------------------------------

def setitem_step(x, slots, cache):
    cache.view(-1, H * D)[slots] = x
    return x.sum(1)


def index_put_step(x, slots, cache):
    cache.view(-1, H * D).index_put_((slots,), x)
    return x.sum(1)


def index_copy_step(x, slots, cache):
    cache.index_copy_(0, slots, x)
    return x.sum(1)


ATEN_STEPS = {"setitem": (setitem_step, (NB, BS, H * D)), "index_put_": (index_put_step, (NB, BS, H * D)),
              "index_copy_": (index_copy_step, (NB * BS, H * D))}


def _aten_padding(rank: int, family: str) -> dict:
    step, shape = ATEN_STEPS[family]
    compiled = torch.compile(step, backend=PcpBackend(schedule="deferred", inner="eager"), fullgraph=True)
    cache = torch.zeros(shape)
    x = torch.randn(3, H * D, generator=torch.Generator().manual_seed(rank))
    # a step without padding runs and syncs (positive control)
    compiled(x, torch.tensor([1, 2, 3]) + 8 * rank, cache)
    gathered = [torch.empty_like(cache) for _ in range(2)]
    dist.all_gather(gathered, cache)
    before = cache.clone()
    out = _outcome(compiled, x, torch.tensor([9, 10, -1]) + torch.tensor([8 * rank, 8 * rank, 0]), cache)
    out.update(synced=torch.equal(gathered[0], gathered[1]), untouched=torch.equal(cache, before))
    return out


# -- graph break -----------------------------------------------------------------------------

@torch.compiler.disable
def _eager_write(cache, slots, x):
    cache.view(-1, H * D)[slots] = x


def graph_break_step(x, slots, caches):
    _kv(x, slots, caches["k"], caches["v"])
    _eager_write(caches["extra"], slots, x)  # GRAPH-BREAK-LINE
    return x.sum(1)


def _graph_break(rank: int, on_uncovered: str) -> dict:
    backend = PcpBackend(schedule="deferred", inner="eager", on_uncovered=on_uncovered, name=f"break-{on_uncovered}")
    compiled = torch.compile(graph_break_step, backend=backend)
    caches = {"k": torch.zeros(NB, BS, H, D), "v": torch.zeros(NB, BS, H, D), "extra": torch.zeros(NB, BS, H * D)}
    x = torch.randn(2, H * D, generator=torch.Generator().manual_seed(rank))
    out = _outcome(compiled, x, torch.tensor([5, 9]) + 2 * rank, caches)
    out["modes"] = [r.mode for r in backend.reports]
    return out


# -- state rebound outside the graph -----------------------------------------------------------

class RebindingModel(nn.Module):
    """Writes K/V through the covered op, then rebinds ``caches["extra"]`` or a buffer."""

    def __init__(self, rebind: str):
        super().__init__()
        self.rebind = rebind
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, input_ids, positions, meta, caches):
        x = torch.sin(input_ids[:, None].float() + torch.arange(H * D)) + positions[:, None]
        slots = meta["slots"]
        _kv(x, slots, caches["k"], caches["v"])
        if self.rebind == "cache":
            caches["extra"] = caches["extra"].index_copy(0, slots.clamp(min=0), x)
        elif self.rebind == "buffer":
            self.steps = self.steps + x.shape[0]
        return x


def _rebind(rank: int, rebind: str) -> dict:
    from pcppass.sharded import ShardedRunner

    model = RebindingModel(rebind)
    runner = ShardedRunner(model, inner="eager")
    caches = {"k": torch.zeros(NB, BS, H, D), "v": torch.zeros(NB, BS, H, D), "extra": torch.zeros(NB * BS, H * D)}
    ids = torch.tensor([3, 4]) + rank
    return _outcome(runner, ids, ids, {"slots": torch.tensor([5, 6]) + 2 * rank}, caches, "decode")


# -- Dynamo running a sharded step eagerly ------------------------------------------------------

def _eager_run(rank: int, how: str) -> dict:
    """After a sharded step, the next one under an eager compiler stance (refused before it runs)
    or run by a graph that is not the backend's (named after it ran)."""
    from pcppass.sharded import ShardedRunner

    model = RebindingModel("none")
    runner = ShardedRunner(model, inner="eager")
    runner.sharding = True  # what warm-up decides for a covered model
    caches = {"k": torch.zeros(NB, BS, H, D), "v": torch.zeros(NB, BS, H, D)}
    ids = torch.tensor([3, 4]) + rank
    first = _outcome(runner, ids, ids, {"slots": torch.tensor([5, 6]) + 2 * rank}, caches, "decode")
    before = [c.clone() for c in caches.values()]
    step = (runner, ids, ids, {"slots": torch.tensor([9, 10]) + 2 * rank}, caches, "decode")
    if how == "stance":
        with torch.compiler.set_stance("force_eager"):
            out = _outcome(*step)
    else:
        runner.step._compiled["decode"] = model  # Dynamo skipping the frame: the model runs as Python
        out = _outcome(*step)
    out.update(first=first, untouched=all(torch.equal(b, c) for b, c in zip(before, caches.values())))
    return out


# -- a recompile after warm-up that would run replicated ---------------------------------------

def build_recompiling_llama() -> nn.Module:
    """Tiny Llama whose forward updates a counter buffer only for steps of more than 4 rows: the
    warm-up graph (2 rows) is covered, the graph Dynamo compiles for a larger step is not."""
    from pcppass.models import build_model

    torch.manual_seed(0)
    model = build_model("llama", "tiny")
    model.register_buffer("big_steps", torch.zeros((), dtype=torch.int64))
    plain_forward = type(model).forward

    def forward(self, input_ids, positions, meta, caches):
        if input_ids.shape[0] > 4:
            self.big_steps.add_(1)
        return plain_forward(self, input_ids, positions, meta, caches)

    model.forward = forward.__get__(model)
    return model


def _recompile_replicated(rank: int) -> dict:
    from pcppass.engine.workload import RequestSpec
    from pcppass.sharded import ShardedRunner, sharded_engine

    model = build_recompiling_llama()
    runner = ShardedRunner(model, inner="eager", on_uncovered="replicate")
    engine = sharded_engine(model, runner, world=2, rank=rank, num_blocks=64, max_num_seqs=16,
                            record_digests=True)
    g = torch.Generator().manual_seed(1)
    for i in range(12):
        engine.add_request(RequestSpec(req_id=i, prompt=tuple(torch.randint(0, 100, (5,), generator=g).tolist()),
                                       max_new_tokens=6, arrival_step=0))
    out = _outcome(engine.run, 40)
    out.update(policy=engine.policy, digests=engine.cache_digests(),
               modes={kind: [r.mode for r in b.reports] for kind, b in runner.backends.items()})
    return out


# -- failures on one rank only ------------------------------------------------------------------

def _one_rank_bad_slots(rank: int) -> dict:
    compiled = torch.compile(lambda x, s, k, v: _kv(x, s, k, v) or x.sum(1),
                             backend=PcpBackend(schedule="deferred", inner="eager", name="asym"), fullgraph=True)
    caches = (torch.zeros(NB, BS, H, D), torch.zeros(NB, BS, H, D))
    compiled(torch.randn(2, H * D), torch.tensor([4, 5]) + 2 * rank, *caches)
    slots = torch.tensor([12, 13]) + 2 * rank
    if rank == 0:
        slots[1] = NB * BS + 3
    return _outcome(compiled, torch.randn(2, H * D), slots, *caches, linger=rank == 0)


def _one_rank_recompile(rank: int) -> dict:
    checks = SyncChecks(fingerprint_timeout_s=6)
    compiled = torch.compile(lambda x, s, k, v: _kv(x, s, k, v) or x.sum(1),
                             backend=PcpBackend(schedule="deferred", inner="eager", checks=checks, name="alone"), fullgraph=True)
    caches = (torch.zeros(NB, BS, H, D), torch.zeros(NB, BS, H, D))
    compiled(torch.randn(2, H * D), torch.tensor([4, 5]) + 2 * rank, *caches)
    # rank 1's input arrives transposed: a stride guard fails there only, and rank 1 recompiles
    x = torch.randn(H * D, 2).t() if rank == 1 else torch.randn(2, H * D)
    return _outcome(compiled, x, torch.tensor([12, 13]) + 2 * rank, *caches, linger=rank == 1)


# -- model buffers are verified state -----------------------------------------------------------

def build_row_summing_llama() -> nn.Module:
    """Tiny Llama that adds its own rows' token ids to a buffer: an uncovered write that differs
    across ranks when decode is sharded (run with on_uncovered="unsafe_ignore")."""
    from pcppass.models import build_model

    torch.manual_seed(0)
    model = build_model("llama", "tiny")
    model.register_buffer("token_sum", torch.zeros((), dtype=torch.int64))
    plain_forward = type(model).forward

    def forward(self, input_ids, positions, meta, caches):
        self.token_sum.add_(input_ids.sum())
        return plain_forward(self, input_ids, positions, meta, caches)

    model.forward = forward.__get__(model)
    return model


BUFFER_RUN = RunConfig(model="test_sharding_failstop:build_row_summing_llama", steps=8, num_requests=4,
                       on_uncovered="unsafe_ignore")


# ----------------------------------------------------------------------------------------------

CASES = [
    ("buffer_digest", lambda rank: rank_main(rank, 2, BUFFER_RUN)),
    *[(f"aten_{family}", lambda rank, f=family: _aten_padding(rank, f)) for family in ATEN_STEPS],
    ("break_raise", lambda rank: _graph_break(rank, "raise")),
    ("break_replicate", lambda rank: _graph_break(rank, "replicate")),
    ("rebind_cache", lambda rank: _rebind(rank, "cache")),
    ("rebind_buffer", lambda rank: _rebind(rank, "buffer")),
    ("eager_stance", lambda rank: _eager_run(rank, "stance")),
    ("eager_graph", lambda rank: _eager_run(rank, "graph")),
    ("recompile_replicated", _recompile_replicated),
    ("one_rank_bad_slots", _one_rank_bad_slots),
    ("one_rank_recompile", _one_rank_recompile),
]


def _run_cases(rank: int, world: int, ports: list[int]) -> dict:
    warnings.filterwarnings("ignore")
    out = {}
    for (name, case), port in zip(CASES, ports):
        _fresh_world(rank, world, port)
        out[name] = case(rank)
    return out


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    ports = [free_port() for _ in CASES]
    return launch(_run_cases, 2, ports, timeout_s=400)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("family", list(ATEN_STEPS))
def test_aten_write_with_padding_slot_is_refused_before_it_runs(outcomes, family):
    for rank, out in enumerate(o[f"aten_{family}"] for o in outcomes):
        assert out["synced"], "the step without padding did not leave equal replicas"
        assert out["error"] == "PcpInputError", out
        message = out["message"]
        assert f"rank {rank}" in message and "holds slot -1" in message
        assert "LAST row" in message and "Python indexing" in message and family in message
        assert "test_sharding_failstop.py:" in message
        assert out["untouched"], "a refused step wrote the cache"


@pytest.mark.timeout(420)
def test_graph_break_is_refused_or_replicated(outcomes):
    for out in (o["break_raise"] for o in outcomes):
        assert out["error"] == "PcpCoverageError", out
        assert "graph break at" in out["message"] and "GRAPH-BREAK-LINE" in out["message"]
        assert "test_sharding_failstop.py:" in out["message"]
    for out in (o["break_replicate"] for o in outcomes):
        assert out["error"] is None, out
        assert out["modes"] and set(out["modes"]) == {"replicated"}, out["modes"]


@pytest.mark.timeout(420)
def test_state_rebound_outside_the_graph_is_named(outcomes):
    """Refused when the step is compiled, before it runs (the backend reads Dynamo's side effects)."""
    for o in outcomes:
        cache, buffer = o["rebind_cache"], o["rebind_buffer"]
        assert cache["error"] == "PcpCoverageError" and "L['caches']['extra']" in cache["message"], cache
        assert buffer["error"] == "PcpCoverageError" and "_buffers" in buffer["message"], buffer
        assert "['steps']" in buffer["message"], buffer
        assert "rebinds state" in cache["message"] and "caches']['k']" not in cache["message"]


@pytest.mark.timeout(420)
def test_step_dynamo_would_run_eagerly_is_refused_before_it_writes(outcomes):
    for rank, out in enumerate(o["eager_stance"] for o in outcomes):
        assert out["first"]["error"] is None, out["first"]
        assert out["error"] == "PcpSyncError", out
        assert "compiler stance is 'force_eager'" in out["message"] and "Nothing was written" in out["message"]
        assert out["untouched"], "the refused step wrote the caches"


@pytest.mark.timeout(420)
def test_step_run_without_the_backends_graph_is_named(outcomes):
    for out in (o["eager_graph"] for o in outcomes):
        assert out["first"]["error"] is None, out["first"]
        assert out["error"] == "PcpSyncError", out
        assert "ran without its compiled graph" in out["message"], out["message"]
        assert not out["untouched"]  # it ran: the check names what happened, after the fact


@pytest.mark.timeout(420)
def test_recompile_that_would_run_replicated_is_refused_before_it_runs(outcomes):
    runs = [o["recompile_replicated"] for o in outcomes]
    for out in runs:
        assert out["policy"] == "round_robin"  # warm-up chose sharded decode
        assert out["error"] == "PcpSyncError", out
        assert "recompile" in out["message"] and "big_steps" in out["message"]
    assert runs[0]["digests"] == runs[1]["digests"], "replicas diverged before the refusal"


@pytest.mark.timeout(420)
def test_bad_slots_on_one_rank_stop_both_ranks_promptly(outcomes):
    bad, good = outcomes[0]["one_rank_bad_slots"], outcomes[1]["one_rank_bad_slots"]
    assert bad["error"] == "PcpInputError" and "rank 0" in bad["message"] and "outside" in bad["message"]
    assert good["error"] == "PcpSyncError" and "rank 1" in good["message"], good
    # rank 0 stays alive LINGER_S after its error: rank 1 stopped because of the abort, not the
    # process-group timeout nor rank 0's exit
    assert good["elapsed"] < LINGER_S - 3, good["elapsed"]


@pytest.mark.timeout(420)
def test_recompile_on_one_rank_stops_both_ranks_promptly(outcomes):
    waiting, alone = outcomes[0]["one_rank_recompile"], outcomes[1]["one_rank_recompile"]
    assert alone["error"] == "PcpSyncError" and "did not compile" in alone["message"], alone
    assert waiting["error"] == "PcpSyncError" and "rank 0" in waiting["message"], waiting
    assert alone["elapsed"] < 6 + 5 and waiting["elapsed"] < 6 + LINGER_S - 3, (alone, waiting)


@pytest.mark.timeout(420)
def test_verification_covers_model_buffers(outcomes):
    ranks = [o["buffer_digest"] for o in outcomes]
    assert all("buffer:token_sum" in step for r in ranks for step in r.digests)
    v = compare(reference_run(BUFFER_RUN), ranks)
    assert not v.ok
    assert {name for _, name, _ in v.divergent} == {"buffer:token_sum"}, v.divergent


def test_verification_fails_when_ranks_ran_different_step_counts():
    def result(rank: int, steps: int) -> RunResult:
        return RunResult(rank, 2, {0: [1, 2]}, [{"k": "aa"}] * steps, ["decode"] * steps,
                         [{}] * steps, [[1, 1]] * steps)

    reference = replace(result(0, 3), world=1)
    assert compare(reference, [result(0, 3), result(1, 3)]).ok
    v = compare(reference, [result(0, 3), result(1, 2)])
    assert not v.ok and v.step_counts == [3, 2]
    assert v.divergent == [(2, STEP_COUNT, ["rank 0: 3 steps", "rank 1: 2 steps"])]
