"""The ``torch.compile`` backend: decode sharding with replica sync inserted into the step graph.

    compiled = torch.compile(model, backend=pcppass.backend)              # defaults
    compiled = torch.compile(model, backend="pcppass")                    # entry point
    compiled = torch.compile(model, backend=PcpBackend(schedule="immediate", inner="aot_eager"))

On the Dynamo graph it receives, the backend

1. finds every write into persistent state (:func:`pcppass.analysis.find_state_writes`);
2. refuses uncovered writes (:class:`~pcppass.errors.PcpCoverageError` listing all of them), or with
   ``on_uncovered="replicate"`` compiles the graph unchanged and reports replicated decode; a graph
   that ends in a graph break or resumes after one counts as uncovered too (the eager code between
   graphs may write state, and nothing would synchronise it);
3. plans and inserts the replica sync of every covered write (:mod:`pcppass.rewrite`): the owner's
   op stays as written, the other replicas receive its rows in one collective per step
   (``schedule="deferred"``) or right after each write (``"immediate"``);
4. checks that every rank rewrote the same graph (fingerprints through the c10d store, with a
   timeout), wraps the compiled step with input validation, and hands the graph to the inner
   compiler (Inductor, aot_eager or eager).

Failures are fail-stop: a rank that fails a check its peers passed (bad inputs on that rank, a
compile the others did not make) or whose step fails aborts the process group before raising, so
the peers' collectives fail at once instead of waiting for the process-group timeout
(:mod:`pcppass.runtime.failstop`).

Each compile appends a :class:`CompileReport` to ``backend.reports``; a runner reads
``backend.replicated`` to know that decode must stay replicated.
"""

from __future__ import annotations

import logging
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
import torch.distributed as dist
import torch.fx

from pcppass.analysis import StateWrite, find_state_writes
from pcppass.errors import PcpCoverageError, PcpSyncError
from pcppass.rewrite.insert import Schedule, SyncRewrite, insert_sync
from pcppass.rewrite.plan import plan_sync
from pcppass.runtime.failstop import fail_stopping, group_rank, raise_fail_stop
from pcppass.runtime.fingerprint import exchange_fingerprint
from pcppass.runtime.validate import InputValidator, validating

log = logging.getLogger(__name__)

Inner = Literal["inductor", "aot_eager", "eager"]
#: ``"unsafe_ignore"`` syncs only the covered writes and leaves the others divergent: it exists
#: for negative controls that prove divergence is detected; never use it to run a model.
OnUncovered = Literal["raise", "replicate", "unsafe_ignore"]
Mode = Literal["sharded", "replicated", "single_rank"]

_INNERS = ("inductor", "aot_eager", "eager")
_ON_UNCOVERED = ("raise", "replicate", "unsafe_ignore")
_SCHEDULES = ("deferred", "immediate")


@dataclass(frozen=True)
class SyncChecks:
    """Run-time and compile-time checks (all on by default; each costs a host sync on GPUs)."""

    #: validate slot-mapping inputs (dtype, length, range) before the graph runs
    inputs: bool = True
    #: compare every rank's graph fingerprint in each sync header
    header: bool = True
    #: refuse a slot written by two ranks in one step
    slot_conflicts: bool = True
    #: compare fingerprints through the c10d store when compiling
    compile_fingerprint: bool = True
    #: a rank that compiles alone waits this long for the others, then fails (and aborts the group)
    fingerprint_timeout_s: float = 60.0


@dataclass
class CompileReport:
    """What the backend did with one graph."""

    mode: Mode
    reason: str
    writes: list[StateWrite]
    schedule: Schedule
    inner: Inner
    rewrite: SyncRewrite | None = None
    #: the graph handed to the inner compiler (rewritten when sharded)
    graph: torch.fx.GraphModule | None = field(default=None, repr=False)
    #: all-gather nodes in the graph handed to the inner compiler (counted, not planned)
    all_gather_nodes: int = 0

    @property
    def uncovered(self) -> list[StateWrite]:
        return [w for w in self.writes if not w.covered]

    @property
    def collectives(self) -> int:
        return self.rewrite.collectives if self.rewrite else 0


