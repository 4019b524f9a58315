"""The benchmark's decode inputs: consistent slots and tables, and replicas equal after sharded steps.

``pcppass bench`` times GPUs only; its step construction (:class:`pcppass.bench.inputs.DecodeSetup`,
round-robin ownership) is checked here on CPU with two gloo ranks and the eager inner compiler.
"""

import pytest
import torch

from pcppass.bench.inputs import DecodeSetup, caches_equal_across_ranks, owned
from pcppass.engine.launch import launch


def test_ownership_rotates_and_covers_every_request():
    for step in range(3):
        parts = [owned(8, 2, r, step) for r in range(2)]
        assert sorted(parts[0] + parts[1]) == list(range(8))
        assert len(parts[0]) == len(parts[1]) == 4
    assert owned(8, 2, 0, 0) == owned(8, 2, 1, 1)


@pytest.mark.parametrize("name", ["llama", "deepseek_v32"])
def test_slots_follow_tables(name):
    from pcppass.models import build_model

    model = build_model(name, "tiny")
    setup = DecodeSetup(model, requests=4, max_context=20, extra=3, seed=0, device="cpu")
    ids, positions, meta = setup.step([1, 3], context=12, position=13)
    for g in model.cache_groups():
        table = meta[f"block_table.{g.name}"]
        slots = meta[f"slot_mapping.{g.name}"]
        assert table.shape == (2, g.blocks_for(15, 1))
        for row in range(2):
            block = table[row, 13 // g.block_size]
            assert int(slots[row]) == int(block) * g.block_size + 13 % g.block_size
        assert len(set(table.flatten().tolist())) == table.numel()  # requests never share a block
    assert positions.tolist() == [13, 13]


def _sharded_steps(rank, world, name, schedule):
    from pcppass.compiler import PcpBackend
    from pcppass.models import build_model

    model = build_model(name, "tiny")
    setup = DecodeSetup(model, requests=4, max_context=9, extra=4, seed=3, device="cpu")
    compiled = torch.compile(model, backend=PcpBackend(schedule=schedule, inner="eager"), fullgraph=True)
    for step in range(3):
        compiled(*setup.step(owned(4, world, rank, step), 9, 9 + step), setup.caches)
    before_control = caches_equal_across_ranks(setup.caches)
    model(*setup.step(owned(4, world, rank, 0), 9, 12), setup.caches)  # no sync: replicas diverge
    return before_control, caches_equal_across_ranks(setup.caches)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,schedule", [("llama", "deferred"), ("deepseek_v32", "immediate")])
def test_sharded_steps_keep_replicas_equal(name, schedule):
    for synced, unsynced in launch(_sharded_steps, 2, name, schedule, backend="gloo", timeout_s=200):
        assert all(synced.values()), synced
        assert not all(unsynced.values())


def test_step_report_from_a_recorded_entry():
    """Derived numbers and tables of the decode-step bench from timings as a run records them."""
    from pcppass.bench import step_report
    from pcppass.bench.step import derive

    def timing(ms, graph_ms=None):
        d = {"slowest_rank_ms": ms, "median_ms": ms}
        if graph_ms is not None:
            d["cuda_graph"] = {"captured": True, "slowest_rank_ms": graph_ms}
        return d

    entry = {"rows_per_rank": 32, "context": 32768, "variants": {
        "replicated": timing(10.0, 9.0), "immediate": timing(6.0, 5.5), "deferred": timing(5.5, 5.0),
        "nosync": timing(5.0, 4.9)}, "bare_all_gather_sync_bytes": {"eager_us": 50.0, "graph_us": 25.0}}
    derive(entry)
    d = entry["derived"]
    assert d["ideal_speedup"] == 2.0 and d["deferred_speedup"] == 10.0 / 5.5
    assert abs(d["deferred_fraction_of_ideal"] - 5.0 / 5.5) < 1e-12
    assert abs(d["graph_deferred_sync_ms"] - 0.1) < 1e-9 and abs(d["graph_deferred_sync_vs_bare_all_gather"] - 4.0) < 1e-6
    result = {"environment": {"device": "H200", "date": "d", "torch": "t"},
              "config": {"world": 2, "sync_kernels": "device", "gather_hidden": True, "size": "full"},
              "models": {"llama": {"model": "llama", "layers": 2, "params": 1e9, "configs": [entry],
                                   "smoke": {"deferred": {"replicas_equal": True, "syncs_per_step": [[1, 10, 20]],
                                                          "transport": "peer stores",
                                                          "checks": {"inputs": True, "state_digest": False,
                                                                     "in_graph": {"header": True}}}}}}}
    text = step_report.markdown(result)
    assert "| 32 | 32768 | 10.000 | 6.000 | 5.500 | 5.000 | 2.000 | 0.500 / **90.9** | 1.000 / **83.3** |" in text
    assert ("transport **peer stores**; checks on: inputs; off: state_digest; in the graph's sync ops: header"
            in text)


def test_checks_stay_on_unless_a_twin_is_asked_for():
    """Every synced variant runs checked; ``--also-checks-off`` adds a checks-off twin beside each."""
    from pcppass.bench.step import model_specs
    from pcppass.bench.step_config import DEFAULT_VARIANTS, with_checks_off

    assert not any(v.endswith("_nochecks") for v in DEFAULT_VARIANTS)
    assert with_checks_off(("replicated", "deferred", "deferred_allgather", "nosync")) == (
        "replicated", "deferred", "deferred_allgather", "deferred_nochecks", "deferred_allgather_nochecks", "nosync")
    assert model_specs(("llama", "deepseek_v32:16"), (2, 4)) == [("llama", 2), ("llama", 4), ("deepseek_v32", 16)]


def test_checks_cost_and_replay_lines_of_a_recorded_entry():
    from pcppass.bench import step_report

    def graph(ms, **extra):
        return {"slowest_rank_ms": ms, "cuda_graph": {"captured": True, "slowest_rank_ms": ms, **extra}}

    m = {"configs": [{"rows_per_rank": 32, "context": 32768, "variants": {
        "deferred": graph(2.0, replicas_equal_after_replays=True, device_status="clean"),
        "deferred_nochecks": graph(1.99), "immediate": {"cuda_graph": {"captured": False, "reason": "why"}}}}]}
    assert step_report.checks_cost(m) == [
        "- N=32 C=32768 pcppass deferred: checks add 10.0 µs (0.50% of the checked step)"]
    lines = step_report._replay_lines(m)
    assert ("- N=32 C=32768 `deferred`: after the timed replays and one with rotated owners, replicas bitwise "
            "equal = **True**; device status clean") in lines
    assert "- N=32 C=32768 `immediate`: not captured (why)" in lines


def test_summary_table_names_transport_and_checks():
    from pcppass.bench import step_report

    def v(ms, transport=None, equal=None):
        g = {"captured": True, "slowest_rank_ms": ms}
        if equal is not None:
            g["replicas_equal_after_replays"] = equal
        return {"cuda_graph": g, **({"transport": transport} if transport else {})}

    entry = {"rows_per_rank": 32, "context": 32768, "variants": {
        "replicated": v(4.0), "deferred": v(2.1, "peer stores", True),
        "deferred_nochecks": v(2.09, "peer stores", True),
        "deferred_allgather": v(2.2, "all-gather (forced)", True), "nosync": v(2.0, equal=False)}}
    result = {"models": {"llama": {"model": "llama", "layers": 2, "configs": [entry]}}}
    lines = step_report.summary_table([result]).splitlines()
    assert lines[0] == ("| model | layers | N/rank | context | replicated ms | pcppass all-gather, checks on ms | "
                        "pcppass peer stores, checks on ms | pcppass peer stores, checks off ms | no sync ms | ideal | "
                        "% of ideal, pcppass all-gather, checks on | % of ideal, pcppass peer stores, checks on | "
                        "replicas equal after replays |")
    assert lines[2] == "| llama | 2 | 32 | 32k | 4.000 | 2.200 | 2.100 | 2.090 | 2.000 | 2.00× | 90.9 | 95.2 | True |"


def test_summary_table_puts_each_row_under_the_transport_it_ran():
    """A deferred variant on ordinary caches (all-gather) next to one in symmetric memory (peer
    stores): each lands in its own transport's column, never under the other's header."""
    from pcppass.bench import step_report

    def v(ms, transport=None):
        return {"cuda_graph": {"captured": True, "slowest_rank_ms": ms, "replicas_equal_after_replays": True},
                **({"transport": transport} if transport else {})}

    peer = {"rows_per_rank": 32, "context": 32768, "variants": {
        "replicated": v(4.0), "deferred": v(2.1, "peer stores"), "nosync": v(2.0)}}
    gather = {"rows_per_rank": 32, "context": 32768, "variants": {
        "replicated": v(40.0), "deferred": v(21.0, "all-gather (a cache is not in symmetric memory)"),
        "nosync": v(20.0)}}
    results = [{"models": {"m": {"model": "m", "layers": 2, "configs": [peer]}}},
               {"models": {"m": {"model": "m", "layers": 16, "configs": [gather]}}}]
    lines = step_report.summary_table(results).splitlines()
    assert lines[0] == ("| model | layers | N/rank | context | replicated ms | pcppass all-gather, checks on ms | "
                        "pcppass peer stores, checks on ms | no sync ms | ideal | "
                        "% of ideal, pcppass all-gather, checks on | % of ideal, pcppass peer stores, checks on | "
                        "replicas equal after replays |")
    assert lines[2] == "| m | 2 | 32 | 32k | 4.000 | – | 2.100 | 2.000 | 2.00× | – | 95.2 | True |"
    assert lines[3] == "| m | 16 | 32 | 32k | 40.000 | 21.000 | – | 20.000 | 2.00× | 95.2 | – | True |"
