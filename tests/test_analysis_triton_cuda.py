"""User Triton kernels traced into the graph (``triton_kernel_wrapper_mutation``).

Dynamo traces a Triton launch into the graph only where Triton has a driver (a GPU); on the CPU
machine these tests skip, and they run on the GPU machines (docs/BENCH.md has the command).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pcppass.analysis import find_state_writes
from pcppass.analysis.records import Uncovered
from pcppass.analysis.trace import StepInputs, capture_graph
from pcppass.registry import register_pattern, unregister_pattern
from pcppass.spec import CacheRole, PagedRows, Recipe, WritePattern

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton needs a GPU driver")

if torch.cuda.is_available():
    import triton
    import triton.language as tl

    @triton.jit
    def store_rows_kernel(cache_ptr, slot_ptr, val_ptr, D: tl.constexpr):
        pid = tl.program_id(0)
        slot = tl.load(slot_ptr + pid)
        offs = tl.arange(0, D)
        v = tl.load(val_ptr + pid * D + offs)
        tl.store(cache_ptr + slot * D + offs, v, mask=offs < tl.where(slot >= 0, D, 0))


class KernelWritesCache(nn.Module):
    def forward(self, x, slots, cache):
        rows = x * 2
        store_rows_kernel[(x.shape[0],)](cache, slots, rows, D=8)
        scratch = torch.empty_like(rows)  # a temporary the kernel also writes: not state
        store_rows_kernel[(x.shape[0],)](scratch, torch.arange(x.shape[0], device=x.device), rows, D=8)
        return cache.sum() + scratch.sum()


def _inputs():
    x = torch.randn(3, 8, device="cuda")
    slots = torch.tensor([0, -1, 5], device="cuda")
    cache = torch.zeros(4, 4, 8, device="cuda")
    return StepInputs((x, slots, cache), {}, [(x, 0), (slots, 0)])


def test_user_triton_kernel_write_is_found_and_uncovered():
    gm = capture_graph(KernelWritesCache(), _inputs())
    writes = find_state_writes(gm)
    assert len(writes) == 1, [(w.op, w.state) for w in writes]
    (w,) = writes
    assert w.op == "triton::store_rows_kernel" and w.arg == "cache_ptr" and "cache" in w.state
    assert not w.covered and w.reason == Uncovered.USER_TRITON_KERNEL
    assert "test_analysis_triton_cuda.py" in w.source


def test_a_pattern_covers_the_kernel():
    pattern = register_pattern(WritePattern(
        name="test.store_rows_kernel", ops=("triton::store_rows_kernel",),
        caches=(CacheRole("cache_ptr", slots="slot_ptr", layout=PagedRows()),),
        row_args={"val_ptr": 0, "slot_ptr": 0}, recipe=Recipe.COPY_ROWS))
    try:
        (w,) = find_state_writes(capture_graph(KernelWritesCache(), _inputs()))
        assert w.covered and w.pattern is pattern and w.bytes_per_row == 8 * 4
    finally:
        unregister_pattern(pattern.name)
