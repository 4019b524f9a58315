"""The library's way to run a decode-sharded step: ``pcppass.compile(fn)`` -> :class:`ShardedStep`.

``torch.compile(fn, backend=pcppass.backend)`` leaves to its caller everything Dynamo may do
around the backend, and each of those runs a step with no replica sync and no error. A
:class:`ShardedStep` closes them before anything is written:

* **the whole step is one graph**: it compiles with ``fullgraph=True``, so a graph break anywhere
  in the step (``torch._dynamo.graph_break()``, a ``@torch.compiler.disable`` helper, an
  ``autograd.Function`` calling ``ctx.mark_dirty``, on the first statement or inside a loop) makes
  Dynamo raise while tracing, before the step runs: raised as :class:`PcpGraphBreakError`;
* **Dynamo compiles**: a step that Dynamo would run eagerly, calling no backend
  (``torch._dynamo.config.disable`` or ``suppress_errors``, a compiler stance other than
  ``"default"`` / ``"fail_on_recompile"``: ``force_eager``, ``eager_on_recompile``, ...), is
  refused before it runs (:func:`refuse_if_dynamo_runs_eagerly`); a step that ran without any of
  the backend's graphs anyway is named right after it (:func:`check_graph_ran`);
* **a graph compiled for another world size** (a warm-up before ``init_process_group``) is refused
  by the backend before it runs (:meth:`pcppass.compiler.PcpBackend`);
* **fail-stop**: whatever fails on this rank during the step, pcppass's checks or not (a Dynamo
  error raised before the backend is called, such as ``FailOnRecompileLimitHit`` on this rank
  only), aborts the process group and marks this rank failed for the peers' liveness watches, so
  every peer's step fails within seconds instead of waiting for the process-group timeout;
* **the deferred schedule only where declared**: ``step(...)`` runs the immediate schedule (a sync
  right after each write, correct for any step); ``step.decode(...)`` runs the deferred one (one
  collective per step), the caller's declaration, call by call, that no rank reads within this step
  rows another rank writes in it. pcppass cannot check that declaration: which rows a step reads
  is in its attention kernels, and a rank's rows of a partitioned prefill can look exactly like
  decode rows (docs/FAILURE_MODES.md section 7).

:class:`pcppass.sharded.ShardedRunner` runs the engine's steps through one :class:`ShardedStep`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from pcppass.checks import SyncChecks
from pcppass.compiler import Inner, OnUncovered, PcpBackend
from pcppass.errors import PcpError, PcpGraphBreakError, PcpSyncError
from pcppass.rewrite.insert import Schedule
from pcppass.runtime.failstop import group_rank, raise_fail_stop

__all__ = ["ShardedStep", "check_graph_ran", "compile", "refuse_if_dynamo_runs_eagerly", "run_graph"]

#: the kinds of step a :class:`ShardedStep` runs: "mixed" (any step: immediate schedule) and
#: "decode" (declared decode-only: the deferred schedule by default)
KINDS = ("mixed", "decode")

#: compiler stances under which Dynamo calls the backend for every frame it would otherwise compile
_COMPILING_STANCES = ("default", "fail_on_recompile")


class ShardedStep:
    """``fn`` compiled for decode sharding, with the checks of the module docstring.

    ``step(*args, **kwargs)`` runs any step (immediate schedule); ``step.decode(*args, **kwargs)``
    runs a step declared decode-only (``decode_schedule``, deferred by default). The other
    arguments configure both :class:`~pcppass.compiler.PcpBackend` objects (``backends``);
    ``dynamic`` goes to ``torch.compile``; ``name`` prefixes the backends' names in errors and
    compile-fingerprint exchanges.
    """

    def __init__(
        self,
        fn: Callable,
        *,
        group: dist.ProcessGroup | None = None,
        inner: Inner = "inductor",
        on_uncovered: OnUncovered = "raise",
        dcp_size: int = 1,
        checks: SyncChecks = SyncChecks(),
        transport: str = "auto",
        decode_schedule: Schedule = "deferred",
        dynamic: bool | None = None,
        name: str | None = None,
    ) -> None:
        # fullgraph=True: a graph break is an error while tracing, so the graph is the whole step
        common: dict[str, Any] = dict(group=group, inner=inner, on_uncovered=on_uncovered,
                                      dcp_size=dcp_size, checks=checks, whole_step=True, transport=transport)
        prefix = f"{name}." if name else ""
        schedules: dict[str, Schedule] = {"mixed": "immediate", "decode": decode_schedule}
        self.backends = {kind: PcpBackend(schedule=schedules[kind], name=f"{prefix}{kind}", **common)
                         for kind in KINDS}
        self._compiled = {kind: torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
                          for kind, backend in self.backends.items()}
        self.group = group
        #: whether a step ran on several ranks: a compile refused after that may be a recompile of
        #: this rank alone, with peers waiting for it in a collective
        self._ran = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run("mixed", *args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        """Run a step the caller declares decode-only: no rank reads, within it, rows another
        rank writes in it (the deferred schedule syncs them at the end of the step)."""
        return self.run("decode", *args, **kwargs)

    @property
    def replicated(self) -> bool:
        """True once a compiled graph must run with decode replicated on every rank."""
        return any(backend.replicated for backend in self.backends.values())

    def world(self) -> int:
        """Ranks of the group the step synchronises (1 without torch.distributed)."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    def run(self, kind: str, *args: Any, after: Callable[[], None] | None = None, **kwargs: Any) -> Any:
        """Run a ``kind`` step; ``after()`` (a runner's own checks) runs inside its fail-stop."""
        if kind not in self.backends:
            raise ValueError(f"unknown step kind {kind!r}: expected one of {KINDS}")
        backend, world = self.backends[kind], self.world()
        if world <= 1:
            outputs = run_graph(self._compiled[kind], *args, **kwargs)
            if after is not None:
                after()
            return outputs
        try:
            # Decode kept replicated on every rank (uncovered writes with on_uncovered="replicate")
            # stays identical when Dynamo runs it eagerly; anything else would not.
            guarded = not self.replicated
            if guarded:
                refuse_if_dynamo_runs_eagerly(f"the {backend.name} step")
            calls = backend.calls
            outputs = run_graph(self._compiled[kind], *args, **kwargs)
            if guarded and not backend.replicated:
                check_graph_ran(backend, calls)
            if after is not None:
                after()
        except BaseException as exc:
            raise_fail_stop(exc, self.group, group_rank(self.group), f"the {backend.name} step",
                            alone=self._ran)
        self._ran = True
        return outputs


