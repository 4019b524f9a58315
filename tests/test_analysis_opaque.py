"""Calls the graph cannot see into are never taken as write-free: a function passed through
``torch.compiler.allow_in_graph``, a ``nonstrict_trace`` call and a higher-order op without a graph
body, each receiving state, are reported uncovered; torch's own functions are not."""

from __future__ import annotations

import math

import torch
import torch.fx

from pcppass.analysis import Uncovered, find_state_writes
from pcppass.analysis.opaque import opaque_call
from pcppass.analysis.trace import StepInputs, capture_graph


def _store_rows(cache, idx, x):
    cache.index_copy_(0, idx, x)
    return x * 2


store_in_graph = torch.compiler.allow_in_graph(_store_rows)


@torch._dynamo.nonstrict_trace
def store_nonstrict(cache, idx, x):
    cache.index_copy_(0, idx, x)
    return x * 2


class Opaque(torch.nn.Module):
    def forward(self, x, idx, caches):
        y = store_in_graph(caches["a"], idx, x)                     # allow_in_graph call
        z = store_nonstrict(caches["b"][1:], idx, x)                 # nonstrict_trace call
        # torch's own functions receiving state: known, never reported
        w = torch.nn.functional.linear(x, caches["w"]) + torch.cat([caches["a"][:1], x]).sum()
        return y + z + w * math.sqrt(2.0) + abs(caches["b"]).max()


def _inputs():
    x, idx = torch.randn(2, 4), torch.tensor([1, 3])
    caches = {"a": torch.zeros(8, 4), "b": torch.zeros(9, 4), "w": torch.randn(4, 4)}
    return StepInputs((x, idx, caches), {}, [(x, 0), (idx, 0)])


def test_opaque_calls_receiving_state_are_uncovered():
    model, inputs = Opaque(), _inputs()
    model(*inputs.args)  # eager: both calls really write their cache
    assert inputs.args[2]["a"][1].equal(inputs.args[0][0]) and inputs.args[2]["b"][4].equal(inputs.args[0][1])
    writes = find_state_writes(capture_graph(model, inputs))
    assert [(w.op.rsplit(".", 1)[-1], w.state, w.arg, w.reason) for w in writes] == [
        ("_store_rows", "L['caches']['a']", "arg0", Uncovered.OPAQUE_CALL),
        ("store_nonstrict", "L['caches']['b']", "arg2", Uncovered.OPAQUE_CALL),
    ]
    in_graph, nonstrict = writes
    assert "allow_in_graph" in in_graph.detail and "nonstrict_trace" in nonstrict.detail
    assert in_graph.source.endswith(":" + str(_line("allow_in_graph call")))
    assert nonstrict.source.endswith(":" + str(_line("nonstrict_trace call")))
    assert nonstrict.view is not None and nonstrict.view.ops[-1] in ("slice", "getitem")
    assert not any(w.covered for w in writes)


def _line(marker: str) -> int:
    with open(__file__) as f:
        (line,) = [i + 1 for i, t in enumerate(f.read().splitlines()) if t.rstrip().endswith(f"# {marker}")]
    return line


def test_higher_order_op_without_a_body_receiving_state_is_uncovered():
    from torch._higher_order_ops.flat_apply import flat_apply

    graph = torch.fx.Graph()
    cache = graph.placeholder("cache")
    cache.meta["example_value"] = torch.zeros(4, 4)
    call = graph.call_function(flat_apply, (0, 0, cache))
    call.meta["example_value"] = torch.zeros(4, 4)
    graph.output(call)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    (w,) = find_state_writes(gm)
    assert (w.op, w.state, w.arg, w.reason) == ("higher_order.flat_apply", "cache", "arg2", Uncovered.OPAQUE_CALL)
    assert "higher-order op without a graph body" in w.detail


def test_known_calls_are_not_opaque():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    calls = [
        graph.call_function(torch.add, (x, x)),
        graph.call_function(torch._C._nn.linear, (x, x)),
        graph.call_function(torch.Tensor.add_, (x, x)),
        graph.call_function(math.sqrt, (2.0,)),
        graph.call_function(abs, (x,)),
        graph.call_method("index_copy_", (x, 0, x, x)),
    ]
    assert [opaque_call(n, has_body=False) for n in calls] == [None] * len(calls)
    assert opaque_call(graph.call_method("quantize_rows", (x,)), has_body=False).op == "Tensor.quantize_rows"
