"""Writes the finder must see whatever their spelling: list-of-tensor in-place ops (``_foreach_*``),
private in-place ops, and writes inside higher-order op regions (checkpoint, wrap)."""

from __future__ import annotations

import inspect

import torch
import torch.utils.checkpoint
from torch._higher_order_ops.wrap import wrap

import pcppass.patterns  # noqa: F401  (registers the built-in patterns)
from pcppass.analysis import Uncovered, find_state_writes
from pcppass.analysis.schema import bind_call
from pcppass.analysis.trace import StepInputs, capture_graph
from pcppass.rewrite.plan import bind_arguments, plan_sync


def _line_of(marker: str) -> int:
    """Line number in this file of the (unique) source line containing ``marker``."""
    lines = inspect.getsource(inspect.getmodule(_line_of)).splitlines()
    quoted = (f'"{marker}"', f"'{marker}'")
    (line,) = [i + 1 for i, text in enumerate(lines)
               if marker in text and not any(q in text for q in quoted)]
    return line


def _inputs(**caches: torch.Tensor) -> StepInputs:
    x, slots = torch.randn(3, 4), torch.tensor([1, 5, 6])
    return StepInputs((x, slots, caches), {}, [(x, 0), (slots, 0)])


def _summary(writes):
    return [(w.op, w.state, w.arg, w.covered, w.reason) for w in writes]


class Foreach(torch.nn.Module):
    def forward(self, x, slots, caches):
        scratch = torch.zeros(4)
        torch._foreach_copy_([caches["a"], caches["b"]], [caches["a"] + 1, caches["b"] * 2])  # copy
        torch._foreach_add_([scratch, caches["stats"]], [x.sum(0), x.sum(0)])  # scratch: temporary
        torch.ops.aten._index_put_impl_(caches["a"], (slots,), x)
        return x.sum() + scratch.sum()


def test_foreach_writes_every_state_tensor_of_the_list():
    caches = dict(a=torch.zeros(8, 4), b=torch.zeros(8, 4), stats=torch.zeros(4))
    writes = find_state_writes(capture_graph(Foreach(), _inputs(**caches)))
    assert _summary(writes) == [
        ("aten::_foreach_copy_", "L['caches']['a']", "self[0]", False, Uncovered.NON_ROW_STATE),
        ("aten::_foreach_copy_", "L['caches']['b']", "self[1]", False, Uncovered.NON_ROW_STATE),
        ("aten::_foreach_add_", "L['caches']['stats']", "self[1]", False, Uncovered.NON_ROW_STATE),
        ("aten::_index_put_impl_", "L['caches']['a']", "self", False, Uncovered.UNKNOWN_MUTATING_OP),
    ]
    assert [w.family for w in writes[:3]] == ["_foreach_copy_", "_foreach_copy_", "_foreach_add_"]
    assert writes[0].written_node is writes[0].state_node  # the list element is the state itself
    assert [w.source for w in writes[:3]] == [
        f"{writes[0].source.rsplit(':', 1)[0]}:{_line_of(m)}"
        for m in ("])  # copy", "])  # copy", "scratch: temporary")
    ]
    assert writes[0].source.endswith(f"test_analysis_spellings.py:{_line_of('])  # copy')}")


class Checkpointed(torch.nn.Module):
    def forward(self, x, slots, caches):
        def body(x, cache, counter):
            scratch = torch.zeros(8, 4)
            scratch.index_copy_(0, slots, x)             # temporary: not reported
            cache.index_copy_(0, slots, x)               # region write: cache
            counter.add_(1)                              # region write: counter
            return x + scratch[slots]

        y = torch.utils.checkpoint.checkpoint(
            body, x, caches["flat"].view(-1, 4), caches["steps"], use_reentrant=False)
        caches["kv"].index_copy_(0, slots, x)            # top-level write: covered
        return y.sum()


