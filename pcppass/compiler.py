"""The ``torch.compile`` backend: decode sharding with replica sync inserted into the step graph.

    compiled = torch.compile(model, backend=pcppass.backend)              # defaults
    compiled = torch.compile(model, backend="pcppass")                    # entry point
    compiled = torch.compile(decode_step, backend=PcpBackend(schedule="deferred"))  # decode-only

The default schedule is ``"immediate"`` (a sync right after each write site), correct for any
step. ``schedule="deferred"`` (ONE collective per step) is the caller's declaration that the graph
runs decode-only steps: no rank reads, within the step, rows another rank wrote. A step with
partitioned prefill breaks that, and no graph analysis can see it, so pcppass never assumes it.

:class:`PcpBackend` is configuration and orchestration around :class:`PcpSyncPass` (the rewrite,
:mod:`pcppass.rewrite.sync_pass`). On the Dynamo graph it receives, the backend

1. runs the pass: stage check, analysis, coverage decision, sync plan and insertion;
2. refuses a recompile that would run replicated once an engine shards decode on the strength of
   earlier compiles (``sharded_only``);
3. checks that every rank rewrote the same graph for the same input shapes (fingerprints
   through the c10d store, with a timeout), on the host has the graph's all-gathers waited for
   through the liveness watch (:mod:`pcppass.runtime.collectives`), hands the graph to the inner
   compiler (Inductor, aot_eager or eager) and wraps the compiled step with input validation
   (:mod:`pcppass.runtime.validate`), the state rebinding check and the cross-rank state digest
   check (:mod:`pcppass.runtime.state_checks`);
4. refuses a graph compiled for one rank (no sync) once the default group has several ranks
   (Dynamo would reuse a graph compiled before ``init_process_group``).

:func:`pcppass.compile` (:mod:`pcppass.step`) adds what only a wrapper around the compiled step
can: refusing a step Dynamo would run without calling this backend.

Failures are fail-stop: a rank that fails a check its peers passed (bad inputs on that rank, a
compile the others did not make) or whose step fails aborts the process group before raising, so
the peers' collectives fail at once instead of waiting for the process-group timeout
(:mod:`pcppass.runtime.failstop`). A rank that dies or hangs is found by the peers' liveness watch
(a heartbeat per rank in the c10d store, :mod:`pcppass.runtime.liveness`), which aborts their
group within ``SyncChecks.liveness_timeout_s`` and names it.

Each compile appends a :class:`CompileReport` to ``backend.reports``; a runner reads
``backend.replicated`` to know that decode must stay replicated.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
import torch.distributed as dist
import torch.fx

import pcppass.runtime.collectives  # noqa: F401  (registers pcppass::all_gather_start / _wait)
from pcppass.analysis import StateWrite
from pcppass.checks import SyncChecks
from pcppass.errors import PcpSyncError
from pcppass.rewrite.insert import Schedule, SyncRewrite
from pcppass.rewrite.peer_store import TRANSPORTS, transports_of
from pcppass.rewrite.sync_pass import Mode, OnUncovered, PcpSyncPass
from pcppass.sync.input_checks import DeviceSlotChecks, checking
from pcppass.runtime.failstop import fail_stopping, group_rank, raise_fail_stop
from pcppass.sync.fingerprint import exchange_fingerprint
from pcppass.runtime.liveness import watch_peers
from pcppass.runtime.state_checks import StepHistory, checking_state
from pcppass.runtime.row_counts import RowCountAgreement, agreeing_on_row_counts
from pcppass.runtime.validate import InputValidator

log = logging.getLogger(__name__)

__all__ = ["CompileReport", "Inner", "OnUncovered", "PcpBackend", "PcpSyncPass", "SyncChecks", "backend"]

Inner = Literal["inductor", "aot_eager", "eager"]
_INNERS = ("inductor", "aot_eager", "eager")


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
    #: how the rewritten graph moves rows between replicas (``rewrite.peer_store.transports_of``)
    transport: str = ""

    @property
    def uncovered(self) -> list[StateWrite]:
        return [w for w in self.writes if not w.covered]

    @property
    def collectives(self) -> int:
        return self.rewrite.collectives if self.rewrite else 0


class PcpBackend:
    """A configurable pcppass backend (see the module docstring).

    ``group``, ``schedule``, ``on_uncovered``, ``dcp_size``, ``checks``, ``whole_step``: the
    :class:`PcpSyncPass` configuration. ``inner``: the compiler the rewritten graph goes to.
    ``name``: names this backend's graphs in errors and fingerprint exchanges.
    ``transport``: ``"auto"`` (peer stores where every replica of every cache lives in symmetric
    memory on NCCL ranks, the all-gather otherwise; always the all-gather under ``aot_eager``,
    which hands mutating ops copies of the caches), ``"allgather"`` or ``"peer"``
    (:mod:`pcppass.rewrite.peer_store`).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        schedule: Schedule = "immediate",
        inner: Inner = "inductor",
        on_uncovered: OnUncovered = "raise",
        dcp_size: int = 1,
        checks: SyncChecks = SyncChecks(),
        name: str | None = None,
        whole_step: bool = False,
        transport: str = "auto",
    ) -> None:
        if inner not in _INNERS:
            raise ValueError(f"inner must be one of {_INNERS}, got {inner!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {tuple(TRANSPORTS)}, got {transport!r}")
        if inner == "aot_eager" and transport != "allgather":
            # aot_eager hands a mutating op copies of its inputs (no re-inplacing): peers would
            # store into the copies. Inductor and eager pass the caches themselves.
            if transport == "peer":
                raise ValueError("transport='peer' needs inner='inductor' or 'eager' (aot_eager copies the caches)")
            transport = "allgather"
        self.sync_pass = PcpSyncPass(group, schedule=schedule, on_uncovered=on_uncovered,
                                     dcp_size=dcp_size, checks=checks, whole_step=whole_step,
                                     transport=TRANSPORTS[transport])
        self.inner: Inner = inner
        self.name = name or schedule
        self.reports: list[CompileReport] = []
        #: calls of this backend's sharded graphs (each compiled step counts itself)
        self.calls = 0
        #: what the previous call of any of this backend's graphs returned (the rebinding check)
        self.history = StepHistory()
        #: set by a runner that already shards decode on the strength of earlier compiles: a later
        #: graph (a recompile) that would have to run replicated is refused with PcpSyncError
        self.sharded_only = False

    # The pass holds the configuration; these read it.
    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.sync_pass.group

    @property
    def schedule(self) -> Schedule:
        return self.sync_pass.schedule

    @property
    def on_uncovered(self) -> OnUncovered:
        return self.sync_pass.on_uncovered

    @property
    def dcp_size(self) -> int:
        return self.sync_pass.dcp_size

    @property
    def checks(self) -> SyncChecks:
        return self.sync_pass.checks

    def __repr__(self) -> str:
        return (f"PcpBackend(schedule={self.schedule!r}, inner={self.inner!r}, "
                f"on_uncovered={self.on_uncovered!r}, dcp_size={self.dcp_size})")

    @property
    def replicated(self) -> bool:
        """True once any compiled graph must run with decode replicated on every rank."""
        return any(r.mode == "replicated" for r in self.reports)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        if torch._dynamo.config.suppress_errors:
            # Dynamo would run the frame eagerly, unsynchronised, on any error raised here (a
            # refusal included): refuse when the step runs instead, which Dynamo does not catch.
            return refusing(PcpSyncError(_SUPPRESS_ERRORS))
        keep_dynamo_from_running_steps_eagerly()
        return self._compile(gm, example_inputs)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        report = CompileReport("sharded", "", [], self.schedule, self.inner, graph=gm)
        self.reports.append(report)
        result = self.sync_pass.apply(gm, fingerprint_extra=f"inner={self.inner}")
        report.mode, report.reason, report.writes = result.mode, result.reason, result.writes
        if result.mode == "replicated":
            self._refuse_if_sharded_only(report)
        if result.rewrite is None:
            compiled = self._compile_inner(gm, example_inputs)
            return self._one_rank_only(compiled) if result.mode == "single_rank" else compiled
        report.rewrite = result.rewrite
        report.all_gather_nodes = count_all_gathers(gm)
        report.transport = transports_of(gm)
        rank = group_rank(result.group)
        # started before the fingerprint exchange: a peer that passes it has beaten once
        watch = watch_peers(self.group, self.checks)
        if self.checks.compile_fingerprint:
            try:
                exchange_fingerprint(result.rewrite.fingerprint, result.group, namespace=self.name,
                                     timeout_s=self.checks.fingerprint_timeout_s,
                                     inputs=result.rewrite.inputs)
            except PcpSyncError as exc:
                # A rank that compiled alone has peers waiting in a collective of the old graph.
                del result  # a gloo group closes its connections only once no frame holds it
                raise_fail_stop(exc, self.group, rank, f"compiling the {self.name} graph")
        device = _cuda_device(example_inputs)
        if device is None and watch is not None:
            watch_host_collectives(gm)
        compiled = self._compile_inner(gm, example_inputs)
        checks = self.checks
        if report.uncovered and self.on_uncovered == "unsafe_ignore":
            # Uncovered writes diverge on purpose here (a negative control): the digest would only
            # report the divergence the caller asked for; the caller's own comparison must show it.
            checks = dataclasses.replace(checks, state_digest=False)
        compiled = checking_state(compiled, gm, self.group, checks, rank, self.history)
        validator = InputValidator.from_plan(gm, result.plan, rank=rank) if self.checks.inputs else None
        if self.checks.row_counts:
            agreement = RowCountAgreement.of(gm, result.plan, result.group, device or torch.device("cpu"))
            compiled = agreeing_on_row_counts(compiled, agreement)
        host_checks = None
        if device is not None:  # checks on the device, raised before the next step (no host read)
            compiled = checking(compiled, device, validator and DeviceSlotChecks.of(validator))
        else:
            # run first, before the peers' verdict: a rank's own bad input names the cause, where a
            # peer that refused the same input first would only show as its abort
            host_checks = validator
        return self._counting(fail_stopping(compiled, self.group, rank, f"the {self.name} step", watch,
                                            validate=host_checks))

    def _one_rank_only(self, step: Callable) -> Callable:
        """``step``, a graph compiled for one rank (no sync), refused before it runs on a group of
        several ranks: Dynamo's guards do not cover the world size, so a graph compiled before
        ``init_process_group`` (a warm-up call) would be reused, unsynchronised, after it."""
        if self.group is not None:
            return step  # an explicit group of one rank stays one rank
        name = self.name

        def run(*args: Any) -> Any:
            if dist.is_available() and dist.is_initialized() and (world := dist.get_world_size()) > 1:
                raise PcpSyncError(
                    f"pcppass: this {name} graph was compiled for one rank (no process group of "
                    f"several ranks existed when Dynamo compiled it: a call before "
                    f"init_process_group?) and now runs on {world} ranks: it has no replica sync, so "
                    "each rank would keep only its own rows. Refused before it ran: nothing was "
                    "written. Compile the step after init_process_group (torch._dynamo.reset() "
                    "drops the graphs compiled before).")
            return step(*args)

        return run

    def _counting(self, step: Callable) -> Callable:
        """``step`` that counts its calls in :attr:`calls` (an engine can tell that Dynamo ran a
        sharded step without any of this backend's graphs)."""

        def run(*args: Any) -> Any:
            self.calls += 1
            return step(*args)

        return run

    def _refuse_if_sharded_only(self, report: CompileReport) -> None:
        if self.sharded_only:
            raise PcpSyncError(
                f"pcppass: {self.name} graph #{len(self.reports) - 1} (a recompile) would run with "
                f"decode replicated ({report.reason}), but the engine already shards decode rows on "
                "the strength of the earlier graphs: its rows would never be synchronised. Make the "
                "model trace the same graph at every step (same shapes and guards), so the first "
                "compile's decision holds for the whole run."
            )

    def _compile_inner(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        if self.inner == "eager":
            return gm.forward
        if self.inner == "aot_eager":
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)


