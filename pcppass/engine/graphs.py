"""Decode steps replayed from CUDA graphs, so the host's cost of a step is copying its inputs.

An eager decode step costs the host far more than a shallow model's GPU work: Inductor's wrapper,
every Triton launcher, the custom ops' Python and pcppass's per-step checks run for every launch
(measured on one H200: docs/BENCH.md, "Serving"). vLLM captures its decode steps
(``FULL_DECODE_ONLY``); :class:`CudaGraphRunner` does the same around any engine runner::

    capture, once per size T (at start-up, on an all-padding step: every slot -1, nothing written)
        static ids, positions, meta [T]  ->  runner(..., caches, "decode")  ->  static hidden [T, H]
    each decode step the layout padded to a captured T
        raise_pending(device)            an error the device checks recorded in an earlier step
        static inputs <- the step's      one copy per input tensor
        graph.replay()                   the whole step: cache writes, the sync, the device checks
        -> static hidden                 read by the engine (all-gather, sampling) before the next step

A replay runs no Python. What the wrapped runner checks on the host around its compiled step is
therefore either unchanged by a replay or done here:

* the slot-range, two-owner and sync-header checks are kernels inside the step: captured, they run
  on every replay and leave the status :func:`pcppass.sync.device_checks.raise_pending` reads;
* recompiles, Dynamo running the step eagerly and state rebound outside the graph cannot happen in
  a replay (no Dynamo, no Python stores), and the caches a replay writes must be the tensors the
  graph was captured on: :meth:`CudaGraphRunner.__call__` refuses any other;
* the state digest (a host read of every cache) cannot be captured, so every ``eager_every``-th
  decode step of a captured size runs the step un-captured with its digest check forced
  (:func:`pcppass.runtime.state_checks.digest_forced`), which then also names state that differed
  across ranks before the step (diverged in the replays since the last check); the first decode
  step of a captured size is such a step;
* the cache-write ops' own host checks of their values (slot values, positions against a rope
  table: :mod:`pcppass.ops.checks`) are skipped under capture and so in every replay: the
  engine's plan validation must be on (it checks every slot before the step), and positions are
  bounded by ``max_model_len``, which must not exceed the model's tables. So are switches read
  when an op runs (``rows_cuda.kernels_enabled``, ``checks.value_checks``): a replay keeps those
  in force at capture.

A failure on one rank while capturing or before a replay would leave the other ranks waiting in
the step's collectives: at ``world > 1`` it aborts the process group first
(:mod:`pcppass.runtime.failstop`), as a failed eager step does.

Every rank captures the same sizes in the same order and takes the same path at every step (the
layout, and so the padded size, is the same on every rank), so their collectives match.

A step that reads the device on the host cannot be captured (DeepSeek-V4's compressor store, the
reference sync ops): a runner that can tell (``runner.capturable(step_kind) -> (ok, why)``, as
:class:`pcppass.sharded.ShardedRunner` does from what its backend compiled) is asked after its
eager warm-up on the padding step and before the capture, since a failed capture of a sharded step
aborts its process group; any other failure of a capture is raised as :class:`GraphCaptureError`
too, naming the size and the cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from pcppass.engine.layout import LocalStep
from pcppass.sync import device_checks
from pcppass.runtime.failstop import group_rank, raise_fail_stop
from pcppass.runtime.state_checks import digest_forced


class GraphCaptureError(RuntimeError):
    """The decode step cannot be captured in a CUDA graph (run the engine without decode graphs)."""


#: eager calls before a size is captured: the first compiles that size's kernel specialisations,
#: the second runs them as the capture will record them
WARMUP_CALLS = 2


def decode_graph_sizes(max_tokens: int) -> tuple[int, ...]:
    """Local token counts to capture decode steps for, as vLLM's capture sizes: 2, 4, 8, then every
    multiple of 8, up to the first that holds ``max_tokens`` (1 is never handed out: the layout
    pads every step to at least 2 rows)."""
    sizes = [s for s in (2, 4, 8) if s < max_tokens] or [2]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 8 else sizes[-1] + 8)
    return tuple(sizes)


@dataclass
class CapturedStep:
    """One captured decode step: the graph, the static tensors it reads and writes, and the
    replica sync the wrapped runner recorded for it (replayed into its log on each replay)."""

    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: dict[str, torch.Tensor]
    caches: dict[str, tuple]  # cache name -> (data pointer, shape, strides, dtype) the graph writes
    hidden: torch.Tensor
    sync: Any | None

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: dict[str, torch.Tensor]) -> None:
        self.input_ids.copy_(input_ids)
        self.positions.copy_(positions)
        for key, static in self.meta.items():
            static.copy_(meta[key])


class CudaGraphRunner:
    """``runner(input_ids, positions, meta, caches, step_kind) -> hidden`` that replays decode steps
    of the captured sizes (see the module docstring) and runs every other step through ``runner``.

    ``eager_every``: every n-th decode step of a captured size runs un-captured, its state digest
    check forced (0: never; the digest then sees only the steps before capture).
    """

    def __init__(self, runner: Any, device: torch.device | str, *, eager_every: int = 64,
                 kinds: Sequence[str] = ("decode",), world: int = 1,
                 group: dist.ProcessGroup | None = None) -> None:
        self.runner = runner
        self.world, self.group = world, group
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the engine runs on {self.device}")
        if eager_every < 0:
            raise ValueError(f"eager_every must be >= 0, got {eager_every}")
        self.eager_every = eager_every
        self.kinds = tuple(kinds)
        self.graphs: dict[tuple[str, int], CapturedStep] = {}
        self.pool: Any = None
        #: decode steps of a captured size so far: replayed, and run un-captured
        self.replays = 0
        self.eager_steps = 0

    # -- what the wrapped runner exposes --------------------------------------------------------
    @property
    def step_syncs(self) -> list:
        """The wrapped runner's log of per-step replica syncs (replays included); [] if it keeps none."""
        return getattr(self.runner, "step_syncs", [])

    # -- capture ---------------------------------------------------------------------------------
    def capture(self, local: LocalStep, caches: dict[str, torch.Tensor], step_kind: str = "decode") -> None:
        """Capture ``step_kind`` steps of ``local.num_tokens`` rows on ``local`` (an all-padding
        step: warm-up and capture then write nothing) over ``caches``, the tensors every replay
        will write."""
        if step_kind not in self.kinds:
            raise ValueError(f"{step_kind!r} steps are not replayed (kinds: {self.kinds})")
        local = local.to(self.device)
        ids, positions = local.input_ids.clone(), local.positions.clone()
        meta = {k: v.clone() for k, v in local.meta.items()}
        syncs = self.step_syncs
        logged = len(syncs)
        try:
            self._warm_up(ids, positions, meta, caches, step_kind)
            # asked after the warm-up: a runner knows what it compiled only once it has run
            self._refuse_if_not_capturable(step_kind)
            warmed = len(syncs)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    hidden = self.runner(ids, positions, meta, caches, step_kind)
            except Exception as exc:
                torch.cuda.synchronize(self.device)
                raise GraphCaptureError(
                    f"{step_kind} steps of {local.num_tokens} rows could not be captured in a CUDA graph: "
                    f"{type(exc).__name__}: {exc}; run the engine without decode graphs (on every rank)") from exc
        except BaseException as exc:
            del syncs[logged:]
            if self.world <= 1:
                raise
            raise_fail_stop(exc, self.group, group_rank(self.group),
                            f"capturing {step_kind} steps of {local.num_tokens} rows in a CUDA graph")
        self.pool = graph.pool()
        sync = syncs[-1] if len(syncs) > warmed else None
        del syncs[logged:]  # warm-up and capture are not steps
        self.graphs[(step_kind, local.num_tokens)] = CapturedStep(
            graph, ids, positions, meta, {name: cache_identity(t) for name, t in caches.items()}, hidden, sync)

    def _warm_up(self, ids: torch.Tensor, positions: torch.Tensor, meta: dict[str, torch.Tensor],
                 caches: dict[str, torch.Tensor], step_kind: str) -> None:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                self.runner(ids, positions, meta, caches, step_kind)
        current.wait_stream(side)

    def _refuse_if_not_capturable(self, step_kind: str) -> None:
        ask = getattr(self.runner, "capturable", None)
        if ask is None:
            return
        ok, why = ask(step_kind)
        if not ok:
            raise GraphCaptureError(f"{step_kind} steps cannot be captured in a CUDA graph: {why}; run the engine "
                                    "without decode graphs")

    # -- steps -----------------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: dict[str, torch.Tensor],
                 caches: dict[str, torch.Tensor], step_kind: str) -> torch.Tensor:
        captured = self.graphs.get((step_kind, int(input_ids.shape[0])))
        if captured is None:
            return self.runner(input_ids, positions, meta, caches, step_kind)
        if self.eager_every and (self.replays + self.eager_steps) % self.eager_every == 0:
            refuse_other_inputs(captured, input_ids, positions, meta, caches)
            self.eager_steps += 1
            with digest_forced():
                return self.runner(input_ids, positions, meta, caches, step_kind)
        try:
            refuse_other_inputs(captured, input_ids, positions, meta, caches)
            device_checks.raise_pending(self.device)
            captured.load(input_ids, positions, meta)
            captured.graph.replay()
        except BaseException as exc:
            if self.world <= 1:
                raise
            raise_fail_stop(exc, self.group, group_rank(self.group), f"the {step_kind} step (a CUDA-graph replay)")
        if captured.sync is not None:
            self.step_syncs.append(captured.sync)
        self.replays += 1
        return captured.hidden