def test_write_inside_checkpoint_region_is_uncovered_and_named():
    caches = dict(flat=torch.zeros(2, 4, 4), steps=torch.zeros(()), kv=torch.zeros(8, 4))
    gm = capture_graph(Checkpointed(), _inputs(**caches))
    writes = find_state_writes(gm)
    assert _summary(writes) == [
        ("aten::index_copy_", "L['caches']['flat']", "self", False, Uncovered.WRITE_IN_HIGHER_ORDER_OP),
        ("aten::add_", "L['caches']['steps']", "self", False, Uncovered.WRITE_IN_HIGHER_ORDER_OP),
        ("aten::index_copy_", "L['caches']['kv']", "self", True, None),
    ]
    cache_write, counter_write = writes[0], writes[1]
    hop = cache_write.node
    assert hop.graph is gm.graph and hop.target is torch.ops.higher_order.tag_activation_checkpoint
    assert counter_write.node is hop
    # the tensor the region receives: the top-level view of the state, chained to its base
    assert cache_write.written_node.graph is gm.graph
    assert cache_write.view_chain[0] is cache_write.state_node
    assert cache_write.view_chain[-1] is cache_write.written_node
    assert cache_write.view is not None and cache_write.view.ops == ("view",)
    assert counter_write.written_node is counter_write.state_node
    assert cache_write.source.endswith(f"test_analysis_spellings.py:{_line_of('region write: cache')}")
    assert counter_write.source.endswith(f":{_line_of('region write: counter')}")
    assert "tag_activation_checkpoint" in cache_write.detail and hop.name in cache_write.detail
    assert cache_write.source in cache_write.detail
    assert "write inside a higher-order op region" in cache_write.describe()


def test_nested_regions_reach_the_top_level_state():
    class Nested(torch.nn.Module):
        def forward(self, x, slots, caches):
            def inner(x, cache):
                cache.index_copy_(0, slots, x)           # nested region write
                return x * 2

            def outer(x, cache):
                return torch.utils.checkpoint.checkpoint(inner, x, cache, use_reentrant=False) + 1

            return wrap(outer, x, caches["kv"]).sum()

    gm = capture_graph(Nested(), _inputs(kv=torch.zeros(8, 4)))
    (w,) = find_state_writes(gm)
    assert (w.op, w.state, w.reason) == (
        "aten::index_copy_", "L['caches']['kv']", Uncovered.WRITE_IN_HIGHER_ORDER_OP)
    assert w.node.target is torch.ops.higher_order.wrap and w.node.graph is gm.graph
    assert "wrap > tag_activation_checkpoint" in w.detail
    assert w.source.endswith(f":{_line_of('nested region write')}")


def test_plan_binds_arguments_with_the_finders_schema_binding():
    class Spellings(torch.nn.Module):
        def forward(self, x, slots, caches):
            caches["kv"].index_copy_(0, slots, x)
            caches["flat"].view(-1, 4)[slots] = x
            torch._foreach_add_([caches["stats"]], 1.0)
            return x.sum()

    caches = dict(kv=torch.zeros(8, 4), flat=torch.zeros(2, 4, 4), stats=torch.zeros(4))
    gm = capture_graph(Spellings(), _inputs(**caches))
    calls = [n for n in gm.graph.nodes if n.op in ("call_method", "call_function")]
    spelled = {n.name: n for n in calls if n.name.startswith(("index_copy_", "setitem", "_foreach_add_"))}
    assert len(spelled) == 3
    # method, Python operator and torch function spellings all bind by schema name in the plan
    foreach = spelled["_foreach_add_"]
    assert bind_arguments(foreach) == {"self": [foreach.args[0][0]], "scalar": 1.0}
    writes = find_state_writes(gm)
    assert [w.op for w in writes] == ["aten::index_copy_", "operator.setitem", "aten::_foreach_add_"]
    for w in writes:
        assert bind_arguments(w.node) == bind_call(w.node) == w.bound_args
    plan = plan_sync([w for w in writes if w.covered])
    assert [(c.state, c.arg, c.slots.name) for c in plan.caches] == [
        ("L['caches']['kv']", "self", "l_slots_"), ("L['caches']['flat']", "self", "l_slots_")]

