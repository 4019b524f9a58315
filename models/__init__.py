"""Reference models that follow :mod:`pcppass.contract` and contain the hard cache writes.

* ``llama``: GQA, ``reshape_and_cache_flash`` (``kv_cache_dtype`` "auto" / "fp8").
* ``deepseek_v2``: DeepSeek-V2-Lite MLA, ``concat_and_cache_mla`` ("auto" / "fp8_ds_mla").
* ``deepseek_v32``: DeepSeek-V3.2 MLA + lightning indexer; both caches written by ONE
  ``fused_norm_rope`` call.
* ``deepseek_v4``: DeepSeek-V4 sliding window ring cache (``swa_qnorm_rope_kv_insert``),
  compressors (``compressor_save_state`` / ``compressor_compress_store``) and the C4 indexer.

``build_model(name, size)`` returns a ready module; ``size="tiny"`` is a float32 CPU test model,
``size="full"`` has the real widths (2 layers, bf16, random seeded weights). Extra keyword
arguments override config fields, e.g. ``build_model("llama", kv_cache_dtype="fp8")``.
See docs/MODELS.md.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from pcppass.models.common import PagedCausalLM, materialize, with_overrides

MODEL_NAMES = ("llama", "deepseek_v2", "deepseek_v32", "deepseek_v4")
Size = Literal["tiny", "full"]


def model_config(name: str, size: Size = "tiny", **overrides: Any):
    """The config ``build_model`` would use (``size`` preset, then ``overrides``)."""
    if name == "llama":
        from pcppass.models.llama import LlamaConfig as config_cls
    elif name == "deepseek_v2":
        from pcppass.models.deepseek_v2 import DeepseekV2Config as config_cls
    elif name == "deepseek_v32":
        from pcppass.models.deepseek_v32 import DeepseekV32Config as config_cls
    elif name == "deepseek_v4":
        from pcppass.models.deepseek_v4 import DeepseekV4Config as config_cls
    else:
        raise ValueError(f"unknown model {name!r}; choose one of {MODEL_NAMES}")
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    base = config_cls.tiny() if size == "tiny" else config_cls.full()
    return with_overrides(base, overrides)


def build_model(
    name: str,
    size: Size = "tiny",
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    **overrides: Any,
) -> PagedCausalLM:
    """Build reference model ``name`` with seeded random weights on ``device``.

    ``dtype`` defaults to float32 for ``tiny`` and bfloat16 for ``full``.
    """
    if dtype is not None:
        overrides["dtype"] = dtype
    cfg = model_config(name, size, **overrides)
    if name == "llama":
        from pcppass.models.llama import LlamaModel as model_cls
    elif name == "deepseek_v2":
        from pcppass.models.deepseek_v2 import DeepseekV2Model as model_cls
    elif name == "deepseek_v32":
        from pcppass.models.deepseek_v32 import DeepseekV32Model as model_cls
    else:
        from pcppass.models.deepseek_v4 import DeepseekV4Model as model_cls
    with torch.device("meta"):
        model = model_cls(cfg)
    return materialize(model, device, seed)


__all__ = ["MODEL_NAMES", "build_model", "model_config"]