class PcpBackend:
    """A configurable pcppass backend (see the module docstring).

    ``group``: process group of the PCP ranks (default: the world group, resolved at compile time).
    ``dcp_size > 1``: the cache itself is sharded, so decode stays replicated (graph unchanged).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        schedule: Schedule = "deferred",
        inner: Inner = "inductor",
        on_uncovered: OnUncovered = "raise",
        dcp_size: int = 1,
        checks: SyncChecks = SyncChecks(),
        name: str | None = None,
    ) -> None:
        if schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {_SCHEDULES}, got {schedule!r}")
        if inner not in _INNERS:
            raise ValueError(f"inner must be one of {_INNERS}, got {inner!r}")
        if on_uncovered not in _ON_UNCOVERED:
            raise ValueError(f"on_uncovered must be one of {_ON_UNCOVERED}, got {on_uncovered!r}")
        if dcp_size < 1:
            raise ValueError(f"dcp_size must be >= 1, got {dcp_size}")
        self.group = group
        self.schedule: Schedule = schedule
        self.inner: Inner = inner
        self.on_uncovered: OnUncovered = on_uncovered
        self.dcp_size = dcp_size
        self.checks = checks
        self.name = name or schedule
        self.reports: list[CompileReport] = []
        #: set by a runner that already shards decode on the strength of earlier compiles: a later
        #: graph (a recompile) that would have to run replicated is refused with PcpSyncError
        self.sharded_only = False

    def __repr__(self) -> str:
        return (f"PcpBackend(schedule={self.schedule!r}, inner={self.inner!r}, "
                f"on_uncovered={self.on_uncovered!r}, dcp_size={self.dcp_size})")

    @property
    def replicated(self) -> bool:
        """True once any compiled graph must run with decode replicated on every rank."""
        return any(r.mode == "replicated" for r in self.reports)

    def _group(self) -> dist.ProcessGroup | None:
        if self.group is not None:
            return self.group
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        writes = find_state_writes(gm)
        group = self._group()
        world = dist.get_world_size(group) if group is not None else 1
        report = CompileReport("sharded", "", writes, self.schedule, self.inner, graph=gm)
        self.reports.append(report)
        uncovered = report.uncovered
        if self.dcp_size > 1:
            report.mode, report.reason = "replicated", f"dcp_size={self.dcp_size}: the cache is sharded"
            self._refuse_if_sharded_only(report)
            return self._compile_inner(gm, example_inputs)
        if world == 1:
            report.mode, report.reason = "single_rank", "one rank: nothing to synchronise"
            return self._compile_inner(gm, example_inputs)
        breaks = graph_breaks()
        if uncovered or breaks:
            if self.on_uncovered == "raise":
                raise PcpCoverageError(uncovered, breaks)
            reasons = [f"{w.op} -> {w.state} at {w.source}" for w in uncovered] + breaks
            if self.on_uncovered == "replicate":
                report.mode = "replicated"
                report.reason = (f"{len(uncovered)} uncovered write(s), {len(breaks)} graph break(s): "
                                 + "; ".join(reasons))
                self._refuse_if_sharded_only(report)
                log.warning("pcppass: decode stays replicated: %s", report.reason)
                return self._compile_inner(gm, example_inputs)
            log.warning("pcppass: %d uncovered write(s) and %d graph break(s) left unsynchronised "
                        "(unsafe_ignore)", len(uncovered), len(breaks))
        rank = group_rank(group)
        plan = plan_sync([w for w in writes if w.covered])
        report.rewrite = insert_sync(
            gm, plan, schedule=self.schedule, group_name=group.group_name, world_size=world,
            verify_header=self.checks.header, check_conflicts=self.checks.slot_conflicts,
            extra_fingerprint=self._config_text(),
        )
        report.reason = (f"{report.rewrite.sites} write site(s), {report.rewrite.collectives} "
                         f"collective(s) per step ({self.schedule})")
        report.all_gather_nodes = count_all_gathers(gm)
        if self.checks.compile_fingerprint:
            try:
                exchange_fingerprint(report.rewrite.fingerprint, group, namespace=self.name,
                                     timeout_s=self.checks.fingerprint_timeout_s)
            except PcpSyncError as exc:
                # A rank that compiled alone has peers waiting in a collective of the old graph.
                del group  # a gloo group closes its connections only once no frame holds it
                raise_fail_stop(exc, self.group, rank, f"compiling the {self.name} graph")
        compiled = self._compile_inner(gm, example_inputs)
        if self.checks.inputs:
            compiled = validating(compiled, InputValidator.from_plan(gm, plan, rank=rank))
        return fail_stopping(compiled, self.group, rank, f"the {self.name} step")

    def _refuse_if_sharded_only(self, report: CompileReport) -> None:
        if self.sharded_only:
            raise PcpSyncError(
                f"pcppass: {self.name} graph #{len(self.reports) - 1} (a recompile) would run with "
                f"decode replicated ({report.reason}), but the engine already shards decode rows on "
                "the strength of the earlier graphs: its rows would never be synchronised. Make the "
                "model trace the same graph at every step (same shapes and guards), so the first "
                "compile's decision holds for the whole run."
            )

    def _config_text(self) -> str:
        return f"inner={self.inner} on_uncovered={self.on_uncovered} checks={self.checks}"

    def _compile_inner(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        if self.inner == "eager":
            return gm.forward
        if self.inner == "aot_eager":
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)


def graph_breaks() -> list[str]:
    """The graph break that ends the graph being compiled, and whether it resumes after one.

    A step split into several graphs runs the code between them eagerly, unseen by the analysis:
    a graph that ends in a break, or a resume function's graph, is not the whole step. Read from
    the frame Dynamo is translating; this is Dynamo internals (checked on torch 2.13), so anything
    unexpected disables the check with a debug log instead of failing the compile.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        reason = tx.output.compile_subgraph_reason
        code_name = tx.f_code.co_name
        found = []
        if reason is not None and reason.graph_break:
            where = ""
            if reason.user_stack:
                frame = reason.user_stack[-1]
                where = f" at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
            found.append(f"graph break{where}: {reason.reason.strip().splitlines()[0]}")
        if code_name.startswith("torch_dynamo_resume_in_"):
            found.append(f"graph resumes after a graph break ({code_name}): the code before it ran "
                         "eagerly")
        return found
    except Exception as exc:  # other torch versions: no detection rather than a failed compile
        log.debug("pcppass: graph-break detection unavailable: %r", exc)
        return []


def count_all_gathers(gm: torch.fx.GraphModule) -> int:
    """Functional all-gather nodes in ``gm``: the sync collectives one run of the graph issues."""
    target = torch.ops._c10d_functional.all_gather_into_tensor.default
    return len(gm.graph.find_nodes(op="call_function", target=target))


#: The default backend: ``torch.compile(model, backend=pcppass.backend)``.
backend = PcpBackend()


def dynamo_entry_point(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """``torch_dynamo_backends`` entry point: ``torch.compile(model, backend="pcppass")``."""
    return backend(gm, example_inputs)


class _CallableModule(types.ModuleType):
    """``import pcppass.backend`` binds this module where ``pcppass.backend`` is expected to be
    the backend itself; calling the module calls the default backend."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        return backend(gm, example_inputs)


sys.modules[__name__].__class__ = _CallableModule
