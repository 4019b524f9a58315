"""The engine: scheduler + layout + one model step per rank + one all-gather + greedy sampling.

One step on rank ``r`` of ``P``::

    global step (scheduler, identical on every rank)
      -> plan_layout + build_local_step(r)          rows this rank runs, padded to T, on the host
      -> validate_plan (all ranks' writes)          PlanError before anything runs
      -> runner(input_ids, positions, meta, caches, step_kind) -> hidden [T, H]
                                                    this rank's step, copied to the device
      -> all_gather(hidden) [P*T, H] (P > 1)        the step's only collective from the engine
      -> [restore_index]                            global token order
      -> model.compute_logits(sampled rows)         same rows, same values on every rank
      -> argmax                                     identical tokens on every rank
      -> scheduler.update                           acceptance, compaction, block frees

A runner is any callable ``runner(input_ids, positions, meta, caches, step_kind) -> hidden``
(:data:`Runner`). The default runs the model eagerly; :func:`compiled_runner` wraps
``torch.compile`` with the row dim marked dynamic. A decode-sharding runner plugs in the same way:
it receives only this rank's rows and must leave every cache bitwise identical on all ranks when
it returns (synchronising the rows other ranks wrote); it may compile ``"decode"`` and ``"mixed"``
steps differently. :meth:`Engine.capture_decode_graphs` wraps the runner so that decode steps
replay from CUDA graphs (:mod:`pcppass.engine.graphs`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch
import torch.distributed as dist

from pcppass.contract import CacheGroupSpec, CacheSpec, StepKind
from pcppass.engine.graphs import CudaGraphRunner, decode_graph_sizes
from pcppass.runtime.collectives import all_gather_single
from pcppass.engine.layout import (
    LayoutPlan,
    LocalStep,
    Policy,
    build_local_step,
    padding_step,
    plan_layout,
    validate_plan,
)
from pcppass.engine.scheduler import GlobalStep, Scheduler, SchedulerConfig
from pcppass.engine.workload import RequestSpec
from pcppass.engine.attention.launch import decode_rows_per_rank
from pcppass.runtime.failstop import raise_fail_stop
from pcppass.runtime.liveness import wait_watched

Runner = Callable[
    [torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor], str], torch.Tensor
]


def eager_runner(model: torch.nn.Module) -> Runner:
    """Run the model as is (``step_kind`` ignored)."""

    def run(input_ids, positions, meta, caches, step_kind):
        return model(input_ids, positions, meta, caches)

    return run


def compiled_runner(model: torch.nn.Module, **compile_kwargs) -> Runner:
    """``torch.compile`` the model once for every local row count.

    Every tensor whose dim 0 follows the row count (ids, positions, every meta tensor: ``R`` is
    padded to ``T``, ``query_start_loc`` is ``T + 1``) is marked dynamic before the call, and the
    engine never hands out fewer than 2 rows, so one graph serves all counts instead of one
    compile per count. ``compile_kwargs`` go to ``torch.compile`` (``backend=...``).
    """
    compiled = torch.compile(model, **compile_kwargs)

    def run(input_ids, positions, meta, caches, step_kind):
        for t in (input_ids, positions, *meta.values()):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(input_ids, positions, meta, caches)

    return run


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (any dtype, any device)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


@dataclass
class StepRecord:
    index: int
    step_kind: StepKind
    rows: list[tuple[int, str, int, int]]  # (req_id, kind, start_position, num_tokens), global order
    #: decode rows: req_id -> owner rank (-1: every rank); partitioned prefills are absent
    owners: dict[int, int]
    tokens_per_rank: list[int]
    padded_tokens: int
    #: per sampled request, the greedy token of every sampled row (a verify row: all its rows)
    sampled: dict[int, list[int]]
    #: tokens each request gained (a verify row: its accepted drafts plus the bonus token)
    gained: dict[int, list[int]]
    finished: list[int]
    digests: dict[str, str] | None = None


@dataclass
class EngineConfig:
    num_blocks: int | dict[str, int] = 64
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 16
    max_model_len: int = 256
    max_chunk_tokens: int | None = None
    max_spec_width: int = 1
    enable_prefix_caching: bool = True
    #: local row counts are padded up to one of these (CUDA graphs); None: the largest rank's
    #: count, at least 2
    buckets: Sequence[int] | None = None
    validate: bool = True
    record_digests: bool = False
    #: in mixed steps, which ranks write a replicated row's cache rows: every rank (its own copy),
    #: or the first rank alone, whose rows the runner's sync brings to the others (vLLM's PCP
    #: write mask before decode sharding: replicated decode rows written once). Decode-only steps
    #: always write on every rank.
    mixed_replicated_writer: Literal["every_rank", "first_rank"] = "every_rank"
    #: ``(shape, dtype, device) -> zeroed tensor`` for every cache (default: ``torch.zeros``);
    #: ``pcppass.sync.peer.symmetric_zeros`` puts the replicas in symmetric memory (peer stores)
    cache_allocator: Callable[[tuple, torch.dtype, torch.device], torch.Tensor] | None = None


class Engine:
    """A paged decode engine for rank ``rank`` of ``world`` (see the module docstring).

    ``policy``: decode-row ownership (``round_robin``, ``sticky``, ``replicated``).
    ``partition_prefill``: DualChunkSwap prefill rows over the ranks (default: ``world > 1``).
    Any policy but ``replicated``, or a partitioned prefill, makes ranks write different rows:
    only a runner that synchronises the replicas keeps them identical, so with the default
    (eager) runner and ``world > 1`` those are refused.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        world: int = 1,
        rank: int = 0,
        group: dist.ProcessGroup | None = None,
        policy: Policy = "round_robin",
        runner: Runner | None = None,
        partition_prefill: bool | None = None,
        device: torch.device | str | None = None,
        **config,
    ) -> None:
        self.config = EngineConfig(**config)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world {world}")
        if partition_prefill is None:
            partition_prefill = world > 1
        if runner is None and world > 1 and (policy != "replicated" or partition_prefill):
            raise ValueError(
                f"policy={policy!r}, partition_prefill={partition_prefill} makes ranks write different "
                "cache rows; the default runner does not synchronise replicas. Pass a synchronising "
                "runner, or use policy='replicated' with partition_prefill=False."
            )
        self.model = model
        self.world, self.rank, self.group = world, rank, group
        self.policy, self.partition_prefill = policy, partition_prefill
        self.runner = runner or eager_runner(model)
        if device is None:
            tensors = [*model.parameters(), *model.buffers()]
            device = tensors[0].device if tensors else torch.device("cpu")
        self.device = torch.device(device)

        self.groups: list[CacheGroupSpec] = list(model.cache_groups())
        self.cache_specs: list[CacheSpec] = list(model.cache_specs())
        names = {g.name for g in self.groups}
        for spec in self.cache_specs:
            if spec.group not in names:
                raise ValueError(f"cache {spec.name!r} names unknown group {spec.group!r} (groups: {sorted(names)})")
        cfg = self.config
        self.scheduler = Scheduler(
            self.groups,
            cfg.num_blocks,
            SchedulerConfig(
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs,
                max_model_len=cfg.max_model_len,
                max_chunk_tokens=cfg.max_chunk_tokens,
                world=world,
            ),
            enable_prefix_caching=cfg.enable_prefix_caching,
            max_spec_width=cfg.max_spec_width,
        )
        zeros = cfg.cache_allocator or (lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
        self.caches: dict[str, torch.Tensor] = {
            spec.name: zeros((self.num_blocks(spec.group), *spec.block_shape), spec.dtype, self.device)
            for spec in self.cache_specs
        }
        self.step_log: list[StepRecord] = []
        #: local token counts whose decode steps replay from CUDA graphs (capture_decode_graphs)
        self.graph_sizes: tuple[int, ...] = ()

    # -- CUDA graphs ---------------------------------------------------------------------------
    def capture_decode_graphs(self, sizes: Sequence[int] | None = None, *, eager_every: int = 64) -> tuple[int, ...]:
        """Capture decode steps of each local token count in ``sizes`` (default: 2, 4, 8, then
        multiples of 8 up to :attr:`decode_rows_per_rank` times the spec width) in CUDA graphs and
        replay them from now on: decode-only steps are padded to the smallest size that holds
        them, larger ones and mixed steps run as before. Capture runs all-padding steps (nothing
        is written) over this engine's caches, so it must come after any runner warm-up and
        before the first step; every rank must call it alike. CUDA only. ``eager_every``: see
        :class:`~pcppass.engine.graphs.CudaGraphRunner`."""
        if self.graph_sizes:
            raise RuntimeError(f"decode graphs already captured for sizes {self.graph_sizes}")
        if not self.config.validate:
            raise ValueError("decode graphs skip the cache-write ops' own checks of their slots: they need the "
                             "engine's plan validation (validate=True), which checks every slot before a step")
        sizes = tuple(sorted(set(sizes or decode_graph_sizes(self.decode_rows_per_rank * self.config.max_spec_width))))
        if sizes[0] < 2:
            raise ValueError(f"graph sizes must be >= 2 (the layout never hands out fewer rows), got {sizes}")
        self._refuse_sizes_other_ranks_do_not_share(sizes)
        graphs = CudaGraphRunner(self.runner, self.device, eager_every=eager_every, world=self.world,
                                 group=self.group)
        with decode_rows_per_rank(self.decode_rows_per_rank):
            for size in sizes:
                local = padding_step(size, self.rank, self.world, self.groups, self.table_columns, self.device)
                graphs.capture(local, self.caches, "decode")
        self.runner, self.graph_sizes = graphs, sizes
        return sizes

    def _refuse_sizes_other_ranks_do_not_share(self, sizes: tuple[int, ...]) -> None:
        """Ranks that captured different sizes would pad one step differently (and their
        collectives would not match): every rank compares all ranks' sizes, so all refuse alike."""
        if self.world <= 1:
            return
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, sizes, group=self.group)
        if any(other != sizes for other in every):
            raise ValueError(f"ranks asked for different decode graph sizes: {every}")

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, spec: RequestSpec) -> None:
        self.scheduler.add_request(spec)

    def add_requests(self, specs: Sequence[RequestSpec]) -> None:
        for s in specs:
            self.add_request(s)

    def outputs(self) -> dict[int, list[int]]:
        reqs = list(self.scheduler.finished.values()) + self.scheduler.running + list(self.scheduler.waiting)
        return {r.req_id: list(r.output) for r in sorted(reqs, key=lambda r: r.req_id)}

    # -- sizes ---------------------------------------------------------------------------------
    def num_blocks(self, group: str) -> int:
        nb = self.config.num_blocks
        return nb[group] if isinstance(nb, dict) else nb

    def table_columns(self, group: str) -> int:
        return self.scheduler.kv.table_columns(group)

    # -- stepping ------------------------------------------------------------------------------
    def run(self, max_steps: int = 10_000) -> dict[int, list[int]]:
        for _ in range(max_steps):
            if self.step() is None:
                return self.outputs()
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")

    def step(self) -> StepRecord | None:
        """Schedule and run one step; None when every request is finished."""
        if not self.scheduler.has_unfinished():
            return None
        return self.execute(self.scheduler.schedule())

    def plan(self, step: GlobalStep) -> tuple[LayoutPlan, list[LocalStep]]:
        """The layout and every rank's local step (all ranks' are needed to validate)."""
        plan = plan_layout(
            step, self.world, self.policy, partition_prefill=self.partition_prefill, buckets=self.config.buckets,
            graph_sizes=self.graph_sizes,
        )
        ranks = range(self.world) if self.config.validate else [self.rank]
        first_only = self._replicated_writers(step) == "first_rank"
        # Built and validated on the host (validation reads every slot); only this rank's step
        # goes to the device (execute).
        locals_ = [
            build_local_step(step, plan, r, self.groups, self.table_columns, "cpu",
                             writes_replicated=not first_only or r == 0)
            for r in ranks
        ]
        return plan, locals_

    @property
    def decode_rows_per_rank(self) -> int:
        """Decode rows a rank runs when the engine is full (``max_num_seqs`` requests decoding):
        all of them replicated, a ``1 / world`` share sharded. The attention kernels are launched
        for it (:func:`pcppass.engine.attention.launch.decode_rows_per_rank`): a constant of the
        engine, the same on every rank, so a row's result never depends on the rows of its step."""
        seqs = self.config.max_num_seqs
        return seqs if self.policy == "replicated" else -(-seqs // self.world)

    def _replicated_writers(self, step: GlobalStep) -> str:
        return "first_rank" if step.step_kind == "mixed" and self.config.mixed_replicated_writer == "first_rank" \
            else "every_rank"

    def execute(self, step: GlobalStep) -> StepRecord:
        """Run a scheduled step. A :class:`PlanError` leaves caches and requests untouched."""
        sampled: dict[int, list[int]] = {}
        plan = None
        if step.rows:  # a step with no rows (nothing arrived yet) is the same on every rank
            plan, locals_ = self.plan(step)
            if self.config.validate:
                validate_plan(step, plan, locals_, self.groups, self.num_blocks, self.scheduler.kv.is_shared,
                              self._replicated_writers(step))
            local = (locals_[self.rank] if self.config.validate else locals_[0]).to(self.device)
            with decode_rows_per_rank(self.decode_rows_per_rank):
                hidden = self.runner(local.input_ids, local.positions, local.meta, self.caches, step.step_kind)
            if hidden.dim() != 2 or hidden.shape[0] != local.num_tokens:
                raise ValueError(
                    f"runner returned hidden of shape {tuple(hidden.shape)}, expected [{local.num_tokens}, hidden_size]"
                )
            sampled = self._sample(step, plan, hidden)
        update = self.scheduler.update(step, sampled)
        record = StepRecord(
            index=step.index,
            step_kind=step.step_kind,
            rows=[(r.req_id, r.kind, r.start_position, r.num_tokens) for r in step.rows],
            owners={
                r.req_id: o
                for r, o in zip(step.rows, plan.owners if plan else ())
                if r.kind == "decode" and o is not None
            },
            tokens_per_rank=plan.tokens_per_rank() if plan else [0] * self.world,
            padded_tokens=plan.padded_tokens if plan else 0,
            sampled=sampled,
            gained=update.gained,
            finished=update.finished,
            digests=self.cache_digests() if self.config.record_digests else None,
        )
        self.step_log.append(record)
        return record

    def _sample(self, step: GlobalStep, plan: LayoutPlan, hidden: torch.Tensor) -> dict[int, list[int]]:
        if self.world > 1:
            gathered = hidden.new_empty((self.world * hidden.shape[0], *hidden.shape[1:]))
            try:
                # no grad: gloo gathers some dtypes (bfloat16) into views of `gathered`, which grad
                # mode refuses to write in place (the copy may run when the work is waited on)
                with torch.no_grad():
                    work = all_gather_single(gathered, hidden.contiguous(), group=self.group, async_op=True)
                    if hidden.device.type == "cpu":
                        # gloo: a wait that ends once the liveness watch declares a peer dead
                        # (gloo's own lasts until the process-group timeout)
                        wait_watched(work, self.group, "the engine's all-gather of hidden rows")
                    else:
                        work.wait()
            except Exception as exc:  # typically: a peer failed its step and aborted the group
                raise_fail_stop(exc, self.group, self.rank, "the engine's all-gather of hidden rows")
        else:
            gathered = hidden
        offsets = step.row_offsets()
        rows_to_sample = [
            plan.restore_index[offsets[i] + j]
            for i, r in enumerate(step.rows)
            for j in range(r.sample_from, r.num_tokens)
        ]
        if not rows_to_sample:
            return {}
        idx = torch.tensor(rows_to_sample, dtype=torch.int64, device=gathered.device)
        tokens = self.model.compute_logits(gathered.index_select(0, idx)).argmax(dim=-1).tolist()
        out: dict[int, list[int]] = {}
        k = 0
        for r in step.rows:
            n = r.num_tokens - r.sample_from
            if n:
                out[r.req_id] = tokens[k : k + n]
                k += n
        return out

    # -- verification --------------------------------------------------------------------------
    def cache_digests(self) -> dict[str, str]:
        """sha256 of every piece of state's bytes: each cache by name, each model buffer as
        ``buffer:<qualified name>`` (a model may keep state in buffers too: counters, running
        statistics; replicas must agree on those as well)."""
        digests = {name: tensor_digest(t) for name, t in self.caches.items()}
        for name, buffer in self.model.named_buffers():
            digests[f"buffer:{name}"] = tensor_digest(buffer)
        return digests
