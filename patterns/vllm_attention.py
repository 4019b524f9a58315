"""vLLM's attention ops: KV writes addressed by layer name, decided per layer.

vLLM (0.32) writes the KV cache through ops that take the layer name (a ``LayerName`` opaque
object, or a string with ``VLLM_USE_LAYERNAME=0``) and fetch the cache and the slot mapping from
the forward context at run time; they declare no mutation and return an empty dependency token::

    vllm::unified_kv_cache_update(Tensor key, Tensor value, PyObject layer_name) -> Tensor
    vllm::unified_mla_kv_cache_update(Tensor kv_c_normed, Tensor k_pe, PyObject layer_name,
                                      str kv_cache_dtype, Tensor k_scale) -> Tensor

The attention ops take the same layer name. Whether they write depends on the layer's attention
backend, so the ``"vllm"`` resolver (registered by :mod:`pcppass.integrations.vllm`) decides it
per layer (:mod:`pcppass.integrations.vllm.effects`): a reviewed backend whose store is
``unified_kv_cache_update`` (``forward_includes_kv_cache_update=False``: CPU_ATTN, FLASH_ATTN,
TRITON_ATTN, FLASHINFER) only reads there; a backend that stores K/V inside the attention op
(``True``: vLLM's default, HPC_ATTN, out-of-tree backends) writes the ``key``/``value`` rows, synced
like the update op's when its cache layout is a reviewed one; any other backend is refused::

    vllm::unified_attention_with_output(Tensor query, Tensor key, Tensor value, Tensor(a!) output,
                                        PyObject layer_name, ...) -> ()
    vllm::unified_mla_attention_with_output(Tensor q, Tensor kv_c_normed, Tensor k_pe,
                                            Tensor(a!) output, PyObject layer_name, ...) -> ()

The resolver returns one token's K and V bytes as paged rows of two views of the layer's cache
(every layout it knows: see :mod:`pcppass.integrations.vllm.context`), or the MLA latent row
(``auto`` and ``fp8``: 576 values; ``fp8_ds_mla``: 656 bytes). Copying the owner's bytes is exact
for every dtype and quantiser (COPY_ROWS). Without that integration imported, every one of these
ops is uncovered. vLLM's fused RoPE + KV-update ops are produced by its own post-grad passes, on a
graph pcppass never rewrites: no pattern here, so they would be reported uncovered.

Every pattern here was reviewed against vLLM 0.32's source: with another vLLM installed they no
longer apply (``Reviewed``) and the ops are reported uncovered until reviewed again.
"""

from pcppass.registry import register_pattern
from pcppass.spec import ContextCache, Recipe, Reviewed, WritePattern

RESOLVER = "vllm"
#: the vLLM releases these patterns (and pcppass.integrations.vllm.effects) were reviewed in
VLLM_RELEASES = ">=0.32.0,<0.33"

_KV = (ContextCache("layer_name", cache="key_cache", slots="slot_mapping"),
       ContextCache("layer_name", cache="value_cache", slots="slot_mapping"))
_MLA = (ContextCache("layer_name", cache="kv_cache", slots="slot_mapping"),)


def _vllm(source: str, evidence: str) -> Reviewed:
    return Reviewed(source=source, evidence=evidence, package="vllm", versions=VLLM_RELEASES)


UNIFIED_KV_CACHE_UPDATE = register_pattern(WritePattern(
    name="vllm.unified_kv_cache_update",
    ops=("vllm::unified_kv_cache_update",),
    caches=(),
    context=_KV,
    resolver=RESOLVER,
    row_args={"key": 0, "value": 0},
    recipe=Recipe.COPY_ROWS,
    reviewed=_vllm("model_executor/layers/attention/attention.py: unified_kv_cache_update -> "
                   "impl.do_kv_cache_update(key, value, layer.kv_cache, slot_mapping[layer])",
                   "tests/test_vllm_llm.py::test_llm_generate_with_the_pcppass_backend"),
    doc="K and V rows of one layer, cache and slots fetched by layer name",
))

UNIFIED_MLA_KV_CACHE_UPDATE = register_pattern(WritePattern(
    name="vllm.unified_mla_kv_cache_update",
    ops=("vllm::unified_mla_kv_cache_update",),
    caches=(),
    context=_MLA,
    resolver=RESOLVER,
    row_args={"kv_c_normed": 0, "k_pe": 0},
    recipe=Recipe.COPY_ROWS,
    reviewed=_vllm("model_executor/layers/attention/mla_attention.py: unified_mla_kv_cache_update -> "
                   "the MLA impl's latent store at slot_mapping[layer]",
                   "tests/test_vllm_llm.py::test_llm_generate_with_the_pcppass_backend"),
    doc="MLA latent row (kv_c + k_pe; auto, fp8, fp8_ds_mla), by layer name",
))

UNIFIED_ATTENTION_WITH_OUTPUT = register_pattern(WritePattern(
    name="vllm.unified_attention_with_output",
    ops=("vllm::unified_attention_with_output",),
    caches=(),
    context=_KV,
    reads=("layer_name",),
    resolver=RESOLVER,
    row_args={"key": 0, "value": 0},
    recipe=Recipe.COPY_ROWS,
    reviewed=_vllm("model_executor/layers/attention/attention.py: Attention.forward and the reviewed "
                   "backends' forward (pcppass.integrations.vllm.effects)",
                   "tests/test_vllm_backends.py::test_backend_storing_kv_in_forward_is_covered_and_sharded"),
    doc="attention over the layer's KV cache; per layer: reads, or stores key/value inside the op",
))

UNIFIED_MLA_ATTENTION_WITH_OUTPUT = register_pattern(WritePattern(
    name="vllm.unified_mla_attention_with_output",
    ops=("vllm::unified_mla_attention_with_output",),
    caches=(),
    context=_MLA,
    reads=("layer_name",),
    resolver=RESOLVER,
    row_args={"kv_c_normed": 0, "k_pe": 0},
    recipe=Recipe.COPY_ROWS,
    reviewed=_vllm("model_executor/layers/attention/mla_attention.py: MLAAttention.forward stores the "
                   "latent through unified_mla_kv_cache_update; the reviewed MLA backends' forward_impl "
                   "reads it",
                   "tests/test_vllm_llm.py::test_llm_generate_with_the_pcppass_backend"),
    doc="MLA attention over the layer's latent cache; per layer (reviewed MLA backends only read)",
))
