"""The ``"vllm"`` resolver: a layer name -> the KV cache views and slot mapping its ops write.

vLLM's KV-update ops (``unified_kv_cache_update``, ``unified_mla_kv_cache_update`` and their fused
variants) take a layer name, not a cache: at run time they fetch ``layer.kv_cache`` and
``slot_mapping[layer_name]`` from the forward context. :func:`resolve` does the same, and returns
the cache as views in which one token's bytes are one paged row (``[num_blocks, block_size, ...]``,
any strides), so the ``PagedRows`` layout of the patterns in ``patterns/vllm_attention.py``
addresses them exactly:

==================  ==============================================  =============================
layout              ``layer.kv_cache``                               roles returned
==================  ==============================================  =============================
``cpu_attn``        ``[B, H, N, 2D]``, per (block, head) ``K[D][N]``  ``key_cache``, ``value_cache``
(``CPU_ATTN``)      then ``V[N][D]`` (the kernel stores K transposed  ``[B, N, H, D]`` views
                    for its ``vec``/``vec16`` ISAs)
``split_head_dim``  ``[B, H, N, 2D]`` (any stride order): K in        ``key_cache``, ``value_cache``
(``FLASH_ATTN``,    ``[..., :D]``, V in ``[..., D:]``                 ``[B, N, H, D]`` views
``TRITON_ATTN``,
``FLASHINFER``)
MLA backends        ``[B, N, C]`` (``C``: 576 values, or 656 bytes    ``kv_cache``
                    for ``fp8_ds_mla``)
state layers        a tuple of ``[lines, *shape]`` states (Mamba2,    each state as ``[lines, 1,
(``MambaBase``)     short conv, gated delta net)                      *shape]`` and ``state_lines``
==================  ==============================================  =============================

State layers (one state line per request, :mod:`.state`) also get ``state_lines``: per token, the
line its request's state ends in.

The layout is that of the layer's backend class (:func:`.effects.backend_layout`: a reviewed
class, or a subclass keeping its layout methods), never read from the name the backend gives
itself. Anything else (other backends or ISAs, quantised per-token-head caches, KV sharing between
layers, vLLM's own PCP gather, HiSparse caches) raises :class:`UnsupportedLayer`: the write is
then reported uncovered instead of being synchronised through a layout nobody checked.

:func:`describe` returns the same views over a one-block meta tensor built from the layer's KV
cache spec: vLLM compiles its graph before it allocates the caches, and the compile-time layout
only needs shapes and dtypes.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from pcppass.integrations.vllm.effects import backend_layout
from pcppass.integrations.vllm.layers import UnsupportedLayer, layer_named
from pcppass.integrations.vllm.state import describe_state, is_state_layer, resolve_state

#: the name patterns refer to (``WritePattern(resolver=RESOLVER)``)
RESOLVER = "vllm"

#: CPU attention ISAs whose K packing (``K[d][o]`` at ``d * N + o`` per block and head) was checked
#: against the kernel (``tests/test_vllm_context.py``)
CPU_VERIFIED_ISAS = ("vec", "vec16")
#: the block size of the compile-time description (CPU_ATTN takes multiples of 32)
DESCRIBE_BLOCK = 32


def _is_mla(layer: Any) -> bool:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return isinstance(layer, MLAAttention)


def _check_supported(layer: Any, name: str) -> None:
    if getattr(layer, "kv_sharing_target_layer_name", None):
        raise UnsupportedLayer(f"{name} shares the KV cache of {layer.kv_sharing_target_layer_name}")
    if getattr(layer, "hisparse_cache", None) is not None:
        raise UnsupportedLayer(f"{name} writes a HiSparse cache chosen at run time")
    if getattr(layer, "use_pcp", False) or getattr(layer, "pcp_shard_decode_requests", False):
        raise UnsupportedLayer(f"{name} runs vLLM's own PCP gather inside the update op")


def kv_views(layer: Any, name: str, kv_cache: torch.Tensor, *, isa: str | None = None) -> dict[str, torch.Tensor]:
    """The role views of one layer's ``kv_cache`` (see the module docstring)."""
    _check_supported(layer, name)
    if _is_mla(layer):
        if kv_cache.dim() != 3:
            raise UnsupportedLayer(f"{name}: MLA cache of shape {list(kv_cache.shape)}, expected [B, N, C]")
        return {"kv_cache": kv_cache}
    if kv_cache.dim() != 4:
        raise UnsupportedLayer(f"{name}: KV cache of shape {list(kv_cache.shape)}, expected [B, H, N, 2D]")
    nb, heads, block, width = kv_cache.shape
    head = layer.head_size
    if width != 2 * head or getattr(layer, "head_size_v", head) != head:
        raise UnsupportedLayer(f"{name}: K and V of different sizes ({list(kv_cache.shape)})")
    layout = backend_layout(layer.attn_backend)
    if layout == "cpu_attn":
        if layer.kv_cache_dtype != "auto":
            raise UnsupportedLayer(f"{name}: CPU KV cache dtype {layer.kv_cache_dtype!r} (only 'auto' is verified)")
        if isa not in CPU_VERIFIED_ISAS:
            raise UnsupportedLayer(f"{name}: the CPU kernel's K packing for ISA {isa!r} is not verified "
                                   f"(verified: {', '.join(CPU_VERIFIED_ISAS)})")
        # per (block, head): K as [D][N], then V as [N][D]; the kernel views the block as [2N, D]
        try:
            halves = kv_cache.view(nb, heads, 2, block * head)
        except RuntimeError as exc:
            raise UnsupportedLayer(f"{name}: CPU KV cache blocks are not dense ({exc})") from exc
        key = halves[:, :, 0].view(nb, heads, head, block).permute(0, 3, 1, 2)
        value = halves[:, :, 1].view(nb, heads, block, head).permute(0, 2, 1, 3)
    else:  # split_head_dim
        key, value = kv_cache.transpose(1, 2).split(head, dim=-1)
    return {"kv_cache": kv_cache, "key_cache": key, "value_cache": value}


