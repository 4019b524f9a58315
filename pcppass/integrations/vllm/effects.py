"""What each vLLM custom op does through a layer name, decided per layer from what vLLM runs.

vLLM's ops take a layer name and fetch what they work on from the forward context, so the graph
cannot say whether they write. Nothing here is assumed from an op's name: the answer comes from
the layer object vLLM built (its attention backend class, its attention type, its MoE router),
checked against classes whose source was read for vLLM :data:`REVIEWED_RELEASES`, and anything
else is refused by name (:class:`~.context.UnsupportedLayer`, reported uncovered):

======================================  ===================================================
op                                      effect
======================================  ===================================================
``unified_kv_cache_update``,            writes the layer's K/V (MLA: latent) rows at its
``unified_mla_kv_cache_update``         slot mapping, in a reviewed cache layout
``unified_attention_with_output``       decoder layer on a reviewed backend with
                                        ``forward_includes_kv_cache_update=False``: only
                                        reads; a backend that stores K/V inside the op
                                        (``True``: vLLM's base-class default, HPC_ATTN, any
                                        out-of-tree backend) whose cache layout is a reviewed
                                        one (its layout methods inherited unchanged): writes
                                        the ``key``/``value`` rows; else refused
``unified_mla_attention_with_output``   reviewed MLA backend, no HiSparse cache: only reads
``moe_forward``, ``moe_forward_shared`` an MoE layer with no EPLB load recording, no
                                        routing replay or capture: writes only its outputs
``mamba_mixer2``, ``short_conv``,       a reviewed state layer (:mod:`.state`): writes every
``cpu_gdn_attention_core``              state of its rows' lines; a re-run is exact where its
                                        kernel was verified batch-invariant
======================================  ===================================================

A backend is identified by its class (module and qualified name), never by ``get_name()``: a
class registered over ``CPU_ATTN`` with vLLM's ``register_backend`` still answers "CPU_ATTN".
"""

from __future__ import annotations

from typing import Any, Callable

from pcppass.integrations.vllm.state import STATE_OPS, state_effect
from pcppass.integrations.vllm.layers import UnsupportedLayer, layer_named
from pcppass.registry import HandleEffect

#: the vLLM releases whose source the reviews below (and ``patterns/vllm_*.py``) were read in
REVIEWED_RELEASES = ">=0.32.0,<0.33"

_BACKENDS = "vllm.v1.attention.backends"

#: attention backend classes reviewed in vLLM 0.32 -> the layout of their KV cache. Each one's
#: ``forward`` reads the cache and writes only ``output`` for decoder attention (CPU_ATTN's writes
#: an encoder cache for encoder attention only); the store is ``do_kv_cache_update``, run by
#: ``unified_kv_cache_update`` (``forward_includes_kv_cache_update = False``).
REVIEWED_BACKENDS: dict[str, str] = {
    f"{_BACKENDS}.cpu_attn.CPUAttentionBackend": "cpu_attn",
    f"{_BACKENDS}.flash_attn.FlashAttentionBackend": "split_head_dim",
    f"{_BACKENDS}.triton_attn.TritonAttentionBackend": "split_head_dim",
    f"{_BACKENDS}.flashinfer.FlashInferBackend": "split_head_dim",
}
#: MLA backend classes reviewed in vLLM 0.32: their ``forward_impl`` reads the latent cache, which
#: the MLA layer's ``unified_mla_kv_cache_update`` writes (``[B, N, C]``)
REVIEWED_MLA_BACKENDS: frozenset[str] = frozenset({
    f"{_BACKENDS}.mla.cpu_mla.CPUMLABackend",
    f"{_BACKENDS}.mla.flashmla.FlashMLABackend",
    f"{_BACKENDS}.mla.flashattn_mla.FlashAttnMLABackend",
    f"{_BACKENDS}.mla.triton_mla.TritonMLABackend",
    f"{_BACKENDS}.mla.cutlass_mla.CutlassMLABackend",
    f"{_BACKENDS}.mla.flashinfer_mla.FlashInferMLABackend",
})
#: what fixes where one token's K and V bytes lie in the cache: a backend that keeps these of a
#: reviewed ancestor keeps its layout
LAYOUT_METHODS = ("get_kv_cache_shape", "get_kv_cache_stride_order")


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _unsupported(message: str) -> Exception:
    return UnsupportedLayer(message)


