"""pcppass: decode sharding across prefill-context-parallel ranks, as a torch.compile backend.

    compiled = torch.compile(model, backend=pcppass.backend)          # or backend="pcppass"

finds every write into persistent state in the traced decode graph, keeps each covered write as
the owner's local write plus replica synchronisation (one collective per decode step), and refuses
with :class:`PcpCoverageError` when a write is not covered. See ``docs/DESIGN.md``.
"""

from __future__ import annotations

import importlib

from pcppass.registry import register_pattern, unregister_pattern
from pcppass.spec import BlockSplit, CacheRole, IndexedDim, PagedRows, Recipe, WritePattern

__version__ = "0.1.0"

# Heavier entry points load on first use, so `import pcppass` stays cheap and free of cycles.
_LAZY = {
    "backend": "pcppass.backend",
    "PcpBackend": "pcppass.backend",
    "PcpCoverageError": "pcppass.errors",
    "find_state_writes": "pcppass.analysis",
    "audit": "pcppass.analysis",
    "Engine": "pcppass.engine",
}

__all__ = [
    "BlockSplit",
    "CacheRole",
    "IndexedDim",
    "PagedRows",
    "Recipe",
    "WritePattern",
    "register_pattern",
    "unregister_pattern",
    *_LAZY,
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pcppass' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
