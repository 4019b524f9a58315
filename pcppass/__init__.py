"""pcppass: decode sharding across prefill-context-parallel ranks, as a torch.compile backend.

    compiled = torch.compile(model, backend=pcppass.backend)          # or backend="pcppass"

finds every write into persistent state in the traced decode graph, keeps each covered write as
the owner's local write plus replica synchronisation (one collective per decode step), and refuses
with :class:`PcpCoverageError` when a write is not covered. See ``docs/DESIGN.md``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Maps ``pcppass.models`` / ``pcppass.patterns`` onto the top-level ``models/`` and ``patterns/``
    folders of a source checkout that is imported without being installed (e.g. copied to a GPU
    machine and run with ``PYTHONPATH=.``). Installed distributions carry them as real subpackages."""

    _FOLDERS = {"pcppass.models": "models", "pcppass.patterns": "patterns"}

    def find_spec(self, fullname, path=None, target=None):
        folder = self._FOLDERS.get(fullname)
        if folder is None:
            return None
        root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), folder)
        init = os.path.join(root, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[root])


if not os.path.isdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")):
    sys.meta_path.append(_SourceTreeFinder())

from pcppass.registry import register_pattern, unregister_pattern
from pcppass.spec import ByArgValue, BlockSplit, CacheRole, IndexedDim, PagedRows, Recipe, WritePattern

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
    "ByArgValue",
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