def compile(fn: Callable, **options: Any) -> ShardedStep:  # noqa: A001 (pcppass.compile, as torch.compile)
    """``fn`` compiled for decode sharding: a :class:`ShardedStep` (options as there)."""
    return ShardedStep(fn, **options)


def run_graph(graph: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call a ``torch.compile``'d step; pcppass's own errors (coverage, fingerprints) surface
    rather than Dynamo's wrapper, and a graph break Dynamo found while tracing a
    ``fullgraph=True`` step as :class:`PcpGraphBreakError`."""
    try:
        return graph(*args, **kwargs)
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if isinstance(inner, PcpError):
            raise inner from None
        raise
    except torch._dynamo.exc.Unsupported as exc:
        raise PcpGraphBreakError(str(exc)) from exc


def refuse_if_dynamo_runs_eagerly(what: str) -> None:
    """Raise before a sharded step that Dynamo would run eagerly, with no backend and no sync:
    ``torch._dynamo.config.disable`` (``TORCHDYNAMO_DISABLE=1``),
    ``torch._dynamo.config.suppress_errors``, or a compiler stance that runs frames, or recompiles,
    eagerly (``torch.compiler.set_stance("force_eager")``, ``"eager_on_recompile"``,
    ``"eager_then_compile"``, or any stance this check does not know)."""
    reason = None
    if torch._dynamo.config.disable:
        reason = "torch._dynamo.config.disable is set (TORCHDYNAMO_DISABLE)"
    elif torch._dynamo.config.suppress_errors:
        reason = ("torch._dynamo.config.suppress_errors is on (Dynamo runs a frame eagerly when "
                  "compiling it fails, even past the recompile limit)")
    else:
        stance = getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", None)
        if stance not in _COMPILING_STANCES:
            reason = f"the compiler stance is {stance!r} (torch.compiler.set_stance)"
    if reason is not None:
        raise PcpSyncError(
            f"pcppass: refusing to run {what} sharded: {reason}, so Dynamo may run the model "
            "eagerly, without the synchronised graph, and each rank would keep only its own rows. "
            "Nothing was written. Run with Dynamo compiling (the default stance)."
        )


def check_graph_ran(backend: PcpBackend, calls_before: int) -> None:
    """Each sharded step must have run one of ``backend``'s sharded graphs: if Dynamo ran the step
    eagerly instead (in a way the check before the step cannot see), its writes were never
    synchronised."""
    if backend.calls > calls_before:
        return
    raise PcpSyncError(
        f"pcppass: the {backend.name} step ran without its compiled graph (Dynamo ran the model "
        "eagerly: torch._dynamo disabled, an eager compiler stance, or a frame it skipped): "
        "this rank's rows were written and not synchronised, so the replicas may differ from "
        "here on. Restart from state saved before this step, with Dynamo compiling."
    )
