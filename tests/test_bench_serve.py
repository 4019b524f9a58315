"""The serving loop's bookkeeping (pcppass.engine.serve) and ``pcppass bench serve`` on CPU.

Single rank: every request completes with exactly its output length, at most ``concurrency`` are
in flight, submission follows the given order, the metrics follow from the recorded times, two
engines with different runners see the same submission and admission order. Two gloo ranks:
``pcppass bench serve --device cpu --world 2 --repeats 2`` serves a small workload in every
synchronised mode, two rounds with the modes' order rotated, and its own checks hold (same order on
every rank, in every mode and round, replicas equal). The report's aggregates over the rounds
(medians, ranges, signs per round) on a made-up result, and its markdown on a result file written
before the rounds existed.
"""

import json
import re
import statistics
from pathlib import Path

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


def test_mode_order_rotates_so_every_mode_takes_every_position():
    from pcppass.bench.serve import ServeBenchConfig, mode_order, run_order

    modes = ("a", "b", "c")
    assert mode_order(modes, 0) == modes
    assert mode_order(modes, 1) == ("b", "c", "a")
    assert mode_order(modes, 2) == ("c", "a", "b")
    assert mode_order(modes, 3) == modes
    for position in range(3):
        assert sorted(mode_order(modes, k)[position] for k in range(3)) == list(modes)
    cfg = ServeBenchConfig(modes=("a", "b"), hit_rates=(0.9, 0.5), repeats=2)
    assert list(run_order(cfg)) == [(0.9, 0, 0, "a"), (0.9, 0, 1, "b"), (0.9, 1, 0, "b"), (0.9, 1, 1, "a"),
                                    (0.5, 0, 0, "a"), (0.5, 0, 1, "b"), (0.5, 1, 0, "b"), (0.5, 1, 1, "a")]


def test_decode_graphs_are_captured_on_cuda_only_and_when_asked():
    from pcppass.bench.serve import ServeBenchConfig, _capture_decode_graphs

    class Engine:
        captured = 0

        def capture_decode_graphs(self):
            self.captured += 1
            return (2, 4)

    for cfg, expected in ((ServeBenchConfig(device="cuda"), 1), (ServeBenchConfig(device="cuda", cuda_graphs=False), 0),
                          (ServeBenchConfig(device="cpu"), 0)):
        engine = Engine()
        seconds, sizes = _capture_decode_graphs(engine, cfg)
        assert engine.captured == expected and (seconds is None) == (expected == 0)
        assert sizes == ([2, 4] if expected else None)


def fake_run(mode, repeat, req_s, hit=0.9, submitted=(0, 1, 2)):
    """One run entry as serve_once records it, with made-up numbers derived from ``req_s``."""
    return {"mode": mode, "hit_rate_target": hit, "repeat": repeat, "order_position": 0,
            "request_throughput": req_s, "output_throughput": 4 * req_s, "mean_tpot_ms": 100 / req_s,
            "mean_ttft_ms": 1000 / req_s, "mean_decode_step_ms": 50 / req_s, "mean_mixed_step_ms": None,
            "prefix_hit_rate": 0.89, "completed": 3, "submitted": list(submitted), "admitted": list(submitted),
            "replicas_equal": mode != "nosync", "outputs_digest": mode, "cuda_graphs": False, "sync": {}}


def fake_result(runs, repeats=3):
    return {"environment": {"date": "today", "torch": "t", "device": "cpu"},
            "config": {"model": "llama", "size": "tiny", "layers": 2, "world": 2, "inner": "eager",
                       "num_requests": 3, "prompt_len": 40, "output_len": 4, "concurrency": 3,
                       "max_num_batched_tokens": 16, "repeats": repeats},
            "runs": runs, "errors": []}


#: req/s per round; the medians' ratio (12 / 11) differs from the median of the per-round ratios
REQ_S = {"replicated": (10.0, 12.0, 11.0), "pcppass": (12.0, 11.0, 13.0), "nosync": (14.0, 13.0, 15.0)}