def _same_attribute(cls: type, base: type, name: str) -> bool:
    """``cls`` inherits ``name`` from ``base`` unchanged (or neither has it)."""
    mine, theirs = getattr(cls, name, None), getattr(base, name, None)
    return getattr(mine, "__func__", mine) is getattr(theirs, "__func__", theirs)


def backend_layout(backend: type) -> str:
    """The reviewed KV layout ``backend`` stores in (``"cpu_attn"`` or ``"split_head_dim"``).

    A reviewed class, or a subclass (e.g. registered over a reviewed one with ``register_backend``)
    that keeps the reviewed ancestor's layout methods and whose implementation keeps its
    ``do_kv_cache_update``; anything else raises naming the class."""
    for ancestor in backend.__mro__:
        layout = REVIEWED_BACKENDS.get(class_path(ancestor))
        if layout is None:
            continue
        changed = [m for m in LAYOUT_METHODS if not _same_attribute(backend, ancestor, m)]
        impl, base_impl = backend.get_impl_cls(), ancestor.get_impl_cls()
        if not _same_attribute(impl, base_impl, "do_kv_cache_update"):
            changed.append(f"{impl.__qualname__}.do_kv_cache_update")
        if changed:
            raise _unsupported(f"attention backend {class_path(backend)} overrides {', '.join(changed)} of "
                               f"{class_path(ancestor)}: its cache layout was never reviewed")
        return layout
    raise _unsupported(f"attention backend {class_path(backend)} ({backend.get_name()}) was never reviewed "
                       f"(reviewed for vLLM {REVIEWED_RELEASES}: {', '.join(sorted(REVIEWED_BACKENDS))})")


def _is_decoder(layer: Any) -> bool:
    from vllm.v1.attention.backend import AttentionType

    return getattr(layer, "attn_type", AttentionType.DECODER) == AttentionType.DECODER


def _attention_layer(layer: Any, name: str) -> Any:
    from vllm.model_executor.layers.attention.attention import Attention

    if not isinstance(layer, Attention):
        raise _unsupported(f"{name} is a {type(layer).__name__}, not a vLLM Attention layer")
    if not _is_decoder(layer):
        raise _unsupported(f"{name} is {layer.attn_type} attention: its backend may store an encoder "
                           f"cache inside the attention op, which was never reviewed")
    return layer


def kv_update_effect(layer: Any, name: str) -> HandleEffect:
    """``unified_kv_cache_update``: the layer's K/V rows, in a reviewed layout."""
    layer = _attention_layer(layer, name)
    backend = layer.attn_backend
    layout = backend_layout(backend)
    return HandleEffect(True, f"{class_path(backend)} stores K and V rows at the slot mapping "
                              f"({layout} layout)")


def attention_effect(layer: Any, name: str) -> HandleEffect:
    """``unified_attention_with_output``: reads on a reviewed backend; writes where the backend
    stores K/V inside the op; refused otherwise."""
    layer = _attention_layer(layer, name)
    backend = layer.attn_backend
    path = class_path(backend)
    if getattr(backend, "forward_includes_kv_cache_update", True):
        if getattr(layer, "kv_sharing_target_layer_name", None):
            raise _unsupported(f"{name} shares the KV cache of {layer.kv_sharing_target_layer_name} and its "
                               f"backend {path} stores K/V inside the attention op")
        layout = backend_layout(backend)
        return HandleEffect(True, f"{path} stores K and V inside the attention op "
                                  f"(forward_includes_kv_cache_update=True, {layout} layout)")
    if path not in REVIEWED_BACKENDS:
        raise _unsupported(f"{name}: attention backend {path} ({backend.get_name()}) was never reviewed: "
                           f"what its forward writes is unknown (reviewed for vLLM {REVIEWED_RELEASES}: "
                           f"{', '.join(sorted(REVIEWED_BACKENDS))})")
    return HandleEffect(False, f"{backend.get_name()} ({path}) reads the KV cache; "
                               f"vllm::unified_kv_cache_update stores it")


