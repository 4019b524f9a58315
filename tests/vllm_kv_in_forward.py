"""An out-of-tree vLLM attention backend that stores K/V inside the attention op.

Registered over ``CPU_ATTN`` with vLLM's own ``register_backend`` (the way a plugin installs a
backend), it keeps CPU_ATTN's cache layout and kernels but sets
``forward_includes_kv_cache_update = True``, vLLM's base-class default: vLLM then calls no
``unified_kv_cache_update`` and the only op that writes the KV cache is
``vllm::unified_attention_with_output``. It still answers ``get_name() == "CPU_ATTN"``.
"""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl


class KVInForwardImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is not None and kv_cache.numel() and key is not None:
            n = attn_metadata.num_actual_tokens
            self.do_kv_cache_update(layer, key[:n], value[:n], kv_cache, attn_metadata.slot_mapping[:n])
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)


class KVInForwardBackend(CPUAttentionBackend):
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_impl_cls():
        return KVInForwardImpl


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.KVInForwardBackend")


def declare_attention_read_only() -> None:
    """A negative control's hook: the declaration pcppass made before backends were told apart,
    the attention op only reads, whatever the backend."""
    from pcppass.registry import register_pattern
    from pcppass.spec import Recipe, Reviewed, WritePattern

    register_pattern(WritePattern(
        name="vllm.unified_attention_with_output", ops=("vllm::unified_attention_with_output",),
        caches=(), reads=("layer_name",), recipe=Recipe.READ_ONLY,
        reviewed=Reviewed("assumed", evidence="tests/test_vllm_backends.py::negative_control")), replace=True)
