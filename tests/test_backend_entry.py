"""How users reach the backend (single process, no process group: one rank, graph unchanged).

``torch.compile(fn, backend=pcppass.backend)`` (the default backend object), ``backend="pcppass"``
through the ``torch_dynamo_backends`` entry point, and the configuration errors of
:class:`PcpBackend`.
"""

from __future__ import annotations

import pytest
import torch

import pcppass
import pcppass.ops  # noqa: F401
from pcppass.compiler import PcpBackend


def _step(x, slots, cache):
    torch.ops.pcppass.reshape_and_cache_flash(x, x * 2, cache[0], cache[1], slots, "auto",
                                              torch.ones(()), torch.ones(()))
    return cache.sum() + x.sum()


def _inputs():
    x = torch.randn(3, 2, 4)
    return x, torch.tensor([5, -1, 2]), torch.zeros(2, 4, 4, 2, 4)


@pytest.fixture
def eager_default(monkeypatch):
    """The default backend compiles with Inductor; these tests only check the plumbing."""
    monkeypatch.setattr(pcppass.backend, "inner", "eager")
    monkeypatch.setattr(pcppass.backend, "reports", [])
    torch._dynamo.reset()
    return pcppass.backend


@pytest.mark.parametrize("spelling", ["attribute", "entry_point"])
def test_backend_spellings_compile_and_match_eager(eager_default, spelling):
    backend = {"attribute": pcppass.backend, "entry_point": "pcppass"}[spelling]
    x, slots, cache = _inputs()
    expected_cache = cache.clone()
    expected = _step(x, slots, expected_cache)
    out = torch.compile(_step, backend=backend, fullgraph=True)(x, slots, cache)
    assert torch.equal(out, expected) and torch.equal(cache, expected_cache)
    (report,) = eager_default.reports
    assert report.mode == "single_rank"
    assert [w.covered for w in report.writes] == [True, True]  # K and V through views of one buffer


def test_entry_point_is_the_default_backend_object():
    assert torch._dynamo.lookup_backend("pcppass") is pcppass.backend


def test_dcp_keeps_decode_replicated_and_graph_unchanged():
    backend = PcpBackend(inner="eager", dcp_size=2)
    torch._dynamo.reset()
    x, slots, cache = _inputs()
    torch.compile(_step, backend=backend, fullgraph=True)(x, slots, cache)
    assert backend.replicated and backend.reports[0].rewrite is None
    assert "dcp_size=2" in backend.reports[0].reason


@pytest.mark.parametrize("kwargs, message", [
    ({"schedule": "eventually"}, "schedule"),
    ({"inner": "tvm"}, "inner"),
    ({"on_uncovered": "ignore"}, "on_uncovered"),
    ({"dcp_size": 0}, "dcp_size"),
])
def test_configuration_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PcpBackend(**kwargs)


def test_fingerprint_ignores_the_ranks_own_device_but_not_the_graph():
    from pcppass.rewrite.insert import graph_fingerprint
    from pcppass.rewrite.plan import SyncPlan

    def traced(device: str, factor: float) -> torch.fx.GraphModule:
        graph = torch.fx.Graph()  # built by hand: nothing runs on the (absent) device
        x = graph.placeholder("x")
        r = graph.call_function(torch.arange, (4,), {"device": torch.device(device)})
        graph.output(graph.call_function(torch.add, (graph.call_function(torch.mul, (r, factor)), x)))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    plan = SyncPlan([])
    rank0, rank1 = graph_fingerprint(traced("cuda:0", 2.0), plan), graph_fingerprint(traced("cuda:1", 2.0), plan)
    assert rank0 == rank1
    assert graph_fingerprint(traced("cuda:0", 3.0), plan) != rank0
    assert graph_fingerprint(traced("cpu", 2.0), plan) != rank0
