"""Every rank's row counts agreed before a dynamic step runs.

A graph Dynamo kept dynamic in the row count serves every count with one graph, so ranks that
run it with different counts pass the compile-time fingerprint check (the graph is the same) and
then hand the sync all-gather buffers of different sizes: gloo kills the rank with the smaller
buffer (``Received data size doesn't match``), NCCL reads past it. The engine pads every rank to
one count; a library caller may not.

For such a graph the backend evaluates, on the host and before the graph runs, every row count the
sync depends on (each write site's rows and slot mapping, from the call's SymInt inputs and input
sizes: :class:`pcppass.runtime.validate.GraphSymbols`), all-gathers them (one small collective,
waited for under the liveness watch) and, if any rank's differ, raises the same
:class:`~pcppass.errors.PcpSyncError` on every rank, naming the site, the state, the source line
and each rank's count. Nothing has been written.

Graphs whose counts are all static need nothing: ranks that specialised differently traced
different graphs, which the fingerprint exchange refuses at compile time. A count whose symbols
cannot be read from the inputs (a data-dependent size) is left out and said so in the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx

from pcppass.analysis.views import node_value
from pcppass.errors import PcpSyncError
from pcppass.rewrite.plan import SyncPlan, size_expr
from pcppass.runtime.collectives import all_gather_watched
from pcppass.runtime.validate import GraphSymbols

log = logging.getLogger(__name__)

__all__ = ["RowCount", "RowCountAgreement", "agreeing_on_row_counts"]


@dataclass(frozen=True)
class RowCount:
    """One dynamic count the sync buffer's size follows: ``what`` of ``site`` (for the error)."""

    what: str
    expr: Any  # sympy expression in the graph's size symbols


def _site_counts(site) -> list[RowCount]:
    """The dynamic sizes of a site's per-row inputs and slot mappings."""
    where = f"{site.op} ({site.source})"
    counts = []
    for name, dim in {**site.pattern.row_args, **site.row_args}.items():
        fake = node_value(site.arguments.get(name))
        if isinstance(fake, torch.Tensor) and fake.dim() > dim:
            counts.append(RowCount(f"rows of {name} at {where}", size_expr(fake.shape[dim])))
    for cache in site.caches:
        fake = node_value(cache.slots)
        if isinstance(fake, torch.Tensor):
            counts.append(RowCount(f"slots of {cache.state} at {where}", size_expr(fake.numel())))
    return [c for c in counts if not isinstance(c.expr, int)]


class RowCountAgreement:
    """The dynamic row counts of one rewritten graph and how to read them from a call's inputs."""

    def __init__(self, counts: list[RowCount], symbols: GraphSymbols, group: dist.ProcessGroup | None,
                 device: torch.device) -> None:
        self.counts = counts
        self.symbols = symbols
        self.group = group
        self.device = device

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, plan: SyncPlan, group: dist.ProcessGroup | None,
           device: torch.device) -> "RowCountAgreement | None":
        """None when the graph's sync has no dynamic count (or nothing readable from its inputs)."""
        symbols = GraphSymbols(list(gm.graph.find_nodes(op="placeholder")))
        readable: dict[Any, RowCount] = {}  # one count per expression: the first site names it
        for count in (c for site in plan.sites for c in _site_counts(site)):
            if all(sym in symbols.sources for sym in count.expr.free_symbols):
                readable.setdefault(count.expr, count)
            else:
                log.info("pcppass: %s (%s) is data-dependent: ranks' counts of it are not compared "
                         "before the step", count.what, count.expr)
        return cls(list(readable.values()), symbols, group, device) if readable else None

    def values(self, args: Sequence[Any]) -> list[int]:
        return [int(self.symbols.evaluate(c.expr, args)) for c in self.counts]

    def __call__(self, args: Sequence[Any]) -> None:
        mine = torch.tensor(self.values(args), dtype=torch.int64, device=self.device)
        by_rank = all_gather_watched(mine, self.group, "the row-count agreement").cpu().tolist()
        differing = [i for i, c in enumerate(self.counts) if len({row[i] for row in by_rank}) > 1]
        if differing:
            listing = "; ".join(
                f"{self.counts[i].what}: " + ", ".join(f"rank {r} {row[i]}" for r, row in enumerate(by_rank))
                for i in differing)
            raise PcpSyncError(
                "pcppass: ranks run this dynamic step graph with different row counts, so their "
                f"sync buffers would differ in size: {listing}. Refused on every rank before the "
                "step ran: nothing was written. Pad every rank's rows to one count (slot -1 for "
                "the padding rows), as pcppass.engine does.")


def agreeing_on_row_counts(compiled: Callable, agreement: RowCountAgreement | None) -> Callable:
    """``compiled`` preceded by ``agreement`` (itself when there is none)."""
    if agreement is None:
        return compiled

    def run(*args: Any) -> Any:
        agreement(args)
        return compiled(*args)

    return run
