"""Where a serving engine's decode step spends its time: host against device, one GPU, world 1.

    python bench/profile_engine.py --model llama --layers 2 --out bench/results --tag h200

Serves the workload of ``pcppass bench serve`` (one hit rate, replicated decode on one rank, the
model compiled by Inductor) twice: decode steps launched eagerly, and replayed from CUDA graphs
(``Engine.capture_decode_graphs``). Per decode step it records the host's wall time of
``engine.step()`` (what the serving loop sees) and the device time of the model step (CUDA events
around the runner), and profiles the decode steps' Python with cProfile. Writes
``<out>/profile_engine_<tag>.json`` and ``.md``: per variant the mean step and device times and the
functions that took the most host time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import statistics
import time

import torch

from pcppass.bench.environment import environment
from pcppass.bench.results import write


def profile_variant(model, cfg, graphs: bool, top: int) -> dict:
    from pcppass.bench.serve import engine_config, workload
    from pcppass.engine.runner import Engine, compiled_runner
    from pcppass.engine.serve import ServingLoop

    engine = Engine(model, runner=compiled_runner(model, fullgraph=True), policy="replicated",
                    **engine_config(model, cfg))
    if graphs:
        engine.capture_decode_graphs()
    block_size = math.lcm(*(g.block_size for g in model.cache_groups()))
    warm, requests = workload(cfg, cfg.hit_rates[0], block_size, model.embed_tokens.num_embeddings)
    ServingLoop(engine, [warm], 1).run()

    device_ms: list[float] = []
    inner = engine.runner

    def timed_runner(ids, positions, meta, caches, step_kind):
        if step_kind != "decode":
            return inner(ids, positions, meta, caches, step_kind)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = inner(ids, positions, meta, caches, step_kind)
        end.record()
        device_ms.append((start, end))
        return out

    engine.runner = timed_runner
    profiler = cProfile.Profile()
    host_ms: list[float] = []
    step = engine.step

    def profiled_step():
        t0 = time.perf_counter()
        profiler.enable()
        record = step()
        profiler.disable()
        if record is not None and record.step_kind == "decode":
            host_ms.append(1000 * (time.perf_counter() - t0))
        return record

    engine.step = profiled_step
    torch.cuda.synchronize()
    ServingLoop(engine, requests, cfg.concurrency).run()
    torch.cuda.synchronize()
    device = [s.elapsed_time(e) for s, e in device_ms]
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return {"cuda_graphs": graphs, "decode_steps": len(host_ms),
            "step_ms_mean": statistics.fmean(host_ms), "step_ms_median": statistics.median(host_ms),
            "device_ms_mean": statistics.fmean(device), "device_ms_median": statistics.median(device),
            "replays": getattr(inner, "replays", 0), "profile": text.getvalue()}


def markdown(result: dict) -> str:
    env, cfg = result["environment"], result["config"]
    lines = [f"# Engine decode step, host against device: {env.get('device', '')}", "",
             f"{env.get('date', '')} · torch {env.get('torch', '')} · {cfg['model']}, {cfg['layers']} layers, "
             f"{cfg['requests']} requests of {cfg['prompt_len']} tokens, hit {cfg['hit_rate']:.0%}, "
             f"concurrency {cfg['concurrency']}, {cfg['output_len']} output tokens", "",
             "| variant | decode steps | engine.step() ms, mean / median | model step between CUDA events ms, mean / median |",
             "|---|---|---|---|"]
    for v in result["variants"]:
        name = "CUDA graphs" if v["cuda_graphs"] else "eager launch"
        lines.append(f"| {name} | {v['decode_steps']} | {v['step_ms_mean']:.2f} / {v['step_ms_median']:.2f} | "
                     f"{v['device_ms_mean']:.2f} / {v['device_ms_median']:.2f} |")
    for v in result["variants"]:
        lines += ["", f"## Host profile, {'CUDA graphs' if v['cuda_graphs'] else 'eager launch'} "
                      "(every step during the measured run, by own time)", "", "```", v["profile"].strip(), "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    from pcppass.bench.serve import ServeBenchConfig
    from pcppass.bench.step import configure_dynamo
    from pcppass.models import build_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16384)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hit-rate", type=float, default=0.99)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="h200")
    args = parser.parse_args()
    configure_dynamo()
    cfg = ServeBenchConfig(model=args.model, layers=args.layers, world=1, num_requests=args.requests,
                           concurrency=args.concurrency, prompt_len=args.prompt_len, output_len=args.output_len,
                           max_num_batched_tokens=max(16, args.prompt_len // 4), hit_rates=(args.hit_rate,))
    model = build_model(args.model, "full", device="cuda", num_layers=args.layers)
    result = {"environment": environment(), "config": {**vars(args), "world": 1},
              "variants": [profile_variant(model, cfg, graphs, args.top) for graphs in (False, True)]}
    print(write(args.out, f"profile_engine_{args.tag}", result, markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
