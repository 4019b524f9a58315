"""Analysis of a traced decode graph: every write into persistent state, classified.

``find_state_writes(gm)`` finds and classifies the writes of a traced graph (see
:mod:`pcppass.analysis.state_writes`); ``audit(model, inputs)`` traces a model's step first and
returns an :class:`AuditReport` (see :mod:`pcppass.analysis.report`).
"""

from pcppass.analysis.classify import classify_write, classify_writes
from pcppass.analysis.records import StateKind, StateWrite, Uncovered, ViewInfo
from pcppass.analysis.report import AuditReport, audit
from pcppass.analysis.state_writes import find_state_writes, state_tensors

__all__ = [
    "AuditReport", "audit", "StateKind", "StateWrite", "Uncovered", "ViewInfo",
    "classify_write", "classify_writes", "find_state_writes", "state_tensors",
]
