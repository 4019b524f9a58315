"""``pcppass bench serve``: the engine end to end, the seed's serving workload, decode replicated vs sharded.

The workload (:func:`workload`) has the shape of the benchmark behind vLLM's decode sharding
(long prompts sharing a prefix at a target hit rate, fixed output length, a client with a
concurrency limit, chunked prefill under ``max_num_batched_tokens``), scaled to the machine. For
each hit rate, every mode serves the same requests in the same order on fresh caches (a warm-up
request first fills the prefix cache and compiles; it is not measured), ``repeats`` rounds of it with
the modes' order rotated by one each round (:func:`mode_order`), so that no mode always runs first or
last and the report can show medians, ranges and whether a mode's sign against replicated holds in
every round (one run per mode was noisier than the differences between modes):

* ``replicated``: PCP as vLLM runs it without decode sharding: prefills partitioned over the ranks
  (DualChunkSwap) and synchronised per write site; decode rows run on every rank, with no sync
  in decode-only steps (every rank writes its own copy) and, in mixed steps, written by rank 0
  alone and synchronised with the prefill rows;
* ``pcppass``: decode rows sharded round-robin, pcppass's one deferred sync per decode step
  (:class:`pcppass.sharded.ShardedRunner`);
* ``per_site``: decode rows sharded, one sync per write site (the seed's method);
* ``nosync``: decode rows sharded, decode steps without any sync: the upper bound of sharding
  (replicas diverge, so its tokens are meaningless; timing only).

Sync checks stay on (:class:`pcppass.checks.SyncChecks` defaults) and each mode records the
transport its graphs used. Each mode's engine launches its attention kernels for its decode rows
per rank (``Engine.decode_rows_per_rank``: ``concurrency`` replicated, ``concurrency / world``
sharded), as its deployment would. On CUDA (unless ``cuda_graphs`` is off) each engine captures its
decode steps in CUDA graphs before its warm-up request (``Engine.capture_decode_graphs``), so the
decode steps measure less of the host. After each run every cache is compared bitwise across ranks.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from pcppass.bench import sync_info
from pcppass.bench.environment import environment
from pcppass.bench.results import save_partial
from pcppass.engine.workload import RequestSpec, WorkloadConfig, generate_workload

MODES = ("replicated", "pcppass", "per_site", "nosync")
DEFAULT_MODES = MODES


@dataclass(frozen=True)
class ServeBenchConfig:
    model: str = "deepseek_v32"
    size: str = "full"
    layers: int = 2
    world: int = 2
    device: str = "cuda"
    modes: tuple[str, ...] = DEFAULT_MODES
    hit_rates: tuple[float, ...] = (0.8, 0.9, 0.95, 0.99)
    num_requests: int = 64
    concurrency: int = 32
    prompt_len: int = 16384
    output_len: int = 128
    #: the seed: 32768 for 128k prompts; scaled with the prompt by default (a quarter of it)
    max_num_batched_tokens: int = 4096
    #: compiler of every graph ("inductor" on GPUs; "eager" keeps CPU runs short)
    inner: str = "inductor"
    seed: int = 0
    progress: bool = True
    out: str = "bench/results"
    tag: str = ""
    timeout_s: float = 580.0
    #: rounds per hit rate; each round runs every mode once, in the order :func:`mode_order` gives
    repeats: int = 3
    #: capture each engine's decode steps in CUDA graphs (cuda only; ignored on cpu)
    cuda_graphs: bool = True

    @property
    def captures_decode_graphs(self) -> bool:
        return self.device == "cuda" and self.cuda_graphs


def mode_order(modes: Sequence[str], round_index: int) -> tuple[str, ...]:
    """The modes of round ``round_index``: ``modes`` rotated left by the round, so over ``len(modes)``
    rounds every mode runs once in every position (a mode that always ran first, on a cold process,
    or last, after the others' allocations, would carry that bias in every number)."""
    k = round_index % len(modes) if modes else 0
    return tuple(modes[k:]) + tuple(modes[:k])


def run_order(cfg: ServeBenchConfig) -> Iterator[tuple[float, int, int, str]]:
    """(hit rate, round, position in the round, mode) in the order the bench runs them: the rounds of
    one hit rate back to back, so the runs compared with each other are close in time."""
    for hit in cfg.hit_rates:
        for round_index in range(cfg.repeats):
            for position, mode in enumerate(mode_order(cfg.modes, round_index)):
                yield hit, round_index, position, mode


def workload(cfg: ServeBenchConfig, hit_rate: float, block_size: int, vocab: int) -> tuple[RequestSpec, list[RequestSpec]]:
    """(warm-up request, measured requests): every prompt is ``prompt_len`` tokens whose first
    ``hit_rate`` share (block-aligned) is one common prefix; the warm-up request's prompt starts with
    it too, so the measured requests find it cached. Same seed, same requests in every mode."""
    specs = generate_workload(WorkloadConfig(
        num_requests=cfg.num_requests + 1, prompt_len=(cfg.prompt_len, cfg.prompt_len),
        max_new_tokens=(cfg.output_len, cfg.output_len), prefix_hit_rate=hit_rate, block_size=block_size,
        vocab_size=vocab, seed=cfg.seed))
    warm = specs[0]
    return RequestSpec(req_id=-1, prompt=warm.prompt, max_new_tokens=2), specs[1:]


class SplitRunner:
    """Decode-only steps through ``decode`` (a plain runner: no sync), mixed steps through the
    sharded runner's mixed graph (partitioned prefill, a sync after each write site)."""

    def __init__(self, decode: Callable, sharded):
        self.decode, self.sharded = decode, sharded
        self.step_syncs = sharded.step_syncs

    def capturable(self, step_kind: str) -> tuple[bool, str]:
        if step_kind == "decode":  # a plain torch.compile, no pcppass backend to ask: capture tries
            return True, ""
        return self.sharded.capturable(step_kind)

    def __call__(self, input_ids, positions, meta, caches, step_kind):
        if step_kind == "decode":
            return self.decode(input_ids, positions, meta, caches, step_kind)
        return self.sharded(input_ids, positions, meta, caches, "mixed")


def build_runners(model: torch.nn.Module, cfg: ServeBenchConfig) -> dict[str, Any]:
    """mode -> runner (compiled once, shared by every hit rate)."""
    from pcppass.engine.runner import compiled_runner, eager_runner
    from pcppass.sharded import ShardedRunner

    plain = eager_runner(model) if cfg.inner == "eager" else compiled_runner(model, fullgraph=True)
    runners: dict[str, Any] = {}
    for mode in cfg.modes:
        if mode in ("pcppass", "per_site"):
            runners[mode] = ShardedRunner(model, inner=cfg.inner,
                                          decode_schedule="deferred" if mode == "pcppass" else "immediate")
        else:
            runners[mode] = SplitRunner(plain, ShardedRunner(model, inner=cfg.inner, decode_schedule="immediate"))
    return runners


def engine_config(model: torch.nn.Module, cfg: ServeBenchConfig) -> dict[str, Any]:
    """Blocks for ``concurrency`` requests in flight plus the warm-up and the shared prefix."""
    max_len = cfg.prompt_len + cfg.output_len
    chunk = cfg.max_num_batched_tokens
    blocks = {g.name: 16 + (cfg.concurrency + 2) * g.blocks_for(max_len, chunk) for g in model.cache_groups()}
    return dict(num_blocks=blocks, max_num_batched_tokens=chunk, max_num_seqs=cfg.concurrency,
                max_model_len=max_len)


def build_engine(mode: str, model, runner, rank: int, world: int, cfg: ServeBenchConfig):
    from pcppass.engine.runner import Engine
    from pcppass.sharded import sharded_engine

    config = engine_config(model, cfg)
    if mode in ("pcppass", "per_site"):
        return sharded_engine(model, runner, world=world, rank=rank, policy="round_robin", **config)
    if mode == "replicated":
        return Engine(model, world=world, rank=rank, policy="replicated", partition_prefill=True, runner=runner,
                      mixed_replicated_writer="first_rank", **config)
    return Engine(model, world=world, rank=rank, policy="round_robin", partition_prefill=True, runner=runner,
                  **config)


class Progress:
    """A rich progress bar on rank 0: requests completed per (hit rate, mode)."""

    def __init__(self, enabled: bool):
        self.bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
                TimeElapsedColumn

            self.bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("req"), TimeElapsedColumn())
            self.bar.start()

    def task(self, description: str, total: int):
        if self.bar is None:
            return lambda record, loop: None
        task = self.bar.add_task(description, total=total)
        return lambda record, loop: self.bar.update(task, completed=loop.completed)

    def log(self, message: str) -> None:
        if self.bar is not None:
            self.bar.console.log(message)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def serve_once(mode: str, hit: float, model, runner, rank: int, world: int, cfg: ServeBenchConfig,
               progress: Progress, label: str = "") -> dict[str, Any]:
    from pcppass.bench.inputs import caches_equal_across_ranks
    from pcppass.engine.serve import ServingLoop

    block_size = math.lcm(*(g.block_size for g in model.cache_groups()))  # every group's blocks end there
    warm, requests = workload(cfg, hit, block_size, model.embed_tokens.num_embeddings)
    t0 = time.time()
    engine = build_engine(mode, model, runner, rank, world, cfg)
    capture_s, graph_sizes = _capture_decode_graphs(engine, cfg)
    ServingLoop(engine, [warm], 1).run()  # fills the prefix cache; compiles on first use
    warm_s = time.time() - t0
    loop = ServingLoop(engine, requests, cfg.concurrency,
                       on_step=progress.task(f"{mode:>10} hit {hit:.0%}{label}", len(requests)))
    if cfg.device == "cuda":
        torch.cuda.synchronize()
    run = loop.run()
    equal = caches_equal_across_ranks(engine.caches) if world > 1 else {}
    steps = [s for s in run.steps]
    entry = {
        "mode": mode, "hit_rate_target": hit, "warmup_s": round(warm_s, 1), **run.metrics(),
        "cuda_graphs": cfg.captures_decode_graphs, "capture_s": capture_s, "decode_graph_sizes": graph_sizes,
        "replicas_equal": all(equal.values()), "differing_caches": [k for k, ok in equal.items() if not ok],
        "submitted": run.submitted, "admitted": run.admitted,
        "mean_decode_step_ms": _mean_ms([s.seconds for s in steps if s.step_kind == "decode"]),
        "mean_mixed_step_ms": _mean_ms([s.seconds for s in steps if s.step_kind == "mixed"]),
        "outputs_digest": _outputs_digest(engine),
        "decode_rows_per_rank": engine.decode_rows_per_rank,
    }
    sharded = getattr(runner, "sharded", runner)
    entry["sync"] = {kind: {**sync_info.transport(b), "checks": sync_info.checks(b)}
                     for kind, b in sharded.backends.items()}
    if mode in ("replicated", "nosync"):
        entry["sync"]["decode"] = {"transport": "none (decode steps run without sync)"}
    del engine
    if cfg.device == "cuda":
        torch.cuda.empty_cache()
    return entry