def test_aggregates_are_medians_ranges_and_per_round_signs():
    from pcppass.bench.serve_report import markdown, passed_checks, summarise

    runs = [fake_run(mode, k, req_s[k]) for k in range(3) for mode, req_s in REQ_S.items()]
    result = summarise([fake_result(runs), fake_result([dict(r) for r in runs])])
    assert passed_checks(result), result["checks"]
    rows = {a["mode"]: a for a in result["aggregates"]}
    assert list(rows) == list(REQ_S) and all(a["rounds"] == 3 for a in rows.values())
    pcp = rows["pcppass"]
    assert pcp["request_throughput"] == {"median": 12.0, "min": 11.0, "max": 13.0}
    assert pcp["mean_tpot_ms"]["median"] == pytest.approx(100 / 12)
    assert pcp["mean_tpot_ms"]["max"] == pytest.approx(100 / 11)
    assert pcp["mean_mixed_step_ms"] is None  # no run has the number
    assert pcp["req_s_vs_replicated"] == pytest.approx(12 / 11 - 1)
    assert pcp["gain_fraction_of_ideal"] == pytest.approx((12 - 11) / (14 - 11))
    assert pcp["req_s_vs_replicated_by_round"] == pytest.approx([12 / 10 - 1, 11 / 12 - 1, 13 / 11 - 1])
    assert pcp["rounds_above_replicated"] == "2/3"
    assert rows["nosync"]["rounds_above_replicated"] == "3/3"
    assert "rounds_above_replicated" not in rows["replicated"]
    # each run against its own round's replicated run
    assert [r["req_s_vs_replicated"] for r in result["runs"] if r["mode"] == "pcppass"] == pytest.approx(
        [12 / 10 - 1, 11 / 12 - 1, 13 / 11 - 1])
    assert result["checks"]["same_outputs_in_every_round (reported, not required)"] == "yes"
    text = markdown(result)
    assert "| 90% / 89.00% | pcppass | 3 | 12.000 | 11.000–13.000 | +9.09% | 2/3 | 33% |" in text


def test_checks_cover_every_round():
    from pcppass.bench.serve_report import passed_checks, summarise

    runs = [fake_run(mode, k, req_s[k]) for k in range(3) for mode, req_s in REQ_S.items()]
    runs[-1] = fake_run("nosync", 2, 15.0, submitted=(0, 2, 1))  # another order in the last round
    result = summarise([fake_result(runs)])
    assert result["checks"]["same_requests_and_order_in_every_mode"] is False and not passed_checks(result)
    result = summarise([fake_result(runs[:-1])])  # nosync missing from the last round
    assert result["checks"]["every_mode_ran_every_round"] is False
    assert {a["mode"]: a["rounds"] for a in result["aggregates"]}["nosync"] == 2


def test_markdown_renders_a_result_file_from_before_the_rounds():
    """A result file written before the rounds (the P = 2 llama serving run of 2026-11-30) has one
    run per (hit rate, mode): each is its own median and range, and its sign against replicated
    counts as one round."""
    from pcppass.bench.serve_report import markdown

    path = Path(__file__).resolve().parent / "data" / "serve_h200x2_llama_before_rounds.json"
    result = json.loads(path.read_text())
    text = markdown(result)
    rows = [line for line in text.splitlines() if re.match(r"\| \d+% / ", line)]  # the summary table's
    assert len(rows) == len(result["runs"]) == 16
    for r, row in zip(result["runs"], rows):
        req_s = f"{r['request_throughput']:.3f}"
        assert row.startswith(f"| {r['hit_rate_target']:.0%} / ") and f"| {r['mode']} | 1 | {req_s} | " \
            f"{req_s}–{req_s} |" in row, row
        if r["mode"] != "replicated":
            assert f"| {int(r['req_s_vs_replicated'] > 0)}/1 |" in row, row
    assert "### Every run, in the order run" in text


@pytest.mark.timeout(400)
def test_cli_serve_cpu_world_2(tmp_path):
    from pcppass.cli import main

    code = main(["bench", "serve", "--device", "cpu", "--world", "2", "--model", "llama", "--hit-rates", "0.9",
                 "--modes", "replicated,pcppass,per_site", "--repeats", "2", "--out", str(tmp_path), "--tag", "ci",
                 "--timeout", "380"])
    result = json.loads((tmp_path / "serve_ci.json").read_text())
    assert code == 0, result.get("errors")
    assert [(r["repeat"], r["order_position"], r["mode"]) for r in result["runs"]] == [
        (0, 0, "replicated"), (0, 1, "pcppass"), (0, 2, "per_site"),
        (1, 0, "pcppass"), (1, 1, "per_site"), (1, 2, "replicated")]
    assert all(v is not False for v in result["checks"].values()), result["checks"]
    assert result["checks"]["same_outputs_in_every_round (reported, not required)"] == "yes"
    for r in result["runs"]:
        assert r["completed"] == 6 and r["replicas_equal"]
        assert r["sync"]["mixed"]["transport"] != "none"
        assert r["cuda_graphs"] is False  # never on cpu
    assert [a["mode"] for a in result["aggregates"]] == ["replicated", "pcppass", "per_site"]
    for a in result["aggregates"]:
        values = [r["request_throughput"] for r in result["runs"] if r["mode"] == a["mode"]]
        assert a["rounds"] == 2
        assert a["request_throughput"] == {"median": statistics.median(values), "min": min(values),
                                           "max": max(values)}
    text = (tmp_path / "serve_ci.md").read_text()
    assert "2 round(s) per hit rate" in text and "/2 |" in text
