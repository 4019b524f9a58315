"""``PcpSyncPass`` as a graph pass: op counts of the emitted sync, its ``uuid()``, and the graph
stages it refuses.

* Op counts: a step with two copy-rows sites on the same caches around a re-run site gets one
  collective under the deferred schedule (the scatters split at the re-run, which must see the
  earlier rows synced), one per site under the immediate schedule.
* ``uuid()``: equal in two fresh interpreters (different hash seeds, started outside the
  checkout), different when a pattern is registered or changed or a configuration field changes.
* Stages: a post-grad graph (installed as Inductor's ``post_grad_custom_post_pass``) and the
  pieces of a split graph (as vLLM's piecewise backend makes) are refused with an error naming
  the stage and the supported route.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.fx.passes.split_module import split_module

import pcppass.ops  # noqa: F401
from pcppass import PcpSyncPass
from pcppass.errors import PcpGraphStageError
from pcppass.registry import register_pattern
from pcppass.rewrite.insert import insert_sync
from pcppass.rewrite.plan import plan_sync
from pcppass.analysis import find_state_writes
from pcppass.spec import CacheRole, PagedRows, Recipe, WritePattern


@torch.library.custom_op("passtest::write_memory", mutates_args=("memory",))
def write_memory(x: torch.Tensor, memory: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    s = slot_mapping[keep]
    memory[s // memory.shape[1], s % memory.shape[1]] = torch.tanh(x[keep])


@write_memory.register_fake
def _(x, memory, slot_mapping):
    return None


register_pattern(WritePattern(
    name="passtest.write_memory", ops=("passtest::write_memory",),
    caches=(CacheRole("memory", slots="slot_mapping", layout=PagedRows()),),
    row_args={"x": 0, "slot_mapping": 0}, recipe=Recipe.RERUN,
), replace=True)


def step(x, slots, k_cache, v_cache, memory):
    scale = torch.ones(())
    k = x.view(-1, 2, 4)
    torch.ops.pcppass.reshape_and_cache_flash(k, k * 2, k_cache, v_cache, slots, "auto", scale, scale)
    h = x * 3.0
    torch.ops.passtest.write_memory(h, memory, slots)
    later = slots + 0  # computed: the deferred sync sends a snapshot
    torch.ops.pcppass.reshape_and_cache_flash(k + 1, k, k_cache, v_cache, later, "auto", scale, scale)
    return h.sum(1) + k_cache.float().sum()


def _inputs():
    return (torch.randn(3, 8), torch.tensor([1, -1, 6]), torch.zeros(4, 4, 2, 4), torch.zeros(4, 4, 2, 4),
            torch.zeros(4, 4, 8))


class _Seen(Exception):
    pass


def _dynamo_graph(fn, inputs, on_graph):
    """``on_graph(gm)`` on the graph Dynamo hands a backend, inside that backend (nothing runs)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(on_graph(gm))
        raise _Seen

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    except Exception:  # Dynamo wraps what the backend raised
        if not seen:
            raise
    return seen[0]


def _counts(gm):
    ops = {
        "pack": torch.ops.pcppass.sync_pack.default,
        "all_gather": torch.ops._c10d_functional.all_gather_into_tensor.default,
        "wait": torch.ops._c10d_functional.wait_tensor.default,
        "header": torch.ops.pcppass.sync_read_header.default,
        "scatter": torch.ops.pcppass.sync_scatter_rows_all.default,
        "snapshot": torch.ops.pcppass.sync_snapshot.default,
        "verdict": torch.ops.pcppass.sync_verdict.default,
        "unpack": torch.ops.pcppass.sync_unpack.default,
        "clone": torch.clone,
    }
    return {name: len(gm.graph.find_nodes(op="call_function", target=t)) for name, t in ops.items()}


@pytest.mark.parametrize("schedule, expected", [
    # deferred: a snapshot before the first write, and one before the last site (its slots are
    # computed after the first write); one verdict before the first scatter; the re-run site
    # splits the one collective's scatters in two batches
    ("deferred", {"pack": 1, "all_gather": 1, "wait": 1, "header": 1, "scatter": 2, "snapshot": 2,
                  "verdict": 1, "unpack": 2, "clone": 2}),
    ("immediate", {"pack": 3, "all_gather": 3, "wait": 3, "header": 3, "scatter": 2, "snapshot": 0,
                   "verdict": 3, "unpack": 2, "clone": 0}),
])
def test_sync_op_counts_and_order(schedule, expected):
    def rewrite(gm):
        plan = plan_sync([w for w in find_state_writes(gm) if w.covered])
        result = insert_sync(gm, plan, schedule=schedule, group_name="0", world_size=2)
        return gm, result

    gm, result = _dynamo_graph(step, _inputs(), rewrite)
    assert _counts(gm) == expected
    assert result.collectives == (1 if schedule == "deferred" else 3) and result.sites == 3
    order = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    scatter = torch.ops.pcppass.sync_scatter_rows_all.default
    rerun = torch.ops.passtest.write_memory
    first_scatter, second_scatter = [i for i, t in enumerate(order) if t is scatter]
    reruns = [i for i, t in enumerate(order) if t in (rerun, rerun.default)]
    assert len(reruns) == 2  # the owner's call and the re-run on every rank's rows
    assert first_scatter < reruns[1] < second_scatter
    verdicts = [i for i, t in enumerate(order) if t is torch.ops.pcppass.sync_verdict.default]
    assert verdicts[0] < first_scatter  # decided before anything is applied
    snapshots = [i for i, t in enumerate(order) if t is torch.ops.pcppass.sync_snapshot.default]
    if schedule == "deferred":  # before the first write / the last site
        assert snapshots[0] < reruns[0] < snapshots[1] < verdicts[0]


