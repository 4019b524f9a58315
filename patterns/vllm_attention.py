"""vLLM's attention ops: KV writes addressed by layer name, and the attention ops that only read.

vLLM (0.32) writes the KV cache through ops that take the layer name (a ``LayerName`` opaque
object, or a string with ``VLLM_USE_LAYERNAME=0``) and fetch the cache and the slot mapping from
the forward context at run time; they declare no mutation and return an empty dependency token::

    vllm::unified_kv_cache_update(Tensor key, Tensor value, PyObject layer_name) -> Tensor
    vllm::unified_mla_kv_cache_update(Tensor kv_c_normed, Tensor k_pe, PyObject layer_name,
                                      str kv_cache_dtype, Tensor k_scale) -> Tensor
    # produced by vLLM's own post-grad fusion passes (GPU):
    vllm::fused_rope_and_unified_kv_cache_update(Tensor(a0!) query, Tensor(a1!) key, Tensor value,
        Tensor positions, Tensor cos_sin_cache, bool is_neox, PyObject layer_name) -> Tensor
    vllm::fused_rope_unified_mla_kv_cache_update(Tensor positions, Tensor(a1!) q_pe,
        Tensor(a2!) k_pe, Tensor kv_c, Tensor cos_sin_cache, bool is_neox, str kv_cache_dtype,
        Tensor kv_cache_scale, PyObject layer_name) -> Tensor

The caches are context-addressed: the ``"vllm"`` resolver (registered by
:mod:`pcppass.integrations.vllm`) returns one token's K and V bytes as paged rows of two views of
the layer's cache (every layout it knows, CPU and GPU: see its module docstring), or the MLA
latent row (``auto`` and ``fp8``: 576 values; ``fp8_ds_mla``: 656 bytes). Copying the owner's
bytes is exact for every dtype and quantiser (COPY_ROWS). Without that integration imported, the
writes stay uncovered.

The attention ops take the same layer name but only read the cache (their ``output`` is a
temporary of the step): declared READ_ONLY, so the audit says so.
"""

from pcppass.registry import register_pattern
from pcppass.spec import ContextCache, Recipe, WritePattern

RESOLVER = "vllm"

_KV = (ContextCache("layer_name", cache="key_cache", slots="slot_mapping"),
       ContextCache("layer_name", cache="value_cache", slots="slot_mapping"))
_MLA = (ContextCache("layer_name", cache="kv_cache", slots="slot_mapping"),)

UNIFIED_KV_CACHE_UPDATE = register_pattern(WritePattern(
    name="vllm.unified_kv_cache_update",
    ops=("vllm::unified_kv_cache_update",),
    caches=(),
    context=_KV,
    resolver=RESOLVER,
    row_args={"key": 0, "value": 0},
    recipe=Recipe.COPY_ROWS,
    doc="K and V rows of one layer, cache and slots fetched by layer name",
))

FUSED_ROPE_AND_UNIFIED_KV_CACHE_UPDATE = register_pattern(WritePattern(
    name="vllm.fused_rope_and_unified_kv_cache_update",
    ops=("vllm::fused_rope_and_unified_kv_cache_update",),
    caches=(),
    context=_KV,
    resolver=RESOLVER,
    row_args={"query": 0, "key": 0, "value": 0, "positions": 0},
    recipe=Recipe.COPY_ROWS,
    doc="RoPE on Q and K (in place, the owner's) + the K/V store, by layer name",
))

UNIFIED_MLA_KV_CACHE_UPDATE = register_pattern(WritePattern(
    name="vllm.unified_mla_kv_cache_update",
    ops=("vllm::unified_mla_kv_cache_update",),
    caches=(),
    context=_MLA,
    resolver=RESOLVER,
    row_args={"kv_c_normed": 0, "k_pe": 0},
    recipe=Recipe.COPY_ROWS,
    doc="MLA latent row (kv_c + k_pe; auto, fp8, fp8_ds_mla), by layer name",
))

FUSED_ROPE_UNIFIED_MLA_KV_CACHE_UPDATE = register_pattern(WritePattern(
    name="vllm.fused_rope_unified_mla_kv_cache_update",
    ops=("vllm::fused_rope_unified_mla_kv_cache_update",),
    caches=(),
    context=_MLA,
    resolver=RESOLVER,
    row_args={"positions": 0, "q_pe": 0, "k_pe": 0, "kv_c": 0},
    recipe=Recipe.COPY_ROWS,
    doc="RoPE on q_pe and k_pe (in place, the owner's) + the MLA latent store, by layer name",
))

UNIFIED_ATTENTION_WITH_OUTPUT = register_pattern(WritePattern(
    name="vllm.unified_attention_with_output",
    ops=("vllm::unified_attention_with_output", "vllm::unified_mla_attention_with_output"),
    caches=(),
    reads=("layer_name",),
    recipe=Recipe.READ_ONLY,
    doc="attention over the layer's KV cache (fetched by layer name); writes only its output",
))
