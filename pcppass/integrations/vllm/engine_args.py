"""The vLLM engine arguments every pcppass route starts from on a CPU machine.

* no tokenizer (token ids in, token ids out) and float32 weights;
* the reference CPU MLA attention backend for MLA models. vLLM 0.32 prefers its AMX MLA backend on
  CPUs with AMX tiles, and that backend packs the absorbed weights for bfloat16, float16 or int8
  only: with float32 weights it fails while loading ("expect weight to be bfloat16, ..."). So the
  graph vLLM compiles, and the writes pcppass finds in it, would depend on the CPU it runs on;
  pinning ``CPU_MLA`` makes them the same everywhere. GQA models ignore it (they use CPU_ATTN).

Callers update a copy with their own arguments.
"""

from __future__ import annotations

from typing import Any


def cpu_engine_args(model_dir: str, **overrides: Any) -> dict[str, Any]:
    """``vllm.LLM`` / ``EngineArgs`` keyword arguments for ``model_dir`` (``overrides`` win)."""
    args: dict[str, Any] = dict(model=model_dir, skip_tokenizer_init=True, dtype="float32",
                                attention_config={"backend": "CPU_MLA"})
    args.update(overrides)
    return args
