"""The engine's decode steps replayed from CUDA graphs (skipped without a GPU; the host side:
tests/test_engine_graphs.py).

* one GPU: full-width models (2 layers, bf16, the paged Triton kernels, Inductor) serve the same
  requests with decode graphs and with eager launches padded to the same sizes: the same tokens and
  bitwise the same caches, with most decode steps replayed and the first one run un-captured;
* one GPU: a replay over caches the graphs were not captured on is refused before it runs, and a
  runner that says its step cannot be captured is refused before any capture;
* two GPUs: decode sharded over 2 ranks (NCCL, pcppass's deferred sync, checks on) with decode
  graphs: tokens equal to a single-rank run, every cache bitwise equal on both ranks after every
  step, one collective per replayed decode step.
"""

from __future__ import annotations

import pytest
import torch

from pcppass.engine.launch import launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

ENGINE = dict(num_blocks=192, max_num_batched_tokens=320, max_model_len=1024, max_num_seqs=8)


def workload(model, requests: int = 8):
    from pcppass.engine import WorkloadConfig, generate_workload

    return generate_workload(WorkloadConfig(num_requests=requests, prompt_len=(200, 700), max_new_tokens=(12, 20),
                                            prefix_hit_rate=0.5, block_size=64, vocab_size=model.config.vocab_size))


def serve(model, runner, graphs: bool):
    from pcppass.engine import Engine
    from pcppass.engine.graphs import decode_graph_sizes

    engine = Engine(model, runner=runner, **ENGINE)
    if graphs:
        engine.capture_decode_graphs()
    else:  # the same padding, launched eagerly: cuBLAS may pick another kernel for another row count
        engine.graph_sizes = decode_graph_sizes(engine.decode_rows_per_rank)
    engine.add_requests(workload(model))
    outputs = engine.run()
    return engine, outputs


@pytest.mark.parametrize("name", ["llama", "deepseek_v32"])
def test_decode_graphs_replay_the_eager_engine_bitwise(name):
    from pcppass.engine.runner import compiled_runner
    from pcppass.models import build_model

    model = build_model(name, "full", device="cuda", num_layers=2)
    runner = compiled_runner(model, fullgraph=True)
    eager, eager_out = serve(model, runner, graphs=False)
    graphed, graphed_out = serve(model, runner, graphs=True)
    replays, un_captured = graphed.runner.replays, graphed.runner.eager_steps
    decode_steps = sum(r.step_kind == "decode" for r in graphed.step_log)
    print(f"{name}: {decode_steps} decode steps, {replays} replayed, {un_captured} un-captured, "
          f"sizes {graphed.graph_sizes}")
    assert graphed_out == eager_out
    assert replays >= decode_steps - 2 and un_captured == 1
    for cache, t in eager.caches.items():
        assert torch.equal(t, graphed.caches[cache]), cache


def test_decode_graphs_refuse_reallocated_caches():
    from pcppass.engine import Engine
    from pcppass.engine.runner import compiled_runner
    from pcppass.models import build_model

    model = build_model("llama", "full", device="cuda", num_layers=2)
    engine = Engine(model, runner=compiled_runner(model, fullgraph=True), **ENGINE)
    engine.capture_decode_graphs(eager_every=0)
    engine.add_requests(workload(model, requests=2))
    while not engine.step_log or engine.step_log[-1].step_kind != "decode":
        engine.step()
    name = next(iter(engine.caches))
    engine.caches[name] = engine.caches[name].clone()
    with pytest.raises(ValueError, match=f"caches \\['{name}'\\] are not the tensors"):
        engine.step()


def sharded_with_graphs(rank: int, world: int):
    import torch.distributed as dist

    from pcppass.bench.inputs import caches_equal_across_ranks
    from pcppass.engine import Engine
    from pcppass.sync import rows_cuda
    from pcppass.models import build_model
    from pcppass.sharded import ShardedRunner, sharded_engine

    model = build_model("deepseek_v32", "full", device="cuda", num_layers=2)
    with rows_cuda.kernels_enabled(True):
        runner = ShardedRunner(model, inner="inductor")
        engine = sharded_engine(model, runner, world=world, rank=rank, **ENGINE)
        sizes = engine.capture_decode_graphs()
        engine.add_requests(workload(model))
        unequal = []
        while engine.step() is not None:
            equal = caches_equal_across_ranks(engine.caches)
            unequal += [(engine.step_log[-1].index, k) for k, ok in equal.items() if not ok]
    decode_syncs = [s.collectives for s in runner.step_syncs if s.step_kind == "decode"]
    reference = None
    if rank == 0:  # the same requests on one rank, eager launches
        single = Engine(model, **ENGINE)
        single.add_requests(workload(model))
        reference = single.run()
    dist.barrier()
    return dict(outputs=engine.outputs(), reference=reference, unequal=unequal, sizes=sizes,
                replays=engine.runner.replays, decode_syncs=decode_syncs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sharded_decode_graphs_keep_replicas_identical():
    results = launch(sharded_with_graphs, 2, backend="nccl", timeout_s=300)
    first = results[0]
    print({k: first[k] for k in ("sizes", "replays")}, "decode syncs", first["decode_syncs"])
    assert all(r["unequal"] == [] for r in results), [r["unequal"] for r in results]
    assert all(r["outputs"] == first["reference"] for r in results)
    assert first["replays"] > 0 and set(first["decode_syncs"]) == {1}


def test_a_step_the_runner_says_cannot_be_captured_is_refused_before_its_capture():
    """The runner is asked after its eager warm-up on all-padding steps (a runner knows what it
    compiled once it has run) and before any capture: a refused capture never starts."""
    from pcppass.engine import Engine
    from pcppass.engine.graphs import GraphCaptureError
    from pcppass.models import build_model

    model = build_model("llama", "tiny", device="cuda")
    calls = []

    class HostReading:
        def __call__(self, ids, positions, meta, caches, step_kind):
            calls.append(step_kind)
            return model(ids, positions, meta, caches)

        def capturable(self, step_kind):
            return False, "an operator that reads the device on the host"

    engine = Engine(model, runner=HostReading(), num_blocks=16, max_num_batched_tokens=16, max_model_len=64)
    with pytest.raises(GraphCaptureError, match="reads the device on the host"):
        engine.capture_decode_graphs()
    assert calls == ["decode", "decode"] and engine.graph_sizes == ()  # the warm-up of the first size only
    assert not torch.cuda.is_current_stream_capturing()