def _capture_decode_graphs(engine, cfg: ServeBenchConfig) -> tuple[float | None, list[int] | None]:
    """Capture the engine's decode steps in CUDA graphs where the config asks for it (before the
    warm-up request, so the warm-up's decode steps already replay): (seconds taken, the captured
    sizes the engine reports), (None, None) if not."""
    if not cfg.captures_decode_graphs:
        return None, None
    t0 = time.time()
    sizes = engine.capture_decode_graphs()
    return round(time.time() - t0, 1), list(sizes)


def _mean_ms(seconds: list[float]) -> float | None:
    return 1000 * sum(seconds) / len(seconds) if seconds else None


def _outputs_digest(engine) -> str:
    import hashlib

    outputs = engine.outputs()
    return hashlib.sha256(repr(sorted((k, v) for k, v in outputs.items() if k >= 0)).encode()).hexdigest()[:16]


def serve_rank(rank: int, world: int, cfg: ServeBenchConfig) -> dict:
    """One rank of the serving bench (started by :func:`pcppass.engine.launch.launch`)."""
    from pcppass.bench.step import configure_dynamo
    from pcppass.ops import checks
    from pcppass.sync import rows_cuda
    from pcppass.models import build_model

    configure_dynamo()
    dtype = torch.bfloat16 if cfg.size == "full" else torch.float32
    model = build_model(cfg.model, cfg.size, dtype=dtype, device=cfg.device, num_layers=cfg.layers)
    runners = build_runners(model, cfg)
    result: dict[str, Any] = {"environment": environment(), "config": asdict(cfg), "runs": [], "errors": []}
    progress = Progress(cfg.progress and rank == 0)
    name = f"serve_{cfg.tag}"
    try:
        with rows_cuda.kernels_enabled(cfg.device == "cuda"), checks.value_checks(cfg.device != "cuda"):
            for hit, round_index, position, mode in run_order(cfg):
                label = f" round {round_index + 1}/{cfg.repeats}"
                try:
                    run = serve_once(mode, hit, model, runners[mode], rank, world, cfg, progress, label)
                    run.update(repeat=round_index, order_position=position)
                    result["runs"].append(run)
                    progress.log(f"{mode} hit {hit:.0%}{label}: {run['request_throughput']:.3f} req/s, "
                                 f"TPOT {run.get('mean_tpot_ms', float('nan')):.2f} ms, "
                                 f"TTFT {run.get('mean_ttft_ms', float('nan')):.0f} ms, "
                                 f"replicas equal {run['replicas_equal']}")
                except Exception:
                    result["errors"].append({"mode": mode, "hit_rate": hit, "repeat": round_index,
                                             "traceback": traceback.format_exc()[-3000:]})
                    progress.log(result["errors"][-1]["traceback"])
                    raise
                if rank == 0:
                    save_partial(cfg.out, name, result)
    finally:
        progress.stop()
    return result
