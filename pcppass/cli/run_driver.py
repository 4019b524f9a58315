"""Run one workload single-rank and decode-sharded, and compare: the check behind ``pcppass run``.

:func:`rank_main` runs on each of P ranks (started by :func:`pcppass.engine.launch.launch`): it
builds the model and a :func:`~pcppass.sharded.sharded_engine`, runs the workload and returns, per
step, the digest of every state tensor, the tokens, the owners and the sync the graph issued.
:func:`reference_run` runs the same workload on one rank with the model run eagerly.
:func:`compare` checks that every state tensor is identical on all ranks after every step and that
the tokens equal the reference's, and names the first state tensor that diverged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pcppass.engine.runner import Engine
from pcppass.engine.workload import RequestSpec, WorkloadConfig, generate_workload


@dataclass(frozen=True)
class RunConfig:
    """One verification run. ``model`` is a built-in name, or ``"module:factory"``."""

    model: str = "llama"
    size: str = "tiny"
    world: int = 2
    steps: int = 32
    policy: str = "round_robin"
    schedule: str = "deferred"
    inner: str = "eager"
    device: str = "cpu"
    on_uncovered: str = "raise"
    #: decode context parallel size: > 1 shards the cache itself, so decode stays replicated
    dcp_size: int = 1
    #: patterns removed before compiling (negative controls)
    unregister: tuple[str, ...] = ()
    num_requests: int = 10
    prompt_len: tuple[int, int] = (4, 14)
    max_new_tokens: tuple[int, int] = (3, 12)
    mean_arrival_gap: float = 2.0
    spec_width: int = 2
    prefix_hit_rate: float = 0.0
    seed: int = 0
    num_blocks: int = 48
    max_num_batched_tokens: int = 24
    max_num_seqs: int = 8
    max_model_len: int = 64
    model_overrides: tuple[tuple[str, Any], ...] = ()
    #: caches in symmetric memory (CUDA): the backend then syncs them with direct peer stores
    symmetric_caches: bool = False


@dataclass
class RunResult:
    rank: int
    world: int
    outputs: dict[int, list[int]]
    #: per step: {state name: sha256}
    digests: list[dict[str, str]]
    step_kinds: list[str]
    owners: list[dict[int, int]]
    tokens_per_rank: list[list[int]]
    #: per step: (collectives, bytes sent, bytes gathered); empty for the reference
    syncs: list[tuple[int, int, int]] = field(default_factory=list)
    mode: str = "single_rank"
    unfinished: int = 0
    #: per step: tokens of the widest decode row (speculative verify rows are wider than 1)
    widest_decode_row: list[int] = field(default_factory=list)
    #: per graph kind ("decode", "mixed"): sync all-gathers in each compiled graph, one per compile
    graph_collectives: dict[str, list[int]] = field(default_factory=dict)
    #: per graph kind: how each compiled graph moves rows (peer stores, all-gather and why)
    transports: dict[str, list[str]] = field(default_factory=dict)


def build(cfg: RunConfig) -> torch.nn.Module:
    if ":" in cfg.model:
        import importlib

        module, factory = cfg.model.split(":", 1)
        return getattr(importlib.import_module(module), factory)()
    from pcppass.models import build_model

    return build_model(cfg.model, cfg.size, device=cfg.device, **dict(cfg.model_overrides))


def workload(cfg: RunConfig, block_size: int, vocab_size: int) -> list[RequestSpec]:
    return generate_workload(WorkloadConfig(
        num_requests=cfg.num_requests, prompt_len=cfg.prompt_len, max_new_tokens=cfg.max_new_tokens,
        mean_arrival_gap=cfg.mean_arrival_gap, prefix_hit_rate=cfg.prefix_hit_rate,
        block_size=block_size, vocab_size=vocab_size, spec_width=cfg.spec_width, seed=cfg.seed,
    ))


def _engine_config(cfg: RunConfig) -> dict[str, Any]:
    from pcppass.sync.peer import symmetric_zeros

    return dict(num_blocks=cfg.num_blocks, max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                max_spec_width=cfg.spec_width, record_digests=True,
                cache_allocator=symmetric_zeros if cfg.symmetric_caches else None)


def _vocab(model: torch.nn.Module) -> int:
    return int(getattr(getattr(model, "config", None), "vocab_size", 0) or 32)


def _drive(engine: Engine, cfg: RunConfig, model: torch.nn.Module, rank: int, world: int,
           after_step: Callable[[], tuple[int, int, int] | None]) -> RunResult:
    block_size = min(g.block_size for g in engine.groups)
    engine.add_requests(workload(cfg, block_size, _vocab(model)))
    result = RunResult(rank, world, {}, [], [], [], [])
    for _ in range(cfg.steps):
        record = engine.step()
        if record is None:
            break
        result.digests.append(record.digests or engine.cache_digests())
        result.step_kinds.append(record.step_kind)
        result.owners.append(dict(record.owners))
        result.tokens_per_rank.append(list(record.tokens_per_rank))
        result.widest_decode_row.append(
            max((n for _, kind, _, n in record.rows if kind == "decode"), default=0))
        sync = after_step()
        if sync is not None:
            result.syncs.append(sync)
    result.outputs = engine.outputs()
    result.unfinished = len(engine.scheduler.running) + len(engine.scheduler.waiting)
    return result


def reference_run(cfg: RunConfig) -> RunResult:
    """The workload on one rank, the model run eagerly: the tokens to match."""
    model = build(cfg)
    engine = Engine(model, world=1, rank=0, device=cfg.device, **_engine_config(cfg))
    return _drive(engine, cfg, model, 0, 1, lambda: None)


def rank_main(rank: int, world: int, cfg: RunConfig) -> RunResult:
    """One rank of the decode-sharded run (called by :func:`pcppass.engine.launch.launch`)."""
    from pcppass.registry import load_builtin_patterns, unregister_pattern
    from pcppass.sharded import ShardedRunner, sharded_engine

    load_builtin_patterns()
    for name in cfg.unregister:
        unregister_pattern(name)
    model = build(cfg)
    runner = ShardedRunner(model, inner=cfg.inner, decode_schedule=cfg.schedule,
                           on_uncovered=cfg.on_uncovered, dcp_size=cfg.dcp_size)
    engine = sharded_engine(model, runner, world=world, rank=rank, policy=cfg.policy,
                            device=cfg.device, **_engine_config(cfg))

    def after_step() -> tuple[int, int, int]:
        if cfg.symmetric_caches:  # peers store their next step's rows here: digest this step first
            torch.distributed.barrier()
        s = runner.step_syncs[-1]
        return (s.collectives, s.bytes_sent, s.bytes_gathered)

    result = _drive(engine, cfg, model, rank, world, after_step)
    result.mode = "replicated" if runner.replicated else "sharded"
    result.graph_collectives = {
        kind: [r.all_gather_nodes for r in backend.reports] for kind, backend in runner.backends.items()
    }
    result.transports = {kind: [r.transport for r in backend.reports if r.transport]
                         for kind, backend in runner.backends.items()}
    return result


@dataclass
class Verification:
    steps: int
    tokens_equal: bool
    #: (step, state name, per-rank digest prefixes) of every state that differs across ranks
    divergent: list[tuple[int, str, list[str]]]
    #: per step: kind, rows per rank, collectives, bytes gathered (rank 0)
    per_step: list[tuple[int, str, list[int], int, int]]
    mode: str
    unfinished: int
    token_mismatches: list[int] = field(default_factory=list)

    #: steps each rank ran; ranks that ran different numbers of steps are out of step
    step_counts: list[int] = field(default_factory=list)
    #: per graph kind: how each compiled graph moves rows (rank 0's)
    transports: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.tokens_equal and not self.divergent and len(set(self.step_counts)) <= 1

    def first_divergence(self) -> str | None:
        if not self.divergent:
            return None
        step, name, digests = self.divergent[0]
        return f"step {step}: state {name} differs across ranks ({', '.join(digests)})"


#: the pseudo state a divergence entry names when ranks ran different numbers of steps
STEP_COUNT = "(steps run)"


def compare(reference: RunResult, ranks: list[RunResult]) -> Verification:
    """Every state equal on every rank after every step, every rank's tokens equal the reference's.

    Ranks that report different numbers of steps fail the verification (a divergence entry named
    :data:`STEP_COUNT` at the first step some rank lacks) instead of being compared on the steps
    they share. A state tensor missing on some rank at a step counts as divergent too.
    """
    divergent = []
    counts = [len(r.digests) for r in ranks]
    steps = min(counts)
    for i in range(steps):
        for name in sorted(set().union(*(r.digests[i] for r in ranks))):
            values = [r.digests[i].get(name, "missing") for r in ranks]
            if len(set(values)) > 1:
                divergent.append((i, name, [v[:8] for v in values]))
    if len(set(counts)) > 1:
        divergent.append((steps, STEP_COUNT, [f"rank {r}: {n} steps" for r, n in enumerate(counts)]))
    mismatches = sorted(
        req for r in ranks for req in set(reference.outputs) | set(r.outputs)
        if reference.outputs.get(req) != r.outputs.get(req)
    )
    per_step = [
        (i, ranks[0].step_kinds[i], ranks[0].tokens_per_rank[i],
         ranks[0].syncs[i][0] if i < len(ranks[0].syncs) else 0,
         ranks[0].syncs[i][2] if i < len(ranks[0].syncs) else 0)
        for i in range(steps)
    ]
    return Verification(steps, not mismatches, divergent, per_step, ranks[0].mode,
                        max(r.unfinished for r in ranks), sorted(set(mismatches)), counts, ranks[0].transports)

