"""The serving loop's bookkeeping (pcppass.engine.serve) and ``pcppass bench serve`` on CPU.

Single rank: every request completes with exactly its output length, at most ``concurrency`` are
in flight, submission follows the given order, the metrics follow from the recorded times, two
engines with different runners see the same submission and admission order. Two gloo ranks:
``pcppass bench serve --device cpu --world 2`` serves a small workload in every synchronised mode
and its own checks hold (same order on every rank and in every mode, replicas equal).
"""

import json

import pytest

from pcppass.engine import Engine, WorkloadConfig, generate_workload
from pcppass.engine.serve import ServingLoop, percentile
from pcppass.models import build_model


def serve(runner_factory=None, concurrency=3, num_requests=7):
    model = build_model("llama", "tiny")
    engine = Engine(model, runner=runner_factory(model) if runner_factory else None, num_blocks=96,
                    max_num_batched_tokens=24, max_num_seqs=concurrency, max_model_len=64)
    requests = generate_workload(WorkloadConfig(num_requests=num_requests, prompt_len=(10, 30),
                                                max_new_tokens=(2, 6), prefix_hit_rate=0.8, block_size=4))
    in_flight = []
    clock_ticks = iter(range(10**6))
    loop = ServingLoop(engine, requests, concurrency, clock=lambda: float(next(clock_ticks)),
                       on_step=lambda record, lp: in_flight.append(len(lp.in_flight)))
    return requests, loop.run(), in_flight


def test_every_request_completes_in_order_within_the_concurrency():
    requests, run, in_flight = serve()
    assert run.submitted == [r.req_id for r in requests]
    assert sorted(run.admitted) == sorted(run.submitted)
    assert max(in_flight) <= 3
    by_id = {r.req_id: r for r in requests}
    for timing in run.requests:
        assert timing.output_tokens == by_id[timing.req_id].max_new_tokens
        assert timing.submitted_s < timing.first_token_s <= timing.finished_s
        assert timing.ttft_s <= timing.e2e_s
    metrics = run.metrics()
    assert metrics["completed"] == len(requests)
    assert metrics["output_tokens"] == sum(r.max_new_tokens for r in requests)
    assert metrics["request_throughput"] == pytest.approx(len(requests) / run.duration_s)
    assert 0 < metrics["prefix_hit_rate"] < 1  # later requests hit the common prefix
    multi = [t for t in run.requests if t.output_tokens > 1]
    assert metrics["mean_tpot_ms"] == pytest.approx(
        1000 * sum((t.finished_s - t.first_token_s) / (t.output_tokens - 1) for t in multi) / len(multi))


def test_same_order_with_another_runner():
    from pcppass.engine.runner import compiled_runner

    _, eager, _ = serve()
    _, compiled, _ = serve(lambda model: compiled_runner(model, backend="eager"))
    assert eager.submitted == compiled.submitted and eager.admitted == compiled.admitted


def test_percentile_interpolates():
    assert percentile([1.0], 99) == 1.0
    assert percentile([0.0, 10.0], 50) == 5.0
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


@pytest.mark.timeout(400)
def test_cli_serve_cpu_world_2(tmp_path):
    from pcppass.cli import main

    code = main(["bench", "serve", "--device", "cpu", "--world", "2", "--model", "llama", "--hit-rates", "0.9",
                 "--modes", "replicated,pcppass,per_site", "--out", str(tmp_path), "--tag", "ci", "--timeout", "380"])
    result = json.loads((tmp_path / "serve_ci.json").read_text())
    assert code == 0, result.get("errors")
    assert [r["mode"] for r in result["runs"]] == ["replicated", "pcppass", "per_site"]
    assert all(v is not False for v in result["checks"].values()), result["checks"]
    for r in result["runs"]:
        assert r["completed"] == 6 and r["replicas_equal"]
        assert r["sync"]["mixed"]["transport"] != "none"
    assert (tmp_path / "serve_ci.md").exists()
