"""The ``"vllm"`` resolver's cache views are exact: one token's K (or V) bytes are one paged row.

Checked against the kernels that really write vLLM's caches: vLLM's CPU kernel
``cpu_attn_reshape_and_cache`` (which stores K transposed per block and head), and, for the GPU
layout ``[B, H, N, 2D]`` in every stride order vLLM allocates, the reshape-and-cache semantics of
``pcppass::reshape_and_cache_flash`` on the views vLLM's FLASH_ATTN / TRITON_ATTN / FLASHINFER
backends hand their kernels. For each: the rows read through the resolver's views at the written
slots are the written K/V, and copying those rows into a zeroed cache through the same views
reproduces the kernel's cache bit for bit (nothing outside the rows, nothing missing).

The layout is the backend class's: a class registered over a reviewed one keeps its layout only if
it keeps the reviewed layout methods.
"""

from __future__ import annotations

import types

import pytest
import torch

from pcppass.integrations.vllm.context import UnsupportedLayer, kv_views
from pcppass.sync.rows import read_rows, write_rows
from pcppass.spec import PagedRows


def _layer(backend: str | type, head_size: int, kv_cache_dtype: str = "auto"):
    """A stand-in for a vLLM attention layer on ``backend`` (vLLM's class by enum name, or a class)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = AttentionBackendEnum[backend].get_class() if isinstance(backend, str) else backend
    return types.SimpleNamespace(
        head_size=head_size, kv_cache_dtype=kv_cache_dtype, kv_sharing_target_layer_name=None,
        attn_backend=cls,
    )


def _rows_exact(cache, views, written_cache, slots, key, value):
    """The views address exactly the bytes the kernel wrote."""
    for role, src in (("key_cache", key), ("value_cache", value)):
        view = views[role]
        layout = PagedRows().resolve(view.shape, view.element_size(), {})
        assert layout.block_size == cache.shape[2]
        rows = read_rows(view, slots, layout)
        assert torch.equal(rows, src.contiguous().view(torch.uint8).reshape(len(slots), -1)), role
    # copying the rows through the views into a zeroed cache gives the kernel's bytes exactly
    copy = torch.zeros_like(written_cache)
    copy_views = kv_views(views["_layer"], "layer", copy, isa=views["_isa"])
    for role in ("key_cache", "value_cache"):
        view = copy_views[role]
        layout = PagedRows().resolve(view.shape, view.element_size(), {})
        write_rows(view, slots, read_rows(views[role], slots, layout), layout)
    assert torch.equal(copy.view(torch.uint8), written_cache.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_size,block", [(2, 32, 32), (2, 64, 32), (1, 32, 16), (4, 64, 64)])
def test_cpu_kernel_rows_are_the_resolver_rows(dtype, heads, head_size, block):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from pcppass.integrations.vllm.context import CPU_VERIFIED_ISAS

    isa = _get_attn_isa(dtype, block, head_size, "auto")
    layer = _layer("CPU_ATTN", head_size)
    if isa not in CPU_VERIFIED_ISAS:  # e.g. AMX for bf16 on a machine that has it: refused
        with pytest.raises(UnsupportedLayer, match="not verified"):
            kv_views(layer, "layer", torch.zeros(1, heads, block, 2 * head_size, dtype=dtype), isa=isa)
        return
    g = torch.Generator().manual_seed(heads * head_size + block)
    cache = torch.zeros(5, heads, block, 2 * head_size, dtype=dtype)
    slots = torch.tensor([block + 3, 0, 4 * block + block - 1, 2 * block + 7, 1], dtype=torch.int64)
    key = torch.randn(len(slots), heads, head_size, generator=g).to(dtype)
    value = torch.randn(len(slots), heads, head_size, generator=g).to(dtype)
    # exactly what vLLM's CPUAttentionBackendImpl.do_kv_cache_update does
    kv = cache.view(5, heads, block * 2, head_size)
    key_cache, value_cache = kv.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    views = kv_views(layer, "layer", cache, isa=isa)
    views.update(_layer=layer, _isa=isa)
    _rows_exact(cache, views, cache, slots, key, value)


# FLASHINFER (same layout, by its reviewed source) cannot be imported without flashinfer
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN"])
@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "LHBNC"])
def test_gpu_layouts_rows_are_the_resolver_rows(backend, order):
    import pcppass.ops  # noqa: F401  (pcppass::reshape_and_cache_flash, vLLM's semantics)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    nb, heads, block, head_size = 4, 2, 16, 32
    layout = KVCacheLayout[order]
    # one layer of the 5-D [L, B, H, N, C] allocation, in the layout's physical order
    physical = [(1, nb, heads, block, 2 * head_size)[d] for d in layout.stride_order]
    raw = torch.zeros(physical, dtype=torch.bfloat16)
    inverse = [layout.stride_order.index(d) for d in range(5)]
    cache = raw.permute(inverse)[0]  # logical [B, H, N, 2D]
    g = torch.Generator().manual_seed(7)
    slots = torch.tensor([17, 2, 63, 40], dtype=torch.int64)
    key = torch.randn(len(slots), heads, head_size, generator=g).to(torch.bfloat16)
    value = torch.randn(len(slots), heads, head_size, generator=g).to(torch.bfloat16)
    # what those backends' do_kv_cache_update hand their kernel: (B, H, N, 2D) -> (B, N, H, D) x 2
    key_cache, value_cache = cache.transpose(1, 2).split(head_size, dim=-1)
    scale = torch.ones(())
    torch.ops.pcppass.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", scale, scale)
    layer = _layer(backend, head_size)
    views = kv_views(layer, "layer", cache)
    views.update(_layer=layer, _isa=None)
    _rows_exact(cache, views, cache, slots, key, value)


def test_unverified_layouts_are_refused():
    cache = torch.zeros(2, 2, 32, 64)
    with pytest.raises(UnsupportedLayer, match="ISA 'amx'"):
        kv_views(_layer("CPU_ATTN", 32), "l", cache, isa="amx")
    with pytest.raises(UnsupportedLayer, match="fp8"):
        kv_views(_layer("CPU_ATTN", 32, "fp8"), "l", cache, isa="vec")
    with pytest.raises(UnsupportedLayer, match=r"RocmAttentionBackend \(ROCM_ATTN\) was never reviewed"):
        kv_views(_layer("ROCM_ATTN", 32), "l", cache)
    shared = _layer("CPU_ATTN", 32)
    shared.kv_sharing_target_layer_name = "model.layers.0.self_attn.attn"
    with pytest.raises(UnsupportedLayer, match="shares the KV cache"):
        kv_views(shared, "l", cache, isa="vec")


def test_layout_follows_the_backend_class_not_its_name():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    class SameLayout(CPUAttentionBackend):  # e.g. registered over CPU_ATTN, storing K/V in forward
        forward_includes_kv_cache_update = True

    class OtherShape(CPUAttentionBackend):
        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
            return (num_blocks, block_size, num_kv_heads, 2 * head_size)

    assert SameLayout.get_name() == OtherShape.get_name() == "CPU_ATTN"
    cache = torch.zeros(2, 2, 32, 64)
    same = kv_views(_layer(SameLayout, 32), "l", cache, isa="vec")
    reference = kv_views(_layer("CPU_ATTN", 32), "l", cache, isa="vec")
    assert all(same[r].stride() == reference[r].stride() for r in ("key_cache", "value_cache"))
    with pytest.raises(UnsupportedLayer, match=r"OtherShape overrides get_kv_cache_shape of .*CPUAttentionBackend"):
        kv_views(_layer(OtherShape, 32), "l", cache, isa="vec")