# ---------------------------------------------------------------------------------------------
# uuid
# ---------------------------------------------------------------------------------------------

UUIDS = r"""
import json
import pcppass.models  # installed with the package: importable outside the checkout
from pcppass import IndexedDim, PagedRows, PcpSyncPass, SyncChecks, CacheRole, WritePattern, register_pattern

def pattern(layout):
    return WritePattern(name="uuidtest", ops=("uuidtest::w",),
                        caches=(CacheRole("c", slots="s", layout=layout),))

out = {"default": PcpSyncPass().uuid(), "again": PcpSyncPass().uuid(),
       "schedule": PcpSyncPass(schedule="deferred").uuid(),
       "checks": PcpSyncPass(checks=SyncChecks(slot_conflicts=False)).uuid(),
       "whole_step": PcpSyncPass(whole_step=True).uuid()}
register_pattern(pattern(PagedRows()))
out["registered"] = PcpSyncPass().uuid()
register_pattern(pattern(IndexedDim(dim=1)), replace=True)
out["changed"] = PcpSyncPass().uuid()
print(json.dumps(out))
"""


def _uuids(seed: str, tmp_path) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    done = subprocess.run([sys.executable, "-c", UUIDS], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_uuid_is_stable_across_processes_and_tracks_patterns_and_configuration(tmp_path):
    first, second = _uuids("1", tmp_path), _uuids("2", tmp_path)
    assert first == second
    assert first["default"] == first["again"]
    assert len(set(first.values())) == len(first) - 1  # every change gives a new uuid


# ---------------------------------------------------------------------------------------------
# Graph stages
# ---------------------------------------------------------------------------------------------


def test_post_grad_graph_is_refused_naming_the_stage():
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=PcpSyncPass(), fx_graph_cache=False):
        with pytest.raises(Exception) as info:
            torch.compile(step, backend="inductor", fullgraph=True)(*_inputs())
    error = info.value
    while not isinstance(error, PcpGraphStageError) and error is not None:
        error = error.__cause__ or getattr(error, "inner_exception", None)
    assert isinstance(error, PcpGraphStageError), info.value
    assert "post-grad" in str(error) and "backend=pcppass.backend" in str(error)


def _pieces(gm):
    """Split like a piecewise backend: a new piece at the re-run op."""
    piece = {"n": 0}

    def which(node):
        if node.op == "call_function" and "write_memory" in str(node.target):
            piece["n"] = 1
        return piece["n"]

    split = split_module(gm, None, which, keep_original_order=True)
    return split.submod_0, split.submod_1


@pytest.fixture
def two_fake_ranks():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def test_pieces_of_a_split_graph_are_refused(two_fake_ranks):
    def try_pieces(gm):
        errors = []
        for piece in _pieces(gm):
            try:
                PcpSyncPass().apply(piece)
                errors.append(None)
            except PcpGraphStageError as exc:
                errors.append(str(exc))
        return errors

    first, second = _dynamo_graph(step, _inputs(), try_pieces)
    assert first is not None and "cannot tell that this graph is the whole step" in first
    assert second is not None and "carry no Dynamo source" in second


def test_whole_dynamo_graph_is_rewritten_by_the_pass(two_fake_ranks):
    sync_pass = PcpSyncPass(schedule="deferred")
    result = _dynamo_graph(step, _inputs(), lambda gm: (sync_pass(gm.graph), sync_pass.last_result)[1])
    # the step computes one slot mapping: the ranks check it together (one small all-gather) before
    # the first write, then the deferred sync's one collective
    assert result.mode == "sharded" and result.rewrite.collectives == 2 and result.rewrite.sites == 3


def test_graph_break_detection_fails_closed(two_fake_ranks):
    """Where Dynamo does not say whether the graph is the whole step (here: the pass runs after
    the compile, with no Dynamo frame to read), the pass refuses to shard unless the caller vouches
    for it (whole_step=True)."""
    from pcppass.errors import PcpCoverageError

    def copy_of(gm):
        return copy.deepcopy(gm)

    later = _dynamo_graph(step, _inputs(), copy_of)
    with pytest.raises(PcpCoverageError, match="cannot tell whether this graph is the whole step"):
        PcpSyncPass().apply(copy.deepcopy(later))
    assert PcpSyncPass(whole_step=True).apply(later).mode == "sharded"


def test_a_group_that_is_gone_is_never_read_as_one_rank():
    """After the group it synchronised is aborted or destroyed (fail-stop, shutdown), the pass does
    not take "no process group" for a single rank and leave the next step's writes unsynchronised:
    it refuses, naming what happened. A pass that never saw a group stays single-rank."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pcppass.errors import PcpSyncError

    def apply(sync_pass):
        return _dynamo_graph(step, _inputs(), lambda gm: _result_or_error(sync_pass, gm))

    sync_pass = PcpSyncPass(schedule="deferred")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        assert apply(sync_pass).mode == "sharded"
        subgroup = dist.new_group([0, 1])
        on_subgroup = PcpSyncPass(subgroup, schedule="deferred")
        assert apply(on_subgroup).mode == "sharded"
        dist.destroy_process_group(subgroup)
        refused = apply(on_subgroup)
        assert isinstance(refused, PcpSyncError) and "cannot be used" in str(refused), refused
    finally:
        dist.destroy_process_group()
    refused = apply(sync_pass)
    assert isinstance(refused, PcpSyncError), refused
    assert "synchronised 2 ranks before, and now finds no process group" in str(refused)
    assert apply(PcpSyncPass(schedule="deferred")).mode == "single_rank"


def _result_or_error(sync_pass, gm):
    try:
        return sync_pass.apply(gm)
    except Exception as exc:  # returned, so the test can tell it from Dynamo's wrapping
        return exc