_SUPPRESS_ERRORS = (
    "pcppass: torch._dynamo.config.suppress_errors is on: Dynamo then runs a frame eagerly "
    "whenever compiling it fails (a pcppass refusal, Dynamo's recompile limit, an unsupported "
    "construct), and an eager step writes its rows on this rank only. pcppass refuses every step "
    "compiled under it; turn it off (torch._dynamo.config.suppress_errors = False, unset "
    "TORCHDYNAMO_SUPPRESS_ERRORS)."
)


def keep_dynamo_from_running_steps_eagerly() -> None:
    """Past ``torch._dynamo.config.recompile_limit`` Dynamo runs a frame eagerly, without calling
    the backend, unless the frame was compiled with ``fullgraph=True`` or
    ``fail_on_recompile_limit_hit`` is set: an eager decode step writes its rows on its own rank
    only. Set it, process-wide, from the first graph a pcppass backend compiles on (it then
    raises ``FailOnRecompileLimitHit`` before the frame runs, for every frame of the process)."""
    config = torch._dynamo.config
    if not config.fail_on_recompile_limit_hit:
        log.info("pcppass: setting torch._dynamo.config.fail_on_recompile_limit_hit = True: past the "
                 "recompile limit a step must fail, not run eagerly without its replica sync")
        config.fail_on_recompile_limit_hit = True


