"""``pcppass audit --vllm DIR``: the writes in the graph vLLM itself compiles for a model directory.

vLLM is started in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, compile caches off, so its
compile reaches the backend) with ``compilation_config={"mode": 2, "backend":
"pcppass.integrations.vllm.audit_backend"}``: the engine compiles while it warms up, the backend
records the classified writes of Dynamo's whole graph and runs it unchanged.
"""

from __future__ import annotations

import os
from typing import Any

from pcppass.analysis import StateWrite

#: what an in-process audit needs from vLLM's environment (set unless already set)
AUDIT_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: its compile reaches us
    "VLLM_DISABLE_COMPILE_CACHE": "1",  # a compile-cache hit would skip the backend
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: a small KV cache for an audit run
}


class VllmAuditError(RuntimeError):
    """vLLM did not hand pcppass a graph (it compiled in another process, or not at all)."""


def audit_model_dir(model_dir: str, **llm_args: Any) -> list[StateWrite]:
    """Every write into persistent state (and every handle) in vLLM's graph of ``model_dir``.

    ``llm_args`` go to ``vllm.LLM`` (defaults: no tokenizer, float32, ``max_model_len=256``).
    """
    for key, value in AUDIT_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    from pcppass.integrations.vllm.compile import audit_backend

    args = dict(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                compilation_config={"mode": 2, "backend": "pcppass.integrations.vllm.audit_backend"})
    args.update(llm_args)
    first = len(audit_backend.reports)
    LLM(**args)
    reports = audit_backend.reports[first:]
    if not reports:
        raise VllmAuditError(
            f"vLLM compiled no graph of {model_dir} in this process (VLLM_ENABLE_V1_MULTIPROCESSING="
            f"{os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING')!r}, compilation mode off, or a "
            "compile-cache hit)")
    return [w for report in reports for w in report.writes]