def _mla_layer(layer: Any, name: str) -> Any:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    if not isinstance(layer, MLAAttention):
        raise _unsupported(f"{name} is a {type(layer).__name__}, not a vLLM MLAAttention layer")
    if getattr(layer, "hisparse_cache", None) is not None:
        raise _unsupported(f"{name} writes a HiSparse cache chosen at run time")
    path = class_path(layer.attn_backend)
    if path not in REVIEWED_MLA_BACKENDS:
        raise _unsupported(f"{name}: MLA backend {path} was never reviewed (reviewed for vLLM "
                           f"{REVIEWED_RELEASES}: {', '.join(sorted(REVIEWED_MLA_BACKENDS))})")
    return layer


def mla_update_effect(layer: Any, name: str) -> HandleEffect:
    layer = _mla_layer(layer, name)
    return HandleEffect(True, f"{class_path(layer.attn_backend)}: the MLA latent row at the slot mapping")


def mla_attention_effect(layer: Any, name: str) -> HandleEffect:
    layer = _mla_layer(layer, name)
    return HandleEffect(False, f"{layer.attn_backend.get_name()} ({class_path(layer.attn_backend)}) reads "
                               f"the latent cache; vllm::unified_mla_kv_cache_update stores it")


def moe_state_writes(layer: Any) -> list[str]:
    """What an MoE layer records across steps besides its outputs (empty: nothing)."""
    router = getattr(layer, "router", None)
    found = []
    if getattr(router, "eplb_state", None) is not None:
        found.append("expert load statistics (EPLB)")
    if getattr(router, "_routing_replay_out", None) is not None:
        found.append("routing replay buffer")
    if getattr(router, "capture_fn", None) is not None:
        found.append("routed-expert capture")
    if getattr(getattr(layer, "routed_experts", None), "routing_sink", None) is not None:
        found.append("routed-expert sink")
    return found


def moe_effect(layer: Any, name: str) -> HandleEffect:
    """``moe_forward`` / ``moe_forward_shared``: routes and runs the experts, writes only outputs."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    if type(layer) is not MoERunner:
        raise _unsupported(f"{name} is a {class_path(type(layer))}, not vLLM's reviewed MoERunner")
    writes = moe_state_writes(layer)
    if writes:
        raise _unsupported(f"{name} records {', '.join(writes)} on every step: per-rank state "
                           f"pcppass does not synchronise")
    return HandleEffect(False, "MoE layer: routing, experts and shared experts write only the op's outputs "
                               "(no EPLB, routing replay or capture)")


#: op -> how to decide it for one layer
OP_EFFECTS: dict[str, Callable[[Any, str], HandleEffect]] = {
    "vllm::unified_kv_cache_update": kv_update_effect,
    "vllm::unified_attention_with_output": attention_effect,
    "vllm::unified_mla_kv_cache_update": mla_update_effect,
    "vllm::unified_mla_attention_with_output": mla_attention_effect,
    "vllm::moe_forward": moe_effect,
    "vllm::moe_forward_shared": moe_effect,
    **{op: state_effect(op) for op in STATE_OPS},
}


def effect(op: str, handle: str) -> HandleEffect:
    """The ``"vllm"`` resolver's ``effect``: what ``op`` does through layer ``handle``."""

    decide = OP_EFFECTS.get(op)
    if decide is None:
        raise _unsupported(f"{op} was never reviewed (reviewed vLLM ops: {', '.join(sorted(OP_EFFECTS))})")
    return decide(layer_named(handle), handle)
