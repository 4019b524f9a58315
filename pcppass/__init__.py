"""pcppass: decode sharding across prefill-context-parallel ranks, as a torch.compile backend.

    step = pcppass.compile(model)          # step(...) for any step, step.decode(...) for decode-only ones

finds every write into persistent state in the traced decode graph, keeps each covered write as
the owner's local write plus replica synchronisation (one collective per decode step), and refuses
with :class:`PcpCoverageError` when a write is not covered. See ``docs/DESIGN.md``.
"""

from __future__ import annotations

from pcppass.version import __version__
from pcppass.registry import HandleEffect, register_pattern, register_resolver, unregister_pattern
from pcppass.spec import (
    ByArgValue, BlockSplit, CacheRole, ContextCache, IndexedDim, PagedRows, Recipe, Reviewed, WritePattern,
)
from pcppass.errors import PcpCoverageError
from pcppass.checks import SyncChecks
from pcppass.analysis import audit, find_state_writes
from pcppass.compiler import PcpBackend, PcpSyncPass, backend
from pcppass.step import ShardedStep, compile
from pcppass.runtime.failstop import fail_stop
from pcppass.engine import Engine

__all__ = [
    "ByArgValue",
    "BlockSplit",
    "CacheRole",
    "ContextCache",
    "Engine",
    "HandleEffect",
    "IndexedDim",
    "PagedRows",
    "PcpBackend",
    "PcpCoverageError",
    "PcpSyncPass",
    "Recipe",
    "Reviewed",
    "ShardedStep",
    "SyncChecks",
    "WritePattern",
    "audit",
    "backend",
    "compile",
    "fail_stop",
    "find_state_writes",
    "register_pattern",
    "register_resolver",
    "unregister_pattern",
]
