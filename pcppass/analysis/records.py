"""What the analysis reports about one write into persistent state.

Produced by :func:`pcppass.analysis.find_state_writes`, consumed by classification, the audit CLI
and the rewrite. One :class:`StateWrite` per (mutating node, written state tensor): a fused op that
writes two caches yields two records sharing ``node``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch.fx

from pcppass.spec import ResolvedLayout, WritePattern


class Uncovered(str, enum.Enum):
    """Why a write into persistent state cannot be decode-sharded safely."""

    UNKNOWN_MUTATING_OP = "unknown mutating op"
    UNKNOWN_LAYOUT = "unknown layout"
    NON_ROW_STATE = "non-row state"
    NON_INVERTIBLE_VIEW = "view the rewrite cannot invert"
    UNDECLARED_CACHE_HANDLE = "op declares no mutation but takes a cache-like handle"
    USER_TRITON_KERNEL = "user Triton kernel writes state"


@dataclass
class StateWrite:
    node: torch.fx.Node  # the node that performs the write
    op: str  # qualified op name or aten method/function spelling ("aten::index_copy_")
    state: str  # the base state tensor's source name, e.g. "L['caches']['layers.0.kv']"
    state_node: torch.fx.Node  # the base placeholder
    arg: str | None  # schema argument (or role) through which the write happens
    view_chain: list[torch.fx.Node] = field(default_factory=list)  # base -> written tensor
    source: str = "<unknown>"  # "file.py:123" from node.meta["stack_trace"]
    pattern: WritePattern | None = None
    layout: ResolvedLayout | None = None
    reason: Uncovered | None = None
    detail: str = ""  # human-readable explanation (always set when uncovered)

    @property
    def covered(self) -> bool:
        return self.pattern is not None and self.reason is None

    @property
    def bytes_per_row(self) -> int | None:
        return self.layout.bytes_per_row if self.layout is not None else None
