"""Errors raised by the backend, the rewrite and the sync runtime.

Each error says what is wrong, where (op, state tensor, source line) and what to do about it: a
decode-sharding mistake otherwise shows up steps later as a wrong token on another rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from pcppass.analysis.records import StateWrite


class PcpError(RuntimeError):
    """Base class of every pcppass error."""


class PcpCoverageError(PcpError):
    """The traced graph writes persistent state that no pattern covers.

    Decode sharding would leave the replicas of that state different. ``writes`` holds every
    uncovered :class:`~pcppass.analysis.records.StateWrite` (all of them, not just the first).
    """

    def __init__(self, writes: Sequence["StateWrite"], graph_breaks: Sequence[str] = (),
                 rebound: Sequence[str] = ()):
        self.writes = list(writes)
        #: descriptions of graph breaks around the graph (eager code between graphs runs unsynced)
        self.graph_breaks = list(graph_breaks)
        #: state the step rebinds (Dynamo stores a value it computed after the graph, unsynced)
        self.rebound = list(rebound)
        lines = []
        if self.writes:
            lines.append(
                f"{len(self.writes)} write(s) into persistent state are not covered by any pattern; "
                "decode sharding would leave replicas divergent:"
            )
        for w in self.writes:
            why = w.reason.value if w.reason is not None else "no pattern"
            detail = f" ({w.detail})" if w.detail else ""
            lines.append(f"  - {w.op} writes {w.state} at {w.source}: {why}{detail}")
        if self.graph_breaks:
            lines.append(
                "the step is split into several graphs: code between them runs eagerly, outside "
                "any graph, so no write it makes into state is seen or synchronised:"
            )
            lines.extend(f"  - {b}" for b in self.graph_breaks)
        if self.rebound:
            lines.append(
                "the step rebinds state instead of writing it in place: Dynamo stores these values "
                "after the graph, where no replica sync sees them, so each rank would keep its own:"
            )
            lines.extend(f"  - {r}" for r in self.rebound)
        fixes = []
        if self.writes:
            fixes.append("register a WritePattern for the op (pcppass.register_pattern)")
        if self.graph_breaks:
            fixes.append("remove the graph break (torch.compile(..., fullgraph=True) points at it)")
        if self.rebound:
            fixes.append("write the state in place inside the graph (buf.copy_(new), cache.index_copy_(...), "
                         "a pcppass:: cache-write op) or return the value instead of storing it")
        fix = " or ".join(fixes)
        lines.append(f"{fix[0].upper()}{fix[1:]}, or compile with PcpBackend(on_uncovered='replicate') "
                     "to keep decode replicated.")
        super().__init__("\n".join(lines))


class PcpGraphBreakError(PcpCoverageError):
    """Dynamo found a graph break while tracing a step compiled as one graph (``fullgraph=True``,
    as :func:`pcppass.compile` does): refused while tracing, before the step ran."""

    def __init__(self, dynamo_message: str):
        self.writes = []
        self.graph_breaks = [dynamo_message.strip()]
        PcpError.__init__(
            self,
            "pcppass: the step has a graph break, so it is not one graph: the code around the break "
            "would run eagerly, outside any graph, where no write into state is seen or "
            "synchronised. Refused while tracing, before the step ran (nothing was written). "
            "Remove the break; Dynamo's words:\n" + self.graph_breaks[0],
        )


class PcpInputError(PcpError, ValueError):
    """A step's inputs break the execution contract (checked before the graph runs; state untouched)."""


class PcpSyncError(PcpError):
    """Replicas are or would be out of step: ranks compiled different graphs or not the same
    graphs, two ranks own one slot, state was rebound outside the graph, a recompile would run
    unsynchronised, or a peer rank stopped (its abort broke this rank's collective)."""


class PcpGraphStageError(PcpError):
    """The sync pass was handed a graph it cannot shard soundly: not the Dynamo graph of the whole
    step (a post-grad graph, a piece of a split graph, or a graph it cannot tell is whole)."""
