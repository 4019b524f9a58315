"""When ``pcppass bench`` captures a step in a CUDA graph (:func:`pcppass.runtime.capturable.capturable`).

A failed capture is not harmless: the failing op fails the step and a failed sharded step aborts the
process group. So the bench asks what the backend compiled, on 2 gloo ranks with real sharded steps:

* a step on the CPU is never captured; the same rewritten graphs with CUDA inputs are, since every
  sync op in them has an enabled CUDA kernel (``pcppass.sync.rows_cuda``) and the checks run on
  the device;
* with those kernels switched off the reference sync ops run, which read the device on the host:
  not capturable, and the reason names them;
* a graph that computes its slot mappings carries the host-reading slot-check ops: not capturable;
* the checks and the transport the bench records are read off the graph's sync nodes.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import pcppass.ops  # noqa: F401
from pcppass.bench import sync_info
from pcppass.runtime import capturable
from pcppass.bench.step import checks_off
from pcppass.compiler import PcpBackend
from pcppass.engine.launch import launch
from pcppass.sync import rows_cuda
from test_rewrite_failclosed import computed_kv_slots, kv_step

NB, BS = 4, 4


def _compiled(fn, checks=None):
    backend = PcpBackend(schedule="deferred", inner="eager", **({"checks": checks} if checks else {}))
    return torch.compile(fn, backend=backend, fullgraph=True), backend


def described_on_cuda(backend):
    """``backend`` with every compiled graph's tensor inputs described as CUDA tensors (as the same
    step compiled on a GPU would have them; this machine has none)."""
    with FakeTensorMode():
        for report in backend.reports:
            for node in report.graph.graph.find_nodes(op="placeholder"):
                value = node.meta.get("example_value")
                if isinstance(value, torch.Tensor):
                    node.meta["example_value"] = torch.empty(0, dtype=value.dtype, device="cuda")
    return backend


def _rank(rank, world):
    caches = torch.zeros(NB, BS, 2, 4), torch.zeros(NB, BS, 2, 4)
    slots = torch.tensor([rank, -1, 8 + rank])
    out = {"before_compile": capturable.capturable(PcpBackend()), "plain": capturable.capturable(None),
           "says_itself": capturable.capturable(types.SimpleNamespace(capturable=False))}

    step, checked = _compiled(kv_step)
    step(torch.randn(3, 8), slots, *caches)
    graph = checked.reports[-1].graph
    out["on_cpu"] = capturable.capturable(checked)
    out["transport"] = sync_info.transport(checked)["transport"]
    out["checks"] = sync_info.checks(checked)
    out["host_reads"] = capturable.host_reading_ops(graph)
    with rows_cuda.kernels_enabled(False):
        out["host_reads_reference"] = capturable.host_reading_ops(graph)
    described_on_cuda(checked)
    out["on_cuda"] = capturable.capturable(checked)
    with rows_cuda.kernels_enabled(False):
        out["on_cuda_reference"] = capturable.capturable(checked)

    step, unchecked = _compiled(kv_step, checks_off())
    step(torch.randn(3, 8), slots, *caches)
    out["checks_off"] = sync_info.checks(unchecked)

    step, computed = _compiled(computed_kv_slots)
    step(torch.randn(3, 8), slots, torch.tensor(0), *caches)
    out["computed_on_cuda"] = capturable.capturable(described_on_cuda(computed))
    return out


@pytest.fixture(scope="module")
def outcomes():
    return launch(_rank, 2, backend="gloo", timeout_s=200)  # CPU tensors: gloo on a GPU machine too


pytestmark = pytest.mark.timeout(240)


def test_plain_steps_and_a_backend_that_says_so(outcomes):
    for o in outcomes:
        assert o["plain"] == (True, "")
        assert o["says_itself"] == (False, "the backend says its steps cannot be captured")
        assert o["before_compile"] == (False, "the backend has compiled no graph yet (run the step once before "
                                              "capturing)")


def test_a_cpu_step_is_not_captured(outcomes):
    for o in outcomes:
        assert o["on_cpu"] == (False, "the step runs on cpu: no CUDA graph to capture")


def test_checked_step_with_device_sync_kernels_is_capturable_on_cuda(outcomes):
    for o in outcomes:
        assert o["host_reads"] == []
        assert o["on_cuda"] == (True, "")


def test_reference_sync_ops_make_the_step_not_capturable_and_are_named(outcomes):
    for o in outcomes:
        names = [why.split(" ")[0] for why in o["host_reads_reference"]]
        assert names == ["pcppass::sync_snapshot", "pcppass::sync_pack", "pcppass::sync_read_header",
                         "pcppass::sync_verdict", "pcppass::sync_scatter_rows_all"]
        ok, why = o["on_cuda_reference"]
        assert not ok and "pcppass::sync_pack (pcppass.sync.rows: reads the device on the host)" in why


def test_computed_slot_checks_make_the_step_not_capturable(outcomes):
    for o in outcomes:
        ok, why = o["computed_on_cuda"]
        assert not ok
        assert "pcppass::slot_check_record (pcppass.sync.slot_check_ops" in why
        assert "pcppass::slot_check_verdict (pcppass.sync.slot_check_ops" in why


def test_recorded_checks_and_transport_come_from_the_graph(outcomes):
    for o in outcomes:
        assert o["transport"] == "all-gather (process group backend gloo (peer stores need NCCL GPUs))"
        assert o["checks"]["in_graph"] == {"header": True, "slot_conflicts": True}
        assert o["checks"]["inputs"] is True and o["checks"]["state_digest"] is True
        assert o["checks_off"]["in_graph"] == {"header": False, "slot_conflicts": False}
        assert not any(v for k, v in o["checks_off"].items() if isinstance(v, bool))
