"""Analysis of a traced decode graph: every write into persistent state, classified.

``find_state_writes(gm)`` is the entry point (see :mod:`pcppass.analysis.state_writes`).
"""

from pcppass.analysis.classify import classify_write, classify_writes
from pcppass.analysis.records import StateKind, StateWrite, Uncovered, ViewInfo
from pcppass.analysis.state_writes import find_state_writes, state_tensors

__all__ = [
    "StateKind", "StateWrite", "Uncovered", "ViewInfo",
    "classify_write", "classify_writes", "find_state_writes", "state_tensors",
]