def refusing(error: Exception) -> Callable:
    """A compiled step that raises ``error`` when called, before running anything."""

    def refuse(*args: Any) -> Any:
        raise error

    return refuse


def _cuda_device(example_inputs: Sequence[Any]) -> torch.device | None:
    return next((t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda), None)


def watch_host_collectives(gm: torch.fx.GraphModule) -> int:
    """Swap every functional all-gather of a host (gloo) graph, and the ``wait_tensor`` of its
    result, for ``pcppass::all_gather_start`` / ``pcppass::all_gather_wait``
    (:mod:`pcppass.runtime.collectives`: the same collective, started and waited for where the
    graph does, whose wait ends with an error once the liveness watch declares a peer dead, where
    gloo's own ends only at the process-group timeout). Done after the fingerprint and the
    collective count, which name the functional ops. Returns how many were swapped."""
    functional = torch.ops._c10d_functional
    starts = gm.graph.find_nodes(op="call_function", target=functional.all_gather_into_tensor.default)
    for start in starts:
        group_name = start.args[2]
        start.target = torch.ops.pcppass.all_gather_start.default
        for user in list(start.users):
            if user.target is functional.wait_tensor.default:
                user.target = torch.ops.pcppass.all_gather_wait.default
                user.args = (start, group_name)
    if starts:
        gm.recompile()
    return len(starts)


def count_all_gathers(gm: torch.fx.GraphModule) -> int:
    """Functional all-gather nodes in ``gm``: the sync collectives one run of the graph issues."""
    target = torch.ops._c10d_functional.all_gather_into_tensor.default
    return len(gm.graph.find_nodes(op="call_function", target=target))


#: The default backend: ``torch.compile(model, backend=pcppass.backend)``, and the
#: ``torch_dynamo_backends`` entry point ``backend="pcppass"``.
backend = PcpBackend()
