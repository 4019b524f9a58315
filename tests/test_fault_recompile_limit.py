"""Dynamo running part of a sharded step eagerly, where no replica sync sees it (2 gloo ranks).

Without ``fullgraph=True`` Dynamo can run code of a compiled step eagerly instead of handing it to
the backend; an eager decode step writes its rows on its own rank only. Each way must end in an
error before anything is written, with every replica still equal:

* past ``torch._dynamo.config.recompile_limit``: with ``fullgraph=True`` (how ``ShardedRunner``
  and the README compile a step) Dynamo raises ``FailOnRecompileLimitHit``; without it Dynamo would
  run the frame eagerly and never call pcppass, so pcppass sets
  ``torch._dynamo.config.fail_on_recompile_limit_hit`` from the first graph it compiles (the test
  clears it first: the backend must set it itself);
* ``torch._dynamo.config.suppress_errors``: Dynamo would turn any refusal (here an uncovered
  ``index_add_``) into an eager run, so the backend refuses every graph when the step runs
  (``PcpSyncError``), which Dynamo does not catch;
* a frame Dynamo skips (a graph break in a loop): it runs eagerly and compiles the functions it
  calls as graphs of their own; such a graph is refused as not the whole step
  (``PcpCoverageError`` naming the skipped caller).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pcppass.ops  # noqa: F401
from pcppass.compiler import PcpBackend
from pcppass.engine.launch import launch
from pcppass.errors import PcpError

NB, BS, H, D = 8, 4, 2, 8


def kv_step(x, slots, k_cache, v_cache):
    k = x.reshape(-1, H, D)
    torch.ops.pcppass.reshape_and_cache_flash(k, k * 2, k_cache, v_cache, slots, "auto", torch.ones(()),
                                              torch.ones(()))
    return x.sum(1)


def uncovered_step(x, slots, k_cache, v_cache):
    k_cache.view(-1, H, D).index_add_(0, slots, x.reshape(-1, H, D))  # no pattern covers index_add_
    return x.sum(1)


def step_with_a_skipped_frame(x, slots, k_cache, v_cache):
    for _ in range(1):
        torch._dynamo.graph_break()  # a graph break in a loop: Dynamo skips this frame
        x = x + kv_step(x, slots, k_cache, v_cache)[:, None]
    return x


def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 8
    torch._dynamo.config.fail_on_recompile_limit_hit = False
    torch._dynamo.config.suppress_errors = False


def _caches() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(NB, BS, H, D), torch.zeros(NB, BS, H, D)


def _outcome(world: int, backend: PcpBackend, caches, run) -> dict:
    outcome = {"error": None, "message": ""}
    try:
        run()
    except Exception as exc:
        inner = getattr(exc, "inner_exception", None)
        error = inner if isinstance(inner, PcpError) else exc
        outcome.update(error=type(error).__name__, message=str(error))
    outcome["compiles"] = len(backend.reports)
    gathered = [torch.empty_like(caches[0]) for _ in range(world)]
    dist.all_gather(gathered, caches[0])
    outcome["replicas_equal"] = torch.equal(gathered[0], gathered[1])
    return outcome


def _over_the_limit(rank: int, world: int, fullgraph: bool) -> dict:
    _fresh_dynamo()
    torch._dynamo.config.recompile_limit = 1
    backend = PcpBackend(inner="eager")
    step = torch.compile(kv_step, backend=backend, fullgraph=fullgraph)
    caches = _caches()
    step(torch.randn(2, H * D), torch.tensor([4, 5]) + 2 * rank, *caches)
    # a transposed input fails a stride guard: a second compile, over the limit
    return _outcome(world, backend, caches,
                    lambda: step(torch.randn(H * D, 2).t(), torch.tensor([12, 13]) + 2 * rank, *caches))


def _suppressed_errors(rank: int, world: int) -> dict:
    _fresh_dynamo()
    torch._dynamo.config.suppress_errors = True
    try:
        backend = PcpBackend(inner="eager")
        caches = _caches()
        step = torch.compile(uncovered_step, backend=backend)  # refused: Dynamo would run it eagerly
        outcome = _outcome(world, backend, caches,
                           lambda: step(torch.randn(2, H * D), torch.tensor([4, 5]) + 2 * rank, *caches))
    finally:
        torch._dynamo.config.suppress_errors = False
    outcome["written"] = bool(caches[0].any())
    return outcome


def _skipped_frame(rank: int, world: int) -> dict:
    _fresh_dynamo()
    backend = PcpBackend(inner="eager")
    caches = _caches()
    step = torch.compile(step_with_a_skipped_frame, backend=backend)
    outcome = _outcome(world, backend, caches,
                       lambda: step(torch.randn(2, H * D), torch.tensor([4, 5]) + 2 * rank, *caches))
    outcome["written"] = bool(caches[0].any())
    return outcome


def _all(rank: int, world: int) -> dict:
    return {"fullgraph": _over_the_limit(rank, world, True), "no fullgraph": _over_the_limit(rank, world, False),
            "suppress_errors": _suppressed_errors(rank, world), "skipped frame": _skipped_frame(rank, world)}


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return launch(_all, 2, timeout_s=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fullgraph", ["fullgraph", "no fullgraph"])
def test_step_over_the_recompile_limit_fails_before_writing(outcomes, fullgraph):
    for o in (r[fullgraph] for r in outcomes):
        assert o["error"] == "FailOnRecompileLimitHit" and o["compiles"] == 1, o
        assert o["replicas_equal"], o


@pytest.mark.timeout(240)
def test_suppress_errors_refuses_the_step_before_it_writes(outcomes):
    for o in (r["suppress_errors"] for r in outcomes):
        assert o["error"] == "PcpSyncError" and "suppress_errors is on" in o["message"], o
        assert not o["written"] and o["replicas_equal"], o


@pytest.mark.timeout(240)
def test_graph_of_a_frame_called_by_a_skipped_frame_is_refused(outcomes):
    for o in (r["skipped frame"] for r in outcomes):
        assert o["error"] == "PcpCoverageError", o
        assert "graph of kv_step, called by step_with_a_skipped_frame" in o["message"], o
        assert "Dynamo skipped and ran eagerly" in o["message"], o
        assert not o["written"] and o["replicas_equal"], o