def resolve(name: str) -> Mapping[str, torch.Tensor]:
    """Run time: the layer's cache views and ``slot_mapping``.

    Neither when the layer has no cache yet (vLLM's warm-up run, before it allocates): its op
    writes nothing then. No ``slot_mapping`` when the forward context has none for the layer: the
    op writes nothing either.
    """
    from vllm.forward_context import get_forward_context

    layer = layer_named(name)
    if is_state_layer(layer):
        return resolve_state(layer, name)
    kv_cache = layer.kv_cache
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.numel() == 0:
        return {}
    out = kv_views(layer, name, kv_cache, isa=getattr(layer, "isa", None))
    slot_mapping = get_forward_context().slot_mapping
    slots = slot_mapping.get(name) if isinstance(slot_mapping, dict) else None
    if slots is not None:
        out["slot_mapping"] = slots
    return out


def describe(name: str) -> Mapping[str, torch.Tensor]:
    """Compile time: the same views over one block of a meta tensor shaped like the layer's cache.

    vLLM compiles before it allocates (and may still resize the blocks of) its caches, and no vLLM
    config is current while it compiles: the shape comes from the layer itself. Only the bytes of
    one row reach the compiled layout; the block size used here (:data:`DESCRIBE_BLOCK`, a size
    every backend accepts) is replaced by the real cache's at run time.
    """
    layer = layer_named(name)
    if is_state_layer(layer):
        return describe_state(layer, name)
    _check_supported(layer, name)
    if _is_mla(layer):
        from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

        spec = layer.get_kv_cache_spec(layer._vllm_config)
        shape = compute_layer_kv_cache_shape_bytes(spec, 1)  # [1, 1, N, C bytes]
        logical = torch.empty(shape, dtype=torch.uint8, device="meta").view(spec.dtype).squeeze(1)
        return kv_views(layer, name, logical)
    dtype = layer.kv_cache_torch_dtype
    logical = torch.empty(1, layer.num_kv_heads, DESCRIBE_BLOCK, 2 * layer.head_size, dtype=dtype,
                          device="meta")
    isa = None
    if backend_layout(layer.attn_backend) == "cpu_attn":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        # every CPU_ATTN block size is a multiple of 32, so the ISA does not depend on which
        isa = getattr(layer, "isa", None) or _get_attn_isa(dtype, DESCRIBE_BLOCK, layer.head_size,
                                                           layer.kv_cache_dtype)
    return kv_views(layer, name, logical, isa=isa)
