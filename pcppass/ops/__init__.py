"""Cache-write custom ops (namespace ``pcppass``) with plain-torch reference implementations.

Importing this package registers every op:

==================================  ==================================================  ===========================
op                                  writes (mutated arguments)                           module
==================================  ==================================================  ===========================
``reshape_and_cache_flash``         ``key_cache``, ``value_cache``                       :mod:`.cache_ops`
``concat_and_cache_mla``            ``kv_cache`` (auto / fp8 / fp8_ds_mla)               :mod:`.cache_ops`
``indexer_k_quant_and_cache``       ``kv_cache`` (block-split fp8 + fp32 scales)         :mod:`.cache_ops`
``fused_norm_rope``                 ``mla_kv_cache``, ``indexer_k_cache``; returns Q     :mod:`.deepseek_v32`
``swa_qnorm_rope_kv_insert``        ``swa_cache``; returns Q                             :mod:`.deepseek_v4`
``compressor_save_state``           ``state_cache``                                      :mod:`.deepseek_v4`
``compressor_compress_store``       ``compressed_cache`` (reads ``state_cache``)         :mod:`.deepseek_v4`
==================================  ==================================================  ===========================

Byte layouts and skip rules: ``docs/KERNELS.md``. Decoders for the quantised layouts:
:mod:`pcppass.ops.quant`. Norm / RoPE helpers the models share with the fused ops:
:mod:`pcppass.ops.math`.
"""

from pcppass.ops import cache_ops, deepseek_v32, deepseek_v4
from pcppass.ops.checks import KernelInputError

__all__ = ["KernelInputError", "cache_ops", "deepseek_v32", "deepseek_v4"]
