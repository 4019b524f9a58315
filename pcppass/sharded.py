"""Decode-sharded engine runner: the pcppass backend plugged into :class:`pcppass.engine.runner.Engine`.

:class:`ShardedRunner` holds two compiled graphs of the model's forward:

* ``"decode"`` steps (every row is a decode row, each owned by one rank): the deferred schedule,
  every write site's rows in ONE all-gather at the end of the step;
* ``"mixed"`` steps (partitioned prefill: later chunks attend to earlier chunks written by other
  ranks in the same step): the immediate schedule, a sync right after each write site.

It records, per step, the sync collectives the graph actually issued and their bytes
(:attr:`ShardedRunner.step_syncs`), and while it shards decode it checks after every step what
the graphs cannot show:

* a recompile (a guard failed) whose graph would run replicated, while the engine already
  shards decode rows: refused with :class:`~pcppass.errors.PcpSyncError` (the backend refuses to
  compile it, and the runner checks every new compile report);
* state rebound outside the graph (``caches["a"] = caches["a"].index_copy(...)``,
  ``self.buf = new_tensor``): Dynamo replays such stores after the graph, so no sync sees them;
  every cache tensor of the dict and every model buffer must still be the same tensor (object and
  data pointer) after the step, else :class:`~pcppass.errors.PcpSyncError` names the state.

Both graphs are one :class:`pcppass.step.ShardedStep` (``pcppass.compile``): each compiled with
``fullgraph=True``, a step Dynamo would run eagerly refused before it runs, and any failure of a
step but a coverage refusal of a first compile (which every rank makes alike) aborts the process
group before it is raised, so the other ranks fail at once instead of waiting in a collective
(:mod:`pcppass.runtime.failstop`). :func:`sharded_engine` builds an engine around it and, when the
backend had to keep decode replicated (uncovered writes with ``on_uncovered="replicate"``, or
``dcp_size > 1``), an engine that runs decode replicated and prefill unpartitioned instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from pcppass.compiler import Inner, OnUncovered, PcpBackend, SyncChecks
from pcppass.engine.layout import Policy, padding_step
from pcppass.engine.runner import Engine
from pcppass.errors import PcpSyncError
from pcppass.rewrite.insert import Schedule
from pcppass.runtime.capturable import capturable
from pcppass.runtime.failstop import group_rank
from pcppass.sync.stats import SYNC_COUNTERS
from pcppass.step import ShardedStep, run_graph

#: rows of the all-padding step that compiles both graphs before the first real step
WARMUP_ROWS = 2


@dataclass(frozen=True)
class StepSync:
    """Replica sync one step performed on this rank."""

    step_kind: str
    rows: int
    collectives: int
    bytes_sent: int
    bytes_gathered: int


#: name -> (tensor, data pointer) of every piece of state the step must update in place
StateIdentity = dict[str, tuple[torch.Tensor | None, int | None]]


class ShardedRunner:
    """``runner(input_ids, positions, meta, caches, step_kind) -> hidden`` for the engine."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        inner: Inner = "inductor",
        decode_schedule: Schedule = "deferred",
        mixed_schedule: Schedule = "immediate",
        on_uncovered: OnUncovered = "raise",
        dcp_size: int = 1,
        checks: SyncChecks = SyncChecks(),
    ) -> None:
        if mixed_schedule != "immediate":
            # Prefill rows written by one rank are read by another rank in the same step.
            raise ValueError("mixed steps need the immediate schedule (rows are read in the same step)")
        # One ShardedStep: both graphs compiled with fullgraph=True (each is the whole step), the
        # checks around a step that Dynamo would run without them, and fail-stop.
        # The engine pads every rank's rows to one count that every rank computes alike from the
        # same plan (pcppass.engine.layout), so the per-step row-count agreement has nothing to find.
        checks = replace(checks, row_counts=False)
        self.step = ShardedStep(model, group=group, inner=inner, on_uncovered=on_uncovered,
                                dcp_size=dcp_size, checks=checks, decode_schedule=decode_schedule)
        self.decode_backend = self.step.backends["decode"]
        self.mixed_backend = self.step.backends["mixed"]
        self.step_syncs: list[StepSync] = []
        self.group = group
        # (qualified name, owning module, attribute) of every buffer: rebinding replaces the entry
        self._buffer_slots = [
            (f"{prefix}.{attr}" if prefix else attr, module, attr)
            for prefix, module in model.named_modules() for attr in module._buffers
        ]
        self._reports_seen = {kind: 0 for kind in self.backends}
        #: set by :meth:`warmup` once the engine shards decode on the strength of its compiles
        self.sharding = False

    @property
    def replicated(self) -> bool:
        """True when decode must stay replicated (see :attr:`PcpBackend.replicated`)."""
        return self.step.replicated

    @property
    def backends(self) -> dict[str, PcpBackend]:
        return {"decode": self.decode_backend, "mixed": self.mixed_backend}

    def capturable(self, step_kind: str) -> tuple[bool, str]:
        """Whether ``step_kind`` steps can be captured in a CUDA graph, from what the backend
        compiled (:func:`pcppass.runtime.capturable.capturable`; after :meth:`warmup`)."""
        return capturable(self.backends[step_kind])

    def __call__(self, input_ids, positions, meta, caches, step_kind: str) -> torch.Tensor:
        if step_kind not in self.backends:
            raise ValueError(f"unknown step kind {step_kind!r}: expected 'decode' or 'mixed'")
        # One graph for every row count: ids, positions and every meta tensor follow the row
        # count in dim 0 (the engine pads requests to rows and never hands out fewer than 2).
        for t in (input_ids, positions, *meta.values()):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        SYNC_COUNTERS.take()
        before = self._state_identity(caches) if self.step.world() > 1 else None

        def after() -> None:
            if before is None:
                return
            self._check_new_reports(step_kind)
            if not self.replicated:
                self._check_state_identity(before, self._state_identity(caches), step_kind,
                                           group_rank(self.group))

        hidden = self.step.run(step_kind, input_ids, positions, meta, caches, after=after)
        counts = SYNC_COUNTERS.take()
        self.step_syncs.append(StepSync(step_kind, int(input_ids.shape[0]), counts.collectives,
                                        counts.bytes_sent, counts.bytes_gathered))
        return hidden

    #: kept for runners that call a compiled step themselves (pcppass.step.run_graph)
    _run = staticmethod(run_graph)

    def _check_new_reports(self, step_kind: str) -> None:
        """Once decode is sharded, every later compile must be sharded too (cheap: only when the
        backend compiled something during this step)."""
        backend = self.backends[step_kind]
        seen, self._reports_seen[step_kind] = self._reports_seen[step_kind], len(backend.reports)
        if not self.sharding:
            return
        for index, report in enumerate(backend.reports[seen:], start=seen):
            if report.mode != "sharded":
                raise PcpSyncError(
                    f"pcppass: {step_kind} graph #{index} (a recompile after warm-up) runs "
                    f"{report.mode} ({report.reason}) while the engine shards decode rows: the "
                    "rows of this step are not synchronised. Make the model trace one graph for "
                    "every step (same guards), or keep decode replicated from the start."
                )

    def _state_identity(self, caches: dict[str, torch.Tensor]) -> StateIdentity:
        state: StateIdentity = {f"caches[{name!r}]": (t, t.data_ptr()) for name, t in caches.items()}
        for name, module, attr in self._buffer_slots:
            t = module._buffers.get(attr)
            state[f"buffer {name}"] = (t, t.data_ptr() if t is not None else None)
        return state

    @staticmethod
    def _check_state_identity(before: StateIdentity, after: StateIdentity, step_kind: str,
                              rank: int | None) -> None:
        changed = sorted(
            name for name in before.keys() | after.keys()
            if name not in before or name not in after
            or before[name][0] is not after[name][0] or before[name][1] != after[name][1]
        )
        if changed:
            raise PcpSyncError(
                f"pcppass: rank {rank}: the {step_kind} step replaced state instead of writing it in "
                f"place: {', '.join(changed)}. Code such as `caches[name] = caches[name].index_copy(...)` "
                "or `self.buf = new_tensor` is replayed by Dynamo after the graph, where no replica "
                "sync sees it, so each rank now holds its own version. Write the state in place "
                "inside the graph (cache.index_copy_(...), a pcppass:: cache-write op)."
            )

    def warmup(self, engine: Engine) -> bool:
        """Compile both graphs on an all-padding step over scratch caches; True if sharded.

        Nothing is written (every slot is -1) and the engine's caches are not touched, so the
        coverage decision is known before the first real step chooses its layout.
        """
        local = padding_step(WARMUP_ROWS, engine.rank, engine.world, engine.groups, engine.table_columns,
                             engine.device)
        # allocated like the engine's caches: the backend picks the sync transport from them
        alloc = engine.config.cache_allocator
        scratch = {name: alloc(t.shape, t.dtype, t.device) if alloc else torch.zeros_like(t)
                   for name, t in engine.caches.items()}
        for kind in ("decode", "mixed"):
            self(local.input_ids, local.positions, local.meta, scratch, kind)
        self.step_syncs.clear()
        self.sharding = not self.replicated
        for backend in self.backends.values():
            backend.sharded_only = self.sharding
        return self.sharding


def sharded_engine(
    model: torch.nn.Module,
    runner: ShardedRunner,
    *,
    world: int,
    rank: int,
    group: dist.ProcessGroup | None = None,
    policy: Policy = "round_robin",
    **config: Any,
) -> Engine:
    """An engine whose steps run through ``runner``, decode-sharded when the backend allows it.

    The runner is warmed up first; if it reports replicated decode, the engine runs every decode
    row on every rank and every prefill unpartitioned, so no rank depends on another's writes.
    """
    engine = Engine(model, world=world, rank=rank, group=group, policy=policy, runner=runner, **config)
    if world > 1 and not runner.warmup(engine):
        engine = Engine(model, world=world, rank=rank, group=group, policy="replicated",
                        partition_prefill=False, runner=runner, **config)
    return engine
