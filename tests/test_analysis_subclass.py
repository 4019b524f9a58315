"""State identity by storage: tensor-subclass caches (a real wrapper subclass with its own
``__torch_dispatch__``, and torch's ``TwoTensor``) and tensors without a readable storage are never
taken for temporaries; writes into them are reported, uncovered."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.testing._internal.two_tensor import TwoTensor

from pcppass.analysis import StateKind, Uncovered, find_state_writes
from pcppass.analysis.trace import StepInputs, capture_graph
from pcppass.analysis.views import storage_keys

from audit_fixtures import graph_with_sparse_state


class ScaledFp8(torch.Tensor):
    """An fp8 cache with a per-tensor scale, seen as float32 (like fp8 training/inference wrappers).

    Its dispatch rewraps every view in a new wrapper (no aliasing correction), so the wrapper of
    a view has a storage of its own: only the inner fp8 payload is shared with the cache.
    """

    @staticmethod
    def __new__(cls, payload, scale):
        return torch.Tensor._make_wrapper_subclass(
            cls, payload.shape, strides=payload.stride(), storage_offset=payload.storage_offset(),
            dtype=torch.float32, device=payload.device)

    def __init__(self, payload, scale):
        self.payload, self.scale = payload, scale

    def __repr__(self):
        return f"ScaledFp8({tuple(self.shape)})"

    def __tensor_flatten__(self):
        return ["payload", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ScaledFp8(inner["payload"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        scale = next(a.scale for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, ScaledFp8))
        if func is torch.ops.aten.index_copy_.default:
            cache, dim, index, src = args
            quantised = (src / scale).to(torch.float8_e4m3fn).view(torch.uint8)
            cache.payload.view(torch.uint8).index_copy_(dim, index, quantised)
            return cache
        unwrapped = pytree.tree_map_only(ScaledFp8, lambda t: t.payload, (args, kwargs))
        out = func(*unwrapped[0], **unwrapped[1])
        if func in (torch.ops.aten.select.int, torch.ops.aten.slice.Tensor, torch.ops.aten.view.default):
            return ScaledFp8(out, scale)
        return pytree.tree_map_only(torch.Tensor, lambda t: t.float() * scale, out)


class WriteLayer0(torch.nn.Module):
    def forward(self, x, idx, cache):
        cache[0].index_copy_(0, idx, x)        # a view of the cache, then an index write
        scratch = x * 2                         # a plain temporary: never reported
        scratch.index_copy_(0, torch.arange(x.shape[0]), x)
        return x + scratch


def _inputs(cache):
    return StepInputs((torch.randn(2, 4), torch.tensor([1, 3]), cache))


def test_wrapper_subclass_cache_write_is_reported_not_lost():
    cache = ScaledFp8(torch.zeros(2, 8, 4, dtype=torch.float8_e4m3fn), torch.tensor(0.5))
    WriteLayer0()(*_inputs(cache).args)  # runs eagerly: the write is real
    assert cache.payload.view(torch.uint8)[0, 1].any() and not cache.payload.view(torch.uint8)[1].any()
    (w,) = find_state_writes(capture_graph(WriteLayer0(), _inputs(cache), dynamic=False))
    assert (w.op, w.state, w.state_kind) == ("aten::index_copy_", "L['cache']", StateKind.INPUT)
    assert not w.covered and w.reason is Uncovered.TENSOR_SUBCLASS_STATE
    assert "ScaledFp8 wrapping payload, scale" in w.detail and "test_analysis_subclass.py" in w.source
    assert [n.name for n in w.view_chain] == ["l_cache_", "getitem"]


def test_view_of_a_wrapper_shares_the_inner_storage():
    cache = ScaledFp8(torch.zeros(2, 8, 4, dtype=torch.float8_e4m3fn), torch.tensor(0.5))
    view = cache[0]
    assert type(view) is ScaledFp8 and storage_keys(view) == storage_keys(cache)
    assert storage_keys(torch.zeros(3)) != storage_keys(torch.zeros(3))


def test_two_tensor_cache_is_uncovered_with_its_inner_tensors_named():
    cache = TwoTensor(torch.zeros(2, 8, 4), torch.zeros(2, 8, 4))
    (w,) = find_state_writes(capture_graph(WriteLayer0(), _inputs(cache), dynamic=False))
    assert w.reason is Uncovered.TENSOR_SUBCLASS_STATE and "TwoTensor wrapping a, b" in w.detail


def test_unknown_storage_is_state_never_a_temporary():
    writes = find_state_writes(graph_with_sparse_state())
    assert [(w.op, w.state, w.covered) for w in writes] == [
        ("aten::add_", "state", False),  # the state itself: its in-place update is reported
        ("aten::mul_", "<unknown storage of to_sparse>", False),
    ]
    assert writes[1].reason is Uncovered.UNKNOWN_STORAGE and writes[1].state_node is None
    assert "cannot tell whether it is persistent state" in writes[1].detail