def refuse_other_inputs(captured: CapturedStep, input_ids: torch.Tensor, positions: torch.Tensor,
                        meta: dict[str, torch.Tensor], caches: dict[str, torch.Tensor]) -> None:
    """A replay reads the captured tensors and writes the captured caches: refuse a step whose
    inputs would not fit them (other meta keys, shapes or dtypes) or whose caches are other tensors
    (reallocated: the graph would write freed memory and leave the new caches unsynchronised; the
    same address with another shape or layout would be written with the captured one's)."""
    if set(meta) != set(captured.meta):
        raise ValueError(f"step meta {sorted(meta)} differs from the captured step's {sorted(captured.meta)}")
    pairs = [("input_ids", input_ids, captured.input_ids), ("positions", positions, captured.positions)]
    pairs += [(f"meta[{k!r}]", meta[k], v) for k, v in captured.meta.items()]
    for name, given, static in pairs:
        if given.shape != static.shape or given.dtype != static.dtype:
            raise ValueError(f"{name}: {given.dtype}{list(given.shape)} where the captured step has "
                             f"{static.dtype}{list(static.shape)}")
    moved = sorted(name for name, t in caches.items() if captured.caches.get(name) != cache_identity(t))
    if moved or set(caches) != set(captured.caches):
        raise ValueError(f"caches {moved or sorted(set(caches) ^ set(captured.caches))} are not the tensors "
                         "the decode graphs were captured on; capture again after reallocating caches")


def cache_identity(t: torch.Tensor) -> tuple:
    """What a captured graph bakes in of a cache: its address, shape, strides and dtype."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
