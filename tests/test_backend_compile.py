"""The backend on a small decode step, on 2 gloo ranks, through every inner compiler.

The step writes paged bf16 K/V (``reshape_and_cache_flash``) and a block-split fp8 indexer cache
(``indexer_k_quant_and_cache``), then reads the caches. Every rank runs its own rows (disjoint
slots, padding rows, a rank with zero rows in one step, row counts changing every step) and must
end every step with caches bitwise equal to a single replica that ran all rows itself.

Also: one compile for every row count (dynamic, no recompile per count); Inductor's generated code
writes the caches in place (no copy of a whole cache per step); bad slot inputs are refused before
the graph runs, naming op, cache and source line, with every cache untouched; ranks that traced
different graphs fail with a clear error at compile time (c10d store) and at run time (header).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import pcppass.ops  # noqa: F401
from pcppass.compiler import PcpBackend, SyncChecks
from pcppass.engine.launch import launch
from pcppass.errors import PcpInputError, PcpSyncError

NB, BS, H, D, DI, QBS = 16, 4, 2, 8, 16, 16


def decode_step(x, slots, w, k_cache, v_cache, index_cache, scale):
    k = (x @ w).view(-1, H, D)
    v = torch.tanh(k) * 2.0
    torch.ops.pcppass.reshape_and_cache_flash(k, v, k_cache, v_cache, slots, "auto", scale, scale)
    torch.ops.pcppass.indexer_k_quant_and_cache(x @ w, index_cache, slots, QBS, "ue8m0")
    # reads after the writes (attention would read the cache here)
    return (k_cache.float() * v_cache.float()).sum((1, 2, 3))[: x.shape[0]] + x.sum(1)


def fresh_caches():
    return (torch.zeros(NB, BS, H, D, dtype=torch.bfloat16), torch.zeros(NB, BS, H, D, dtype=torch.bfloat16),
            torch.zeros(NB, BS * (DI + 4 * DI // QBS), dtype=torch.uint8))


def global_step(step: int, world: int, rows: int):
    """The same global rows on every rank: inputs and distinct slots, some padding (-1)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(world * rows, DI, generator=g)
    slots = torch.randperm(NB * BS - BS, generator=g)[: world * rows] + BS  # never the null block
    slots[::3] = -1
    if step == 2:
        slots[rows:2 * rows] = -1  # rank 1 owns no rows this step
    return x, slots


ROWS = [3, 5, 2, 6]


def _bits(caches):
    return [c.view(torch.uint8) if c.element_size() == 1 else c.view(torch.int16) for c in caches]


def _run_backend(rank: int, world: int, inner: str) -> dict:
    torch._dynamo.reset()
    w = torch.randn(DI, DI, generator=torch.Generator().manual_seed(7))
    scale = torch.ones(())
    backend = PcpBackend(schedule="deferred", inner=inner)
    compiled = torch.compile(decode_step, backend=backend, fullgraph=True)
    caches, reference = fresh_caches(), fresh_caches()
    codes: list[str] = []
    for step, rows in enumerate(ROWS):
        x_all, slots_all = global_step(step, world, rows)
        decode_step(x_all, slots_all, w, *reference, scale)
        x = x_all[rank * rows:(rank + 1) * rows].clone()
        slots = slots_all[rank * rows:(rank + 1) * rows].clone()
        for t in (x, slots):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        if inner == "inductor" and step == 0:
            from torch._inductor.utils import run_and_get_code

            _, codes = run_and_get_code(compiled, x, slots, w, *caches, scale)
        else:
            compiled(x, slots, w, *caches, scale)
        for got, want in zip(_bits(caches), _bits(reference)):
            assert torch.equal(got, want), f"rank {rank} step {step}: replica differs from a single replica"
    out = {"compiles": len(backend.reports), "codes": codes,
           "collectives": [r.all_gather_nodes for r in backend.reports]}

    # bad slot inputs: refused before the graph runs, nothing written
    x_all, slots_all = global_step(9, world, 4)
    x, slots = x_all[rank * 4:(rank + 1) * 4].clone(), slots_all[rank * 4:(rank + 1) * 4].clone()
    before = [c.clone() for c in caches]
    errors = []
    for bad in (NB * BS, -2):
        slots_bad = slots.clone()
        slots_bad[1] = bad
        try:
            compiled(x, slots_bad, w, *caches, scale)
        except PcpInputError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(_bits(caches), _bits(before)))
    out["compiles_after_errors"] = len(backend.reports)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("inner", ["eager", "aot_eager", "inductor"])
def test_replicas_exact_under_every_inner_compiler(inner):
    results = launch(_run_backend, 2, inner, timeout_s=280)
    for out in results:
        assert out["compiles"] == 1, "recompiled for a new row count"
        assert out["collectives"] == [1]
        assert len(out["errors"]) == 2, out["errors"]
        for message in out["errors"]:
            assert "pcppass::reshape_and_cache_flash" in message or "pcppass::indexer_k_quant_and_cache" in message
            assert "L['slots']" in message or "l_slots_" in message
            assert "test_backend_compile.py:" in message
        assert "outside [-1, 64)" in out["errors"][0]
        assert out["untouched"] and out["compiles_after_errors"] == 1
    if inner == "inductor":
        code = "\n".join(results[0]["codes"])
        assert "sync_scatter_rows" in code and "reshape_and_cache_flash" in code
        # one scatter op writes all three caches, in place (no clone of the mutated list)
        assert code.count("torch.ops.pcppass.sync_scatter_rows_all.default(") == 1
        assert "sync_scatter_rows.default(" not in code
        # no copy of a whole cache: nothing of a cache's shape is allocated or cloned
        cache_allocs = re.findall(r"empty_strided\w*\(\((16, 4, 2, 8|16, 80)\)", code)
        assert not cache_allocs, cache_allocs
        assert ".clone()" not in code and "aten.clone" not in code


# ---------------------------------------------------------------------------------------------
# Ranks that traced different graphs
# ---------------------------------------------------------------------------------------------


def _scaled_step(factor: float):
    def step(x, slots, w, k_cache, v_cache, index_cache, scale):
        return decode_step(x * factor, slots, w, k_cache, v_cache, index_cache, scale)

    return step


def _mismatched(rank: int, world: int, compile_check: bool) -> str:
    torch._dynamo.reset()
    checks = SyncChecks(compile_fingerprint=compile_check, fingerprint_timeout_s=30)
    # same sync buffers on both ranks, different graphs
    compiled = torch.compile(_scaled_step(2.0 if rank == 0 else 3.0),
                             backend=PcpBackend(schedule="deferred", inner="eager", checks=checks), fullgraph=True)
    w = torch.randn(DI, DI, generator=torch.Generator().manual_seed(7))
    x_all, slots_all = global_step(0, world, 4)
    try:
        compiled(x_all[rank * 4:(rank + 1) * 4].clone(), slots_all[rank * 4:(rank + 1) * 4].clone(), w,
                 *fresh_caches(), torch.ones(()))
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        return f"compile: {exc.inner_exception}"
    except PcpSyncError as exc:
        return f"run: {exc}"
    finally:
        if dist.is_initialized():  # a sync failure aborts the group (fail-stop)
            dist.barrier()
    return "no error"


@pytest.mark.timeout(120)
def test_ranks_with_different_graphs_fail_loudly_at_compile_and_run_time():
    for compile_check, when in ((True, "compile"), (False, "run")):
        for message in launch(_mismatched, 2, compile_check, timeout_s=100):
            assert message.startswith(when), message
            assert "ranks traced different graphs" in message
